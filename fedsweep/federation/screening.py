"""Screening of client updates before aggregation: non-finite uploads or losses, exploding training
losses, and updates whose norm is out of proportion (to the parameters they started from, or to the
other clients' updates). Norms are measured as each training call answers (:class:`UpdateNorms`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsweep.algorithms.tensors import Params, as_vector
from fedsweep.federation.update import start_of
from fedsweep.lazy import torch


def start_vector(start: Params, params: Params) -> torch.Tensor:
    """θ_start (``update.start_of``) laid out as ``as_vector`` lays out ``params``, in float64."""
    return as_vector(start_of(start, params), torch.float64).to(next(iter(params.values())).device)


def nonfinite(upload_params) -> str | None:
    """The first tensor holding a NaN or an infinity, named; None if every value is finite."""
    return next((f"non-finite values in {k}" for k, v in (upload_params or {}).items()
                 if not bool(torch.isfinite(v).all())), None)


class UpdateNorms:
    """Per client with uploaded parameters: ‖θ_k − θ_start‖ in float64 (‖θ_k‖ for a tensor its start
    lacks or shapes differently, and without a start), and ‖θ_start‖ (clients with a start). A start
    shared by many clients (a global model) is laid out and measured once. A norm is finite exactly
    when every uploaded value is (float32 squares cannot overflow float64).

    The server adds each training call's results (:meth:`add`) as the call answers, while the
    actors still train: after the round's last answer only that answer's clients are left to
    measure."""

    def __init__(self, starts: dict) -> None:
        self.starts = starts
        self._measured: dict[int, tuple[Any, float | None, float | None]] = {}  # cid -> (result, norm, size)
        self._laid_out: dict[tuple, torch.Tensor] = {}
        self._start_norm: dict[int, float] = {}

    def add(self, results: dict) -> None:
        for cid, r in results.items():
            if cid not in self._measured or self._measured[cid][0] is not r:  # new, or trained again
                if r.upload.params is None and r.screen is not None:  # measured where it trained
                    self._measured[cid] = (r, r.screen["norm"], r.screen["start_norm"])
                else:
                    self._measured[cid] = (r, *self.measure(cid, r.upload.params))

    def measure(self, cid: int, params: Params | None) -> tuple[float | None, float | None]:
        """(‖θ_k − θ_start‖, ‖θ_start‖) of client ``cid``'s uploaded ``params`` (None where it uploads none;
        the second None without a start); the client actor of a partial sum measures with this too."""
        if not params:
            return None, None
        vec, start = as_vector(params, torch.float64), self.starts.get(cid)  # (one vector per set, not a
        # norm per tensor: an upload is a hundred tensors or more)
        if not start:
            return float(torch.linalg.vector_norm(vec)), None
        key = (id(start), tuple((k, tuple(v.shape)) for k, v in params.items()))
        if key not in self._laid_out:
            self._laid_out[key] = start_vector(start, params)
        if id(start) not in self._start_norm:
            self._start_norm[id(start)] = float(torch.linalg.vector_norm(as_vector(start, torch.float64)))
        return float(torch.linalg.vector_norm(vec - self._laid_out[key])), self._start_norm[id(start)]

    def of(self, results: dict) -> tuple[dict[int, float], dict[int, float]]:
        """(update norms, start norms) of ``results``' clients, measuring what was not added yet."""
        self.add(results)
        measured = [(cid, *self._measured[cid][1:]) for cid in results]
        return ({cid: n for cid, n, _ in measured if n is not None},
                {cid: size for cid, _, size in measured if size is not None})


def update_norms(results: dict, starts: dict) -> tuple[dict[int, float], dict[int, float]]:
    """:class:`UpdateNorms` of ``results`` at once."""
    return UpdateNorms(starts).of(results)


def screen(results: dict, starts: dict, max_update_ratio: float, max_loss_ratio: float,
           measured: UpdateNorms | None = None) -> dict[int, str]:
    """Reasons to reject client results: non-finite uploads or losses, an exploding training loss
    (last > ``max_loss_ratio`` × first), an update norm (:func:`update_norms`) above
    ``max_update_ratio`` × the norm of the parameters it started from (caught even when every client
    diverges alike), or above ``max_update_ratio`` × the median of the other clients' update norms
    (leave-one-out, so one diverged client of two is still caught). ``measured``: norms measured as
    the results came (from the same ``starts``)."""
    why: dict[int, str] = {}
    all_norms, sizes = (measured or UpdateNorms(starts)).of(results)
    norms: dict[int, float] = {}
    for cid, r in results.items():
        norm = all_norms.get(cid)
        bad = (nonfinite(r.upload.params) or (r.screen or {}).get("nonfinite")) \
            if norm is not None and not math.isfinite(norm) else None
        loss, first, last = (r.metrics.get(k) for k in ("train_loss", "train_loss_first", "train_loss_last"))
        if bad:
            why[cid] = f"update rejected: {bad}"
        elif loss is not None and not np.isfinite(loss):
            why[cid] = f"update rejected: non-finite training loss {loss}"
        elif first is not None and last is not None and np.isfinite(first) and first > 0 and last > max_loss_ratio * first:
            why[cid] = f"update rejected: training loss exploded ({first:.4g} → {last:.4g})"
        elif norm is not None:
            norms[cid] = norm
    for cid in list(norms):  # an update far larger than the parameters it started from: every client may diverge
        size = sizes.get(cid)
        if size and norms[cid] > max_update_ratio * size:
            why[cid] = (f"update rejected: norm {norms[cid]:.4g} is over {max_update_ratio:g}× that of the "
                        f"parameters it started from ({size:.4g})")
            del norms[cid]
    for cid, n in norms.items():
        others = [m for c, m in norms.items() if c != cid]
        if not others:
            continue
        med = float(np.median(others))
        if med > 0 and n > max_update_ratio * med:
            why[cid] = f"update rejected: norm {n:.4g} is over {max_update_ratio:g}× the others' median {med:.4g}"
    return why
