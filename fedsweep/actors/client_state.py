"""The state of one hosted client (its slot) and its checkpoint files.

A slot holds the client's data (raw and tokenised), its adapter tensors, optimiser state
and the method's per-client state. ``save_slots``/``restore_slots`` write and read them in
a round folder: ``client_<cid>.safetensors`` (tensors) and ``client_<cid>.json`` (the rest).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fedsweep import checkpoint as ckpt
from fedsweep.engine.text import Example
from fedsweep.algorithms.tensors import Params
from fedsweep.engine.optim import detach_state  # noqa: F401  (a client's optimiser state, copied)
from fedsweep.lazy import torch
from fedsweep.storage import location, reuse_file


@dataclass
class ClientSlot:
    cid: int
    train: list[dict]
    test: list[dict]
    train_enc: list[Example]
    test_enc: list[Example]
    params: Params
    rank: int = 8
    opt_state: dict | None = None
    algo_state: Params = field(default_factory=dict)
    rounds_trained: int = 0
    train_pref: list[dict] = field(default_factory=list)
    test_pref: list[dict] = field(default_factory=list)
    ref_logps: dict[str, torch.Tensor] = field(default_factory=dict)
    """DPO reference log-probs per split, (n, 2): the base is frozen, so computed once."""
    val_enc: list[Example] = field(default_factory=list)
    codec_residual: Params = field(default_factory=dict)
    """What the upload codec kept back (top-k's error feedback), checkpointed with the client."""
    algo_meta: dict[str, Any] = field(default_factory=dict)
    """The method's JSON per-client state (``ClientContext.meta``), checkpointed with the client."""
    saved_as: str | None = None
    """The round folder (``round_0003``) holding exactly this state: set when saved or restored,
    cleared by training. Only then are that round's files reused instead of rewritten."""


def _files(directory: str, cid: int):
    return location(directory) / f"client_{cid:05d}"


SAVE_THREADS = 4
"""Clients written at once by one actor: writing, hashing and fsync release the GIL, so files
overlap; 4 keeps the writer's buffers, one client's state per thread, small (docs/performance.md, 'The design's measurements')."""

Files = list[tuple[Any, list]]
"""(path, chunks) of files staged to be written (``checkpoint.write_chunks``)."""


class DeferredSave:
    """A round's client files snapshotted by :func:`stage_slots` and being written on a thread pool:
    ``result()`` waits for them and returns what :func:`save_slots` returns; ``copied()`` waits only
    until the state is copied out (the slots may change from then on)."""

    def __init__(self, out: dict[str, Any], copies: list[Future], futures: list[Future]):
        self._out, self._copies, self._futures = out, copies, futures

    def copied(self, timeout: float | None = None) -> None:
        """Wait until every written client's state is copied out (raises what a copy raised)."""
        for future in self._copies:
            future.result(timeout)

    def add(self, future: Future) -> None:
        """One more task (returning digests by file name) the save is not done without."""
        self._futures.append(future)

    def staged(self) -> dict[str, list[int]]:
        """The clients written and reused (known when staged)."""
        return {"written": list(self._out["written"]), "reused": list(self._out["reused"])}

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        out = {**self.staged(), "files": dict(self._out["files"])}
        for future in self._futures:
            out["files"].update(future.result(timeout))
        return out


def save_slots(slots: dict[int, ClientSlot], directory: str, previous: str | None = None) -> dict[str, Any]:
    """Write every slot's state into ``directory`` (a staging round folder).

    A client unchanged since it was saved into (or restored from) ``previous``, the last
    complete round, gets that round's files linked or copied instead of re-serialised: with
    partial participation most clients sit a round out. Returns {"written": cids, "reused":
    cids, "files": {file name: {"bytes", "sha256"}}}: the digests of what was written, computed
    from the bytes written, and of what was reused, from ``previous``'s manifest, so the round's
    manifest need not read them back.
    """
    recorded = ckpt.manifest_entries(location(previous)) if previous is not None else {}

    def save(slot: ClientSlot) -> tuple[str, dict[str, dict]]:  # one client's state at a time per thread
        how, files, snapshot = _plan_slot(slot, directory, previous, recorded)
        return how, {**files, **(write_files(_copy_out(snapshot)) if snapshot is not None else {})}

    if len(slots) > 1:
        with ThreadPoolExecutor(min(SAVE_THREADS, len(slots))) as pool:
            done = list(pool.map(save, slots.values()))
    else:
        done = [save(slot) for slot in slots.values()]
    return _merge(slots, done)


def stage_slots(slots: dict[int, ClientSlot], directory: str, previous: str | None,
                pool: ThreadPoolExecutor) -> DeferredSave:
    """What :func:`save_slots` does, with the copying and writing left to ``pool``: reused files are
    linked before this returns; every other slot's state is copied out (``checkpoint.tensor_chunks``)
    on the pool, ahead of any writing, and the caller waits for :meth:`DeferredSave.copied` before it
    changes a slot. The copies (one round's written state, in host memory) are then written, hashed
    and fsynced on the pool's threads."""
    recorded = ckpt.manifest_entries(location(previous)) if previous is not None else {}
    planned = [_plan_slot(slot, directory, previous, recorded) for slot in slots.values()]
    out = _merge(slots, [(how, files) for how, files, _ in planned])
    # every copy queued before any write: a write waits only on a copy already taken up
    copies = [pool.submit(_copy_out, snapshot) for _, _, snapshot in planned if snapshot is not None]
    return DeferredSave(out, copies, [pool.submit(lambda c=c: write_files(c.result())) for c in copies])


def write_files(todo: Files) -> dict[str, dict]:
    """Write staged files; their digests by file name."""
    return {path.name: ckpt.write_chunks(path, chunks).as_json() for path, chunks in todo}


def _merge(slots: dict[int, ClientSlot], done: list[tuple[str, dict[str, dict]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"written": [], "reused": [], "files": {}}
    for cid, (how, files) in zip(slots, done):
        out[how].append(cid)
        out["files"].update(files)
    return out


def _plan_slot(slot: ClientSlot, directory: str, previous: str | None,
               recorded: dict[str, dict]) -> tuple[str, dict[str, dict], tuple | None]:
    """Reuse one client's files (linked now), or take what is to be written by reference: ("written" |
    "reused", the digests known now, (file stem, tensor groups, JSON bytes) or None). The JSON is
    serialised now; the tensors are only referred to until :func:`_copy_out` copies them."""
    base = _files(directory, slot.cid)
    round_name = location(directory).name.removesuffix(".partial")
    files: dict[str, dict] = {}
    # reuse only what this state was saved as: a staged round that never committed does not count
    if previous is not None and slot.saved_as == location(previous).name:
        old = _files(previous, slot.cid)
        for suffix in (".safetensors", ".json"):
            source = old.with_suffix(suffix)
            reuse_file(source, base.with_suffix(suffix))
            if source.name in recorded:  # same name in both rounds
                files[source.name] = recorded[source.name]
        slot.saved_as = round_name
        return "reused", files, None
    groups = {"params": dict(slot.params), "algo": dict(slot.algo_state), "codec": dict(slot.codec_residual)}
    opt_meta = None
    if slot.opt_state is not None:
        groups["opt"], opt_meta = ckpt.optimizer_to_tensors(slot.opt_state)
    meta = {"cid": slot.cid, "rounds_trained": slot.rounds_trained, "optimizer": opt_meta, "algo_meta": slot.algo_meta}
    slot.saved_as = round_name
    return "written", files, (base, groups, ckpt.json_bytes(meta))


def _copy_out(snapshot: tuple) -> Files:
    """The files of a planned slot, its tensors copied out (``checkpoint.tensor_chunks``)."""
    base, groups, meta = snapshot
    return [(base.with_suffix(".safetensors"), ckpt.tensor_chunks(ckpt.flatten(groups))),
            (base.with_suffix(".json"), [meta])]


def restore_slots(slots: dict[int, ClientSlot], directory: str) -> int:
    """Load every slot's state from the round folder ``directory``; returns that round's number."""
    for cid, slot in slots.items():
        base = _files(directory, cid)
        groups = ckpt.nest(ckpt.read_tensors(base.with_suffix(".safetensors")))
        meta = ckpt.read_json(base.with_suffix(".json"))
        slot.params = groups.get("params", slot.params)
        slot.algo_state = groups.get("algo", {})
        slot.codec_residual = groups.get("codec", {})
        slot.rounds_trained = meta["rounds_trained"]
        slot.algo_meta = meta.get("algo_meta") or {}
        slot.saved_as = location(directory).name
        slot.opt_state = (ckpt.optimizer_from_tensors(groups.get("opt", {}), meta["optimizer"])
                          if meta["optimizer"] else None)
    return ckpt.read_json(location(directory) / "COMPLETE")["round"]
