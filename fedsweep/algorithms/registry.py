"""Name -> plugin class, and each plugin's declared capabilities. Plugins register with :func:`register`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedsweep.algorithms.base import Algorithm, Capabilities

_REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
    """Class decorator: make ``cls`` available under ``cls.name`` with its ``cls.capabilities``."""
    from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams

    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"{cls!r} is not an Algorithm subclass")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    if not isinstance(cls.capabilities, Capabilities):
        raise TypeError(f"{cls.__name__}.capabilities must be a Capabilities, got {type(cls.capabilities).__name__}")
    if not issubclass(cls.Params, HyperParams):
        raise TypeError(f"{cls.__name__}.Params must subclass HyperParams (unknown keys refused)")
    _REGISTRY[cls.name] = cls
    return cls


PLUGINS_ENV = "FEDSWEEP_PLUGINS"
"""Comma-separated importable modules holding plugins outside fedsweep (e.g. ``mylab.methods``)."""


def _load() -> None:
    import importlib
    import os

    # (fedsweep's own plugins are registered already: importing this module ran the package's
    # __init__, which imports every plugin module)
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(module)  # its @register decorators run on import


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get(name: str) -> type["Algorithm"]:
    _load()
    if name not in _REGISTRY:
        raise KeyError(f"unknown algorithm {name!r} (registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def capabilities(name: str) -> "Capabilities":
    """What method ``name`` needs from the system and accepts."""
    return get(name).capabilities


def create(name: str, hp=None) -> "Algorithm":
    cls = get(name)
    if isinstance(hp, dict):
        hp = cls.Params.model_validate(hp)
    return cls(hp)
