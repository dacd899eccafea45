"""The one place where the plain actor classes become Ray actors inside a placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsweep.actors.client import ClientActor
from fedsweep.actors.faults import FAULT_ENV, FaultPoints
from fedsweep.actors.server import ServerActor
from fedsweep.env import actor_runtime_env


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


class _Starter:
    """An actor class with its options, whose ``remote(*args)`` adds the armed fault points as the
    ``faults`` constructor argument (``actors.faults``) where the recovery tests set them."""

    def __init__(self, actor_class, faults: FaultPoints | None):
        self.actor_class, self.faults = actor_class, faults

    def remote(self, *args, **kwargs):
        if self.faults is not None:
            kwargs["faults"] = self.faults
        return self.actor_class.remote(*args, **kwargs)


def client_actor(cfg, pg: PlacementGroup, index: int, cls=ClientActor, restarts: int = 1, fault: bool = True):
    """A client actor in bundle ``index`` of ``pg``. ``cls``: ClientActor, or one process of a sharded
    client, which is not restarted alone (a new process cannot rejoin its group's collectives)."""
    res = cfg.clients.resources
    faults = FaultPoints.from_env() if fault else None
    # ClientActor.saved waits for a deferred checkpoint's files beside training, in its own thread
    return _Starter(ray.remote(concurrency_groups={"checkpoint": 1})(cls).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_restarts=restarts, max_task_retries=0,
        runtime_env=actor_runtime_env(**_env(faults)),
    ), faults)


def sharded_client(cfg, slots: list[tuple[PlacementGroup, int]], *args):
    """A sharded client (``clients.shard``): its followers, then its leader (the handle returned), which
    joins them into one process group as it is constructed with ``args`` (ClientActor's)."""
    from fedsweep.actors.sharded import ShardedClientActor, ShardFollower

    followers = [client_actor(cfg, pg, i, ShardFollower, restarts=0, fault=False).remote() for pg, i in slots[1:]]
    pg, i = slots[0]
    return client_actor(cfg, pg, i, ShardedClientActor, restarts=0).remote(*args, followers=followers)


def server_actor(cfg, pg: PlacementGroup, index: int = 0):
    res = cfg.server.resources
    faults = FaultPoints.from_env()
    return _Starter(ray.remote(ServerActor).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_concurrency=2, runtime_env=actor_runtime_env(**_env(faults)),
    ), faults)


def _env(faults: FaultPoints | None) -> dict[str, str]:
    """The fault variable passed on to an actor's process where faults are armed (its restarted life
    reads the markers of the faults that fired)."""
    return {FAULT_ENV: faults.spec} if faults is not None else {}
