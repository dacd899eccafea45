"""A client actor's frozen base at the version its payloads name, and what depends on that version.

Methods that merge aggregates into the base (``capabilities.base_merges``) send a version number and
the cumulative update; the base is W_0 plus it, applied once per version. The DPO reference
log-probs of a client's pairs are the frozen base's, computed once per version.
"""

from __future__ import annotations

from fedsweep.actors.client_state import ClientSlot
from fedsweep.algorithms.types import Payload
from fedsweep.lazy import torch


class BaseVersions:
    def __init__(self, base, slots: dict[int, ClientSlot]) -> None:
        self.base, self.slots = base, slots
        self.version: int | None = None
        self._w0: dict[str, torch.Tensor] = {}

    def apply(self, payload: Payload) -> None:
        """Keep the frozen base at W_0 + the payload's cumulative update (once per version)."""
        version = payload.base_version
        if version is None or version == self.version:
            return
        weights = self.base.adapters.base_weights()
        with torch.no_grad():
            for module, delta in payload.base_deltas.items():
                w = weights[module]
                if module not in self._w0:
                    self._w0[module] = w.detach().clone()
                w.copy_(self._w0[module] + delta.to(w.device, w.dtype))
        self.version = version
        for slot in self.slots.values():
            slot.ref_logps.clear()  # the reference policy is the (changed) base

    def reset(self) -> None:
        """The base back at W_0 (a run rewound to before round 1)."""
        weights = self.base.adapters.base_weights() if self._w0 else {}
        with torch.no_grad():
            for module, w0 in self._w0.items():
                weights[module].copy_(w0)
        self.version = None
        for slot in self.slots.values():
            slot.ref_logps.clear()

    def reference(self, slot: ClientSlot, split: str) -> torch.Tensor:
        """DPO reference log-probs (the frozen base's) of every pair of ``slot``'s ``split``, computed once."""
        if split not in slot.ref_logps:
            slot.ref_logps[split] = self.base.reference_logps(slot.train_pref if split == "train" else slot.test_pref)
        return slot.ref_logps[split]
