"""``python -m fedsweep.cli``: the ``fedsweep`` command (as Ray job entrypoints run it)."""

import sys

from fedsweep.cli import main

sys.exit(main())
