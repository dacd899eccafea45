"""torch, imported where it is first used rather than where it is named.

The driver of a run (``fedsweep run``, ``bench run``, ``tune``: config, layout, Ray, tracking)
imports the methods' modules for their hyperparameter classes and capabilities, and the actor
modules for the classes Ray starts; it never computes with a tensor. ``import torch`` there cost
seconds of CPU and hundreds of MiB, on cores the actors were importing on (docs/performance.md, 'The design's measurements'). So the
modules the driver imports name torch through :data:`torch` here: a stand-in module whose first
attribute access imports torch and then puts torch itself in its place in every module that named
it (so nothing is paid per lookup afterwards). Inside an actor the first tensor operation imports
torch as before.

Rules for those modules (``tests/test_lazy_torch.py`` checks the driver's path stays free of
torch): no ``torch.…`` evaluated at import time (module constants, default arguments, decorators:
use :func:`no_grad` for the decorator), no ``import torch.x`` submodule statements, and no
``from torch import …``. Type annotations are free (``from __future__ import annotations``).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any, Callable


class _Torch(types.ModuleType):
    """Looks up every attribute on the real torch, importing it on the first lookup."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_import() if torch is STAND_IN else torch, name)  # (this module's own name is rebound too)

    def __dir__(self):
        return dir(importlib.import_module("torch"))

    def __reduce__(self):  # pickled (cloudpickle, Ray) as the real module, imported on the other side
        return importlib.import_module, ("torch",)

    def __repr__(self) -> str:
        return f"<lazy module 'torch' ({'imported' if loaded() else 'not imported yet'})>"


def _import() -> types.ModuleType:
    """Import torch; once it is whole, every module that holds the stand-in as its global ``torch``
    gets torch itself instead, so that hot loops (a lookup per tensor) pay nothing after the first."""
    real = sys.modules.get("torch")
    if real is None or getattr(real.__spec__, "_initializing", False):  # absent, or another thread imports it
        real = importlib.import_module("torch")  # (waits for that thread, as `import torch` would)
    if not getattr(real.__spec__, "_initializing", False):  # not while torch's own import runs
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)  # the dict itself: no module's __getattr__ runs
            if isinstance(namespace, dict) and namespace.get("torch") is STAND_IN:
                namespace["torch"] = real
    return real


STAND_IN = _Torch("torch")
torch: Any = STAND_IN
"""Use as the module ``torch``: ``from fedsweep.lazy import torch`` (torch itself once imported)."""


def import_now() -> types.ModuleType:
    """torch, imported now if it was not: for a process that will need it and would otherwise wait idle
    (the server actor, while the client actors build θ_0)."""
    return _import() if torch is STAND_IN else torch


def loaded() -> bool:
    """Whether this process has imported torch."""
    return "torch" in sys.modules


def no_grad(fn: Callable) -> Callable:
    """``@torch.no_grad()`` for a function defined at import time, without importing torch then."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)

    return call
