"""The driver's two consoles (rich): standard output for tables and progress, standard error for
errors. Shared by the command-line views and the study's progress line."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=False)
err = Console(stderr=True)
