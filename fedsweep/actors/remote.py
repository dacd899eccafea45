"""The one place where the plain actor classes become Ray actors inside a placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsweep.actors.client import ClientActor
from fedsweep.actors.probe import NO_PROBE, Probe, probe_from_env
from fedsweep.actors.server import ServerActor
from fedsweep.env import actor_runtime_env


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


class _Starter:
    """An actor class with its options, whose ``remote(*args)`` hands it ``probe`` (``actors.probe``: the
    recovery tests' where they armed one)."""

    def __init__(self, actor_class, probe: Probe):
        self.actor_class, self.probe = actor_class, probe

    def remote(self, *args, **kwargs):
        return self.actor_class.remote(*args, probe=self.probe, **kwargs)


def client_actor(cfg, pg: PlacementGroup, index: int, cls=ClientActor, restarts: int = 1, probed: bool = True):
    """A client actor in bundle ``index`` of ``pg``, handed the probe (``probed``; a sharded client's
    follower is not). ``cls``: ClientActor, or one process of a sharded client, which is not restarted
    alone (a new process cannot rejoin its group's collectives)."""
    res = cfg.clients.resources
    probe = probe_from_env() if probed else NO_PROBE
    # ClientActor.saved waits for a deferred checkpoint's files beside training, in its own thread
    actor_class = ray.remote(concurrency_groups={"checkpoint": 1})(cls).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_restarts=restarts, max_task_retries=0,
        runtime_env=actor_runtime_env(**probe.environment()))
    return _Starter(actor_class, probe) if probed else actor_class


def sharded_client(cfg, slots: list[tuple[PlacementGroup, int]], *args):
    """A sharded client (``clients.shard``): its followers, then its leader (the handle returned), which
    joins them into one process group as it is constructed with ``args`` (ClientActor's)."""
    from fedsweep.actors.sharded import ShardedClientActor, ShardFollower

    followers = [client_actor(cfg, pg, i, ShardFollower, restarts=0, probed=False).remote() for pg, i in slots[1:]]
    pg, i = slots[0]
    return client_actor(cfg, pg, i, ShardedClientActor, restarts=0).remote(*args, followers=followers)


def server_actor(cfg, pg: PlacementGroup, index: int = 0):
    res = cfg.server.resources
    probe = probe_from_env()
    return _Starter(ray.remote(ServerActor).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_concurrency=2, runtime_env=actor_runtime_env(**probe.environment()),
    ), probe)
