"""The torch.distributed group of one sharded client, seen from one of its processes.

Every process of the group runs the same client code on the same inputs (the leader forwards each
call to the others in order), so the control flow is identical and every collective is entered by
all. What differs is the rows of each batch a process computes (:meth:`ShardGroup.rows`); the
gradients of the replicated adapter and the losses are then averaged over the group, which makes
one step of the group equal one step of an unsharded client on the whole batch:

    ∇ (1/G) Σ_r [ G · ℓ_r + R(θ) ] = ∇ [ Σ_r ℓ_r + R(θ) ] = ∇ [ ℓ + R(θ) ]

where ℓ_r is process r's rows' share of the batch loss ℓ (its summed token losses over the batch's
token count) and R(θ) a method's regulariser (FedProx's proximal term, SCAFFOLD's control
variates), which every process adds whole.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from fedsweep.lazy import torch


def free_address() -> str:
    """``tcp://HOST:PORT`` of a free port on this node, for the group's rendezvous (rank 0 listens)."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


@dataclass
class ShardGroup:
    rank: int
    size: int

    @classmethod
    def join(cls, rank: int, size: int, address: str, backend: str, device: torch.device,
             timeout_s: float = 1800.0) -> "ShardGroup":
        """Join the group of ``size`` processes meeting at ``address`` as ``rank`` (the default group of
        this process: a process hosts one sharded client). DeepSpeed reads the rank from the environment."""
        import torch.distributed as dist

        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank if device.type == "cpu" else 0),
                          MASTER_ADDR=host, MASTER_PORT=port)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s), **extra)
        return cls(rank, size)

    def rows(self, n: int) -> tuple[list[int], float]:
        """The rows of an ``n``-row batch this process computes, and the weight of its loss: rows
        ``rank, rank + G, …``. A process left without a row runs the first one with weight 0, so that
        every process enters each forward's and backward's collectives."""
        mine = list(range(self.rank, n, self.size))
        return (mine, 1.0) if mine else ([0], 0.0)

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the group in place, in one collective (flattened together)."""
        import torch.distributed as dist

        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat)
        flat.div_(self.size)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Sum numbers over the group."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
