"""The actor layout: how many ClientActors, and how many clients each hosts.

``clients.clients_per_actor`` and ``clients.num_actors`` default to ``auto``: the layout is chosen
from what the Ray cluster offers (:class:`Cluster`), before any actor starts. Clients of one base
model are packed ``p`` to an actor, so a layout is one number ``p`` and the actors it makes,
``A(p) = Σ_models ⌈clients of the model / p⌉``. Auto picks the smallest ``p`` (the most actors,
the most parallel training) such that

* ``A(p)`` actors fit the cluster's slots: ``⌊CPUs / clients.resources.num_cpus⌋`` and, when the
  actors ask for GPUs, ``⌊GPUs / clients.resources.num_gpus⌋`` (one actor per GPU, or per share);
* the actors fit host memory (``A(p)`` processes, each a Python runtime with torch, transformers
  and peft, plus its base model, plus every client's adapter and optimiser state);
* one actor's ``p`` clients fit its share of a GPU (the memory planner), when the GPU size is known.

On CPU actors, fewer actors than that can be faster: every actor is a process that imports torch,
transformers and peft and builds its model (``ACTOR_START_CPU_S``), and a short run's training does
not repay that. Given the run's training work ``W`` (single-core seconds, estimated from shapes by
the orchestrator), auto takes, among the layouts that fit, the number of actors ``n`` with the least
estimated wall time on the ``P`` cores the actors may use (:func:`estimated_seconds`)::

    t(n) = max(S, (n·S + D) / P) + W / n

``S``: one actor's start, ``D``: what the driver, the server and Ray's processes spend meanwhile.
On 2 cores this takes 1 actor for the tiny workload at K = 4, 10 and 20 and 2 at K = 50, the fastest
layouts measured (docs/performance.md, 'The design's measurements'). GPU actors keep one actor per GPU (or share).

An explicit number wins, and is checked the same way: a layout that does not fit is refused in
one line that says what fits. This module is pure: the orchestrator measures the cluster and
passes the memory and work estimates in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from fedsweep.errors import ConfigError

GiB = 2 ** 30


@dataclass(frozen=True)
class Cluster:
    """What the experiment's client actors may use (the server's and drivers' shares taken off)."""

    cpus: float
    gpus: float = 0.0
    memory: float | None = None
    """Host bytes for actors (Ray's ``memory`` resource); None: not checked."""
    gpu_memory: float | None = None
    """Bytes of one GPU; None: the GPU-memory check is skipped."""
    source: str = "the Ray cluster"
    cores: float | None = None
    """Physical cores the actors share (a local runtime has one logical CPU more than it has cores);
    None: ``cpus``."""


ACTOR_START_CPU_S = 5.5
"""S: CPU-seconds a ClientActor takes to start (imports, model, tokenizer; docs/performance.md, 'The design's measurements')."""
OTHERS_START_CPU_S = 8.0
"""D: CPU-seconds the driver, the server actor and Ray's processes spend while the actors start."""


def estimated_seconds(n: int, work_s: float, cores: float) -> float:
    """t(n): wall seconds of starting ``n`` CPU actors on ``cores`` cores and training ``work_s``
    single-core seconds split over them (each actor trains its clients one after another)."""
    start = max(ACTOR_START_CPU_S, (n * ACTOR_START_CPU_S + OTHERS_START_CPU_S) / max(cores, 1.0))
    return start + work_s / n


@dataclass(frozen=True)
class Layout:
    num_actors: int
    clients_per_actor: int
    reason: str

    def describe(self) -> str:
        return f"{self.num_actors} actor(s) × ≤{self.clients_per_actor} client(s) ({self.reason})"


def model_counts(client_models: list[str]) -> list[int]:
    """Clients per distinct base model, in first-seen order (each model needs actors of its own)."""
    counts: dict[str, int] = {}
    for name in client_models:
        counts[name] = counts.get(name, 0) + 1
    return list(counts.values())


def actors_for(counts: list[int], per: int) -> int:
    """A(p): actors needed to host every model's clients ``per`` to an actor."""
    return sum(math.ceil(c / per) for c in counts)


def _slots(cluster: Cluster, num_cpus: float, num_gpus: float) -> tuple[int, str]:
    cpu = math.floor(cluster.cpus / max(num_cpus, 0.01) + 1e-9)
    if num_gpus > 0:
        gpu = math.floor(cluster.gpus / num_gpus + 1e-9)
        if gpu < cpu:
            return gpu, f"{cluster.gpus:g} GPU(s) at {num_gpus:g} per actor"
    return cpu, f"{cluster.cpus:g} CPU(s) at {num_cpus:g} per actor"


