"""One module per ``fedsweep`` command: ``add(subparsers)`` declares it, its handler runs it."""
