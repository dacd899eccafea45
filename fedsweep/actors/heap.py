"""Python's cyclic garbage collector around an actor's construction.

Constructing a client actor imports torch, transformers and peft and builds the model: hundreds of
thousands of objects that live as long as the process. With the collector on, the heap's growth set
off full collections during construction, and every full collection later in the run walked all of
it again, in a client actor's training or on the server's round path. So an actor is constructed with
the collector paused; at the end one full collection frees what construction left in reference cycles,
and what survives is frozen (``gc.freeze``): later collections look only at objects made since
(the figures: docs/performance.md, 'The design's measurements').

Only in an actor's own process: a class constructed in-process (tests, tools) leaves the caller's
collector alone, as freezing the caller's heap would keep its later garbage for good.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import ray

Init = TypeVar("Init", bound=Callable[..., None])


def in_actor_process() -> bool:
    """Whether this code runs inside a Ray actor (its process is the actor's alone)."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def built_then_frozen(init: Init) -> Init:
    """Decorates an actor's ``__init__``: in an actor's process it runs with the cyclic collector
    paused, then one full collection, ``gc.freeze()``, and the collector back as it was (also when
    construction raises). Elsewhere ``init`` runs as it is."""

    @functools.wraps(init)
    def construct(self, *args: Any, **kwargs: Any) -> None:
        if not in_actor_process():
            return init(self, *args, **kwargs)
        enabled = gc.isenabled()
        gc.disable()
        try:
            return init(self, *args, **kwargs)
        finally:
            gc.collect()
            gc.freeze()
            if enabled:
                gc.enable()

    return construct  # type: ignore[return-value]


@contextlib.contextmanager
def frozen_heap():
    """What a client actor's heap is after construction, for work timed in another process (``fedsweep
    bench``): one full collection, what survives frozen for the block (later collections look only
    at objects made since), then back in the collector's generations."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