def choose(num_clients: int, client_models: list[str], clients_per_actor: int | str, num_actors: int | str,
           num_cpus: float, num_gpus: float, cluster: Cluster,
           host_bytes: Callable[[int], float] | None = None,
           gpu_bytes: Callable[[int], float] | None = None, work_s: float | None = None) -> Layout:
    """The layout for these clients on ``cluster``; ConfigError (one line) if the asked one cannot fit.

    ``host_bytes(p)`` / ``gpu_bytes(p)``: memory one actor hosting ``p`` clients needs on the host /
    on its GPU (None: not checked); ``work_s``: the run's training in single-core seconds (None: the
    most actors that fit)."""
    counts = model_counts(client_models) or [num_clients]
    slots, slot_why = _slots(cluster, num_cpus, num_gpus)
    gpu_room = cluster.gpu_memory * num_gpus if (cluster.gpu_memory and num_gpus > 0) else None

    def problem(per: int) -> str | None:
        actors = actors_for(counts, per)
        if actors > slots:
            return f"{actors} actor(s) need {actors} slot(s), the cluster has {slots} ({slot_why})"
        if gpu_room is not None and gpu_bytes is not None and gpu_bytes(per) > gpu_room:
            return (f"{per} client(s) on one actor need {gpu_bytes(per) / GiB:.1f} GiB of GPU memory, "
                    f"its {num_gpus:g} GPU share has {gpu_room / GiB:.1f} GiB")
        if cluster.memory is not None and host_bytes is not None and actors * host_bytes(per) > cluster.memory:
            return (f"{actors} actor(s) need {actors * host_bytes(per) / GiB:.1f} GiB of host memory, "
                    f"the cluster offers {cluster.memory / GiB:.1f} GiB")
        return None

    def fitting(candidates) -> int | None:
        return next((p for p in candidates if problem(p) is None), None)

    largest = max(counts)
    if clients_per_actor != "auto" and num_actors != "auto":
        made = actors_for(counts, int(clients_per_actor))
        if made != num_actors:
            raise ConfigError(f"clients.num_actors={num_actors} and clients.clients_per_actor={clients_per_actor} "
                              f"disagree: {num_clients} clients at {clients_per_actor} per actor make {made} "
                              f"actor(s); set one of them to auto")
    if clients_per_actor != "auto":
        per, reason = int(clients_per_actor), "clients.clients_per_actor as set"
    elif num_actors != "auto":
        if int(num_actors) < len(counts):
            raise ConfigError(f"clients.num_actors={num_actors}: the clients use {len(counts)} base models and an "
                              f"actor hosts one, so at least {len(counts)} actors are needed")
        per = next(p for p in range(1, largest + 1) if actors_for(counts, p) <= int(num_actors))
        reason = "clients.num_actors as set"
    else:
        per = fitting(range(1, largest + 1))
        if per is None:
            raise ConfigError(f"no layout of {num_clients} clients fits {cluster.source}: even one actor per base "
                              f"model does not ({problem(largest)}); lower the per-actor resources or use a "
                              f"larger cluster")
        reason = f"auto: {slot_why}"
        if gpu_room is not None and gpu_bytes is not None:
            reason += f", ≤{per} client(s) per {num_gpus:g} GPU by the memory planner"
        if work_s is not None and num_gpus == 0:
            per, reason = _fewer_actors(counts, per, largest, problem, work_s, cluster.cores or cluster.cpus, reason)
        return Layout(actors_for(counts, per), per, reason)
    why = problem(per)
    if why is not None:
        fits = fitting(range(per, largest + 1))
        hint = (f"clients.clients_per_actor={fits} ({actors_for(counts, fits)} actor(s)) fits, or leave it auto"
                if fits is not None else "no packing of these clients fits it")
        raise ConfigError(f"the layout of {actors_for(counts, per)} actor(s) × ≤{per} client(s) does not fit "
                          f"{cluster.source}: {why}; {hint}")
    return Layout(actors_for(counts, per), per, reason)


def _fewer_actors(counts: list[int], per: int, largest: int, problem, work_s: float, cores: float,
                  reason: str) -> tuple[int, str]:
    """The packing (from ``per``, the most actors that fit, up) whose actor count has the least t(n)."""
    best = per
    for p in range(per, largest + 1):
        if problem(p) is None and estimated_seconds(actors_for(counts, p), work_s, cores) < \
                estimated_seconds(actors_for(counts, best), work_s, cores) - 1e-9:
            best = p
    if best == per:
        return per, reason
    n, most = actors_for(counts, best), actors_for(counts, per)
    return best, (f"{reason}; {n} rather than {most}: ~{work_s:.0f} s of training does not repay "
                  f"starting {most - n} more actor(s) at ~{ACTOR_START_CPU_S:g} CPU-s each on {cores:g} core(s)")
