"""Name -> plugin class. Plugins register themselves with :func:`register`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedsweep.algorithms.base import Algorithm

_REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    import fedsweep.algorithms  # noqa: F401  (imports every plugin module)


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get(name: str) -> type["Algorithm"]:
    _load()
    if name not in _REGISTRY:
        raise KeyError(f"unknown algorithm {name!r} (registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def create(name: str, hp=None) -> "Algorithm":
    cls = get(name)
    if isinstance(hp, dict):
        hp = cls.Params.model_validate(hp)
    return cls(hp)
