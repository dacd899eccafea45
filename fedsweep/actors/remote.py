"""The one place where the plain actor classes become Ray actors inside a placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsweep.actors.client import ClientActor
from fedsweep.actors.server import ServerActor
from fedsweep.env import actor_runtime_env


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def client_actor(cfg, pg: PlacementGroup, index: int):
    import os

    from fedsweep.actors.client import FAULT_ENV

    res = cfg.clients.resources
    # quiet, offline workers; fault injection for the recovery tests (actors/client.py) travels too
    fault = {FAULT_ENV: os.environ[FAULT_ENV]} if os.environ.get(FAULT_ENV) else {}
    return ray.remote(ClientActor).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_restarts=1, max_task_retries=0,
        runtime_env=actor_runtime_env(**fault),
    )


def server_actor(cfg, pg: PlacementGroup, index: int = 0):
    res = cfg.server.resources
    return ray.remote(ServerActor).options(
        num_cpus=max(res.num_cpus, 0.01), num_gpus=res.num_gpus, resources=dict(res.custom),
        scheduling_strategy=_in(pg, index), max_concurrency=2,
    )
