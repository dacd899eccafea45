"""The errors fedsweep raises for problems a user can fix, one family the CLI catches once.

Each message is what the user reads: one line naming the field, file, record or resource, the
value and what would be accepted (a config with several problems lists them one per line).
"""

from __future__ import annotations


class FedsweepError(Exception):
    """Base of every user-facing fedsweep error (exit code 2, no traceback)."""


class ConfigError(FedsweepError, ValueError):
    """A configuration problem. ``problems`` holds every one found in the file, one line each."""

    def __init__(self, message: str = "", problems: list[str] | None = None):
        self.problems = list(problems) if problems else [message]
        super().__init__(message or "\n".join(self.problems))


class DataError(FedsweepError, ValueError):
    """A dataset that cannot be read or does not hold what the config says."""


class ModelError(FedsweepError, ValueError):
    """A model that cannot be found, converted or loaded."""


class AdapterError(FedsweepError, ValueError):
    """An adapter (LoRA targets, ReFT layers) that does not fit the model."""


class RunError(FedsweepError, RuntimeError):
    """A run that cannot start or continue: resources, resumption, a failed round."""


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as its escape (``\\x1e``, ``\\n``):
    what a user put in a key or value can neither break an error's one line nor hide in it."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``: how a failure a run survives (a client left out, a call
    retried) is named in its round's report."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
