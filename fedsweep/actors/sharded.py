"""A sharded client (``clients.shard``): G processes, one frozen base sharded over them.

:class:`ShardedClientActor` is process 0, the one the server talks to: it is a ClientActor whose
calls that compute on the model (train, evaluate, restore) are first forwarded to its
:class:`ShardFollower` processes, in the order they arrive, so that every process runs the same
client code on the same inputs and enters the same collectives (:mod:`fedsweep.actors.shard_group`).
Their results agree by construction (the adapter's gradients and losses are averaged over the
group); the leader checks it and returns its own. The adapter is whole on every process, so
checkpoints are written by the leader alone and hold the whole adapter, and a run resumes on any
number of processes.

A process that dies takes the group with it (NCCL and gloo groups cannot take a new member): the
group is not restarted in the run; its clients fail and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedsweep.actors.client import ClientActor
from fedsweep.actors.probe import NO_PROBE, Probe
from fedsweep.actors.shard_group import ShardGroup, free_address
from fedsweep.engine.base import device_of


def process_device(resources) -> torch.device:
    """This process's device, with its index (Ray shows each process its own GPU as device 0)."""
    device = device_of(resources)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


class ShardFollower(ClientActor):
    """Process 1…G−1 of a sharded client: started empty, it joins its group when the leader asks."""

    def __init__(self):  # the ClientActor is constructed in join(), once the group's address is known
        self.slots = {}

    def join(self, cfg, clients: list[dict[str, Any]], restore_from: str | None, pool: list[dict] | None,
             rank: int, address: str) -> int:
        shard, res = cfg.clients.shard, cfg.clients.resources
        group = ShardGroup.join(rank, shard.gpus_per_client, address, shard.comm(res.num_gpus),
                                process_device(res), cfg.server.call_timeout_s)
        ClientActor.__init__(self, cfg, clients, restore_from, pool, group=group)
        return rank


class ShardedClientActor(ClientActor):
    """Process 0 of a sharded client; to the server, one client actor."""

    def __init__(self, cfg, clients: list[dict[str, Any]], restore_from: str | None = None,
                 pool: list[dict] | None = None, followers: list | None = None, probe: Probe = NO_PROBE):
        import ray

        self.followers = list(followers or [])
        shard, res = cfg.clients.shard, cfg.clients.resources
        if len(self.followers) != shard.gpus_per_client - 1:
            raise ValueError(f"a sharded client of {shard.gpus_per_client} processes got {len(self.followers)} followers")
        address = free_address()
        joins = [f.join.remote(cfg, clients, restore_from, pool, r + 1, address) for r, f in enumerate(self.followers)]
        group = ShardGroup.join(0, shard.gpus_per_client, address, shard.comm(res.num_gpus), process_device(res),
                                cfg.server.call_timeout_s)
        super().__init__(cfg, clients, restore_from, pool, group=group, probe=probe)
        ray.get(joins, timeout=cfg.server.call_timeout_s)

    def _on_every_process(self, method: str, *args, **kwargs):
        """Run ``method`` here and on every follower (forwarded first, in call order); the leader's result."""
        import ray

        refs = [getattr(f, method).remote(*args, **kwargs) for f in self.followers]
        t0 = time.monotonic()
        try:
            mine = getattr(super(), method)(*args, **kwargs)
        except BaseException:  # the followers' errors are the same one, or a consequence: collect, then raise
            try:
                ray.get(refs, timeout=30)
            except Exception:
                pass
            raise
        theirs = ray.get(refs, timeout=max(60.0, self.cfg.server.call_timeout_s - (time.monotonic() - t0)))
        for rank, other in enumerate(theirs, start=1):
            agree(method, mine, other, rank)
        return mine

    def train(self, rnd: int, cid: int, payload):
        return self._on_every_process("train", rnd, cid, payload)

    def train_many(self, rnd: int, items, *payloads, partial_sum: bool = False):
        return self._on_every_process("train_many", rnd, items, *payloads, partial_sum=partial_sum)

    def evaluate_many(self, rnd: int, groups):
        return self._on_every_process("evaluate_many", rnd, groups)

    def evaluate(self, rnd: int, cid: int, payload) -> dict[str, float]:
        return self._on_every_process("evaluate", rnd, cid, payload)

    def restore(self, directory: str) -> None:
        return self._on_every_process("restore", directory)


def agree(method: str, mine, other, rank: int) -> None:
    """Processes of one group must end a call with the same losses (they are averaged over the group):
    a difference means they ran different code or data, and the group is out of step."""
    if method == "train":
        pairs = [(mine.metrics.get("train_loss"), other.metrics.get("train_loss"))]
    elif method == "train_many":
        pairs = [(_loss(a, "train"), _loss(b, "train")) for (_, a), (_, b) in zip(mine[1], other[1])]
    elif method == "evaluate":
        pairs = [(mine.get("test_loss"), other.get("test_loss"))]
    elif method == "evaluate_many":
        pairs = [(mine[1][cid].get("test_loss"), other[1].get(cid, {}).get("test_loss")) for cid in mine[1]]
    else:
        return
    for a, b in pairs:
        if a != b and not (a != a and b != b):  # NaN on both is agreement
            raise RuntimeError(f"sharded client out of step: {method} loss {a!r} on process 0, {b!r} on process {rank}")


def _loss(answer, kind: str):
    """A train_many entry's training loss (its error text where it failed)."""
    return answer if isinstance(answer, str) else answer.metrics.get(f"{kind}_loss")
