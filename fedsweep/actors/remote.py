"""The one place where the plain actor classes become Ray actors inside a placement group."""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsweep.actors.client import ClientActor
from fedsweep.actors.faults import FAULT_ENV, server_with_faults, with_faults
from fedsweep.actors.server import ServerActor
from fedsweep.env import actor_runtime_env


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def client_actor(cfg, pg: PlacementGroup, index: int, cls=ClientActor, restarts: int = 1, fault: bool = True):
    """A client actor in bundle ``index`` of ``pg``. ``cls``: ClientActor, or one process of a sharded
    client, which is not restarted alone (a new process cannot rejoin its group's collectives)."""
    res = cfg.clients.resources
    env = _faults() if fault else {}
    if env:
        cls = with_faults(cls)
    # ClientActor.saved waits for a deferred checkpoint's files beside training, in its own thread
    return ray.remote(concurrency_groups={"checkpoint": 1})(cls).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_restarts=restarts, max_task_retries=0,
        runtime_env=actor_runtime_env(**env),
    )


def sharded_client(cfg, slots: list[tuple[PlacementGroup, int]], *args):
    """A sharded client (``clients.shard``): its followers, then its leader (the handle returned), which
    joins them into one process group as it is constructed with ``args`` (ClientActor's)."""
    from fedsweep.actors.sharded import ShardedClientActor, ShardFollower

    followers = [client_actor(cfg, pg, i, ShardFollower, restarts=0, fault=False).remote() for pg, i in slots[1:]]
    pg, i = slots[0]
    return client_actor(cfg, pg, i, ShardedClientActor, restarts=0).remote(*args, followers=followers)


def server_actor(cfg, pg: PlacementGroup, index: int = 0):
    res = cfg.server.resources
    cls = server_with_faults(ServerActor) if _faults() else ServerActor
    return ray.remote(cls).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_concurrency=2, runtime_env=actor_runtime_env(**_faults()),
    )


def _faults() -> dict[str, str]:
    """Fault injection for the recovery tests (``actors.faults``), passed on to an actor when set: the
    actor is then made of the class ``with_faults`` gives."""
    return {FAULT_ENV: os.environ[FAULT_ENV]} if os.environ.get(FAULT_ENV) else {}
