"""Host work: computation that runs torch but no model — pFedGPT's GP fits and acquisitions — marked so
that an operator count (``bench.ops.count_ops``) counts it apart from the model's calls.

The mark is a profiler scope (``fedsweep::host``, seen in traces) and, while a count watches, a call
of the count's own context manager around the block: the count closes its profiler window there and
opens another, so no window holds more than one block's events (a round of pFedGPT's HBO over 50
clients is millions of host calls: kept in one window they took 23 GB).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

SCOPE = "fedsweep::host"
"""The profiler scope of host work."""

_watchers: list[Callable[[], ContextManager]] = []
_inside = [0]


@contextmanager
def host_work() -> Iterator[None]:
    """Run the block as host work (module docstring); a block inside another is part of it."""
    from fedsweep.lazy import torch

    watch = _watchers[-1] if _watchers and not _inside[0] else None
    _inside[0] += 1
    try:
        # the count's window outside the scope: a profiler never closes with a scope of its own open
        with watch() if watch is not None else nullcontext(), torch.profiler.record_function(SCOPE):
            yield
    finally:
        _inside[0] -= 1


@contextmanager
def watched_by(watch: Callable[[], ContextManager]) -> Iterator[None]:
    """While the block runs, every outermost :func:`host_work` block runs inside ``watch()``."""
    _watchers.append(watch)
    try:
        yield
    finally:
        _watchers.remove(watch)
