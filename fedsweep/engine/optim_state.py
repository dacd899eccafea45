"""A client's optimiser state as a stacked optimiser leaves it: one row per moment, read as a torch
optimiser's state dict only when something asks.

After a group's round each client's AdamW state is its own (its rows of the group's moment buffers,
copied out) and must read as its own ``torch.optim.AdamW``'s ``state_dict()`` — ``{"state": {i:
{"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``, tensors in the client's shapes — for a
checkpoint, a client trained alone next, or a test. Built eagerly that is one view per tensor per
moment and a step counter per tensor: 720 objects per SmolLM2-135M client, 36,000 host calls for
50 clients on a round's path (a GPU waits on the host for them). Kept as rows, the next group writes
each row back with one copy, and the per-tensor dict is built (once, as views of the rows) only
where it is read — by a checkpoint every round, in a run: a state read and left as built still goes
back as its rows (:meth:`FlatOptimizerState.fits`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fedsweep.lazy import torch
from fedsweep.algorithms.tensors import FlatLayout


class FlatOptimizerState(Mapping):
    """A client's optimiser state: ``rows[name]`` its moment ``name`` as one row (P,) laid out by
    ``layout``, ``step`` its step count, ``param_groups`` its optimiser's. Reads as the torch state
    dict (keys ``state`` and ``param_groups``); ``state`` is built on first read, its tensors views of
    the rows (a change to them is a change to the rows)."""

    def __init__(self, layout: FlatLayout, rows: dict[str, torch.Tensor], step: float, param_groups: list[dict]):
        self.layout, self.rows, self.step, self.param_groups = layout, dict(rows), float(step), param_groups
        self._state: dict[int, dict[str, Any]] | None = None
        self._built: tuple | None = None  # (every entry and tensor ``state`` was built with, the step counters)

    @property
    def read(self) -> bool:
        """Whether ``state`` was built (read by a checkpoint, a test, …)."""
        return self._state is not None

    def fits(self, layout: FlatLayout) -> bool:
        """Whether the rows are the whole state and can be written as they are into a buffer laid out
        by ``layout``: unread, or read and left as built — the same entries holding the same tensors
        (views of the rows: a change in place is a change of the rows) and every step counter still
        the step."""
        if not (self.layout is layout or (self.layout.shapes == layout.shapes and list(self.layout.shapes) == list(layout.shapes))):
            return False
        if self._state is None:
            return True
        entries, tensors, counts = self._built
        state = self._state
        if len(state) != len(entries) or any(state.get(i) is not e or len(e) != 1 + len(self.rows)
                                             for i, e in enumerate(entries)):
            return False
        now = [t for e in entries for t in e.values()]
        return all(a is b for a, b in zip(now, tensors)) and bool((counts == self.step).all())

    def _build(self) -> dict[int, dict[str, Any]]:
        views = {name: self.layout.views(row) for name, row in self.rows.items()}
        # each tensor its own step: a 0-dim element of one float32 tensor, as torch's optimiser keeps it
        counts = torch.full((len(self.layout.shapes),), self.step, dtype=torch.float32)
        steps = counts.unbind()
        state = {i: {"step": steps[i], **{name: v[key] for name, v in views.items()}}
                 for i, key in enumerate(self.layout.shapes)}
        entries = [state[i] for i in range(len(state))]
        self._built = (entries, [t for e in entries for t in e.values()], counts)
        return state

    def __getitem__(self, key: str) -> Any:
        if key == "state":
            if self._state is None:
                self._state = self._build()
            return self._state
        if key == "param_groups":
            return self.param_groups
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("state", "param_groups"))

    def __len__(self) -> int:
        return 2

