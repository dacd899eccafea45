"""The driver's two consoles (rich): standard output for tables and progress, standard error for
errors. Shared by the command-line views and the study's progress line.

Everything they write passes :func:`fedsweep.storage.without_userinfo`: a URI's ``user:token@`` is
never printed, whichever message carries it (a table title, a warning, an error line)."""

from __future__ import annotations

import sys

from rich.console import Console

from fedsweep.storage import without_userinfo


class _Redacting:
    """``sys.stdout`` or ``sys.stderr`` (looked up at each write: a test's capture takes it) with the
    userinfo of every URI removed from what is written."""

    def __init__(self, name: str):
        self._name = name

    def write(self, text: str) -> int:
        return getattr(sys, self._name).write(without_userinfo(text))

    def __getattr__(self, attr):
        return getattr(getattr(sys, self._name), attr)


console = Console(file=_Redacting("stdout"))
err = Console(file=_Redacting("stderr"))
