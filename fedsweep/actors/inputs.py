"""A client actor's large constructor arguments kept in files of its run folder, not in Ray's object store.

Ray restarts a dead client actor (``max_restarts``) by calling its constructor again with the same
arguments. An argument held in the object store is gone with a lost node or an evicted object, and the
restart fails (Ray warns of it for every such actor: ray-project/ray#53727). So the driver writes each
actor's clients' data and the validation pool into the run folder (:func:`keep`) and hands the actor a
:class:`Kept` — a path, a few bytes — which the actor reads (:func:`loaded`) at every construction.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsweep.storage import AnyPath, location, private_dir, write_atomic


@dataclass(frozen=True)
class Kept:
    """A constructor argument kept in the file ``path`` (local or a storage URI)."""

    path: str

    def load(self) -> Any:
        return pickle.loads(location(self.path).read_bytes())


def keep(folder: AnyPath, name: str, value: Any) -> Kept:
    """``value`` written whole to ``folder/name`` (the folder the user's alone); its :class:`Kept`."""
    path = private_dir(folder) / name
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if isinstance(path, Path):
        write_atomic(path, data)
    else:
        path.write_bytes(data)
    return Kept(str(path))


def loaded(value: Any) -> Any:
    """``value`` itself, or what a :class:`Kept` holds."""
    return value.load() if isinstance(value, Kept) else value
