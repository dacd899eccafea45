"""``python -m fedsweep.orchestrator.cli``: the ``fedsweep`` command (as Ray job entrypoints run it)."""

import sys

from fedsweep.orchestrator.cli import main

sys.exit(main())
