"""Placement groups: the bundles an experiment needs, and a refusal in one line when the cluster lacks them."""

from __future__ import annotations

from fedsweep.config import ExperimentConfig
from fedsweep.errors import RunError


def bundle(resources) -> dict[str, float]:
    """A placement-group bundle for one actor (Ray refuses empty bundles: keep a sliver of CPU)."""
    out = {"CPU": max(resources.num_cpus, 0.01)}
    if resources.num_gpus:
        out["GPU"] = resources.num_gpus
    out.update(resources.custom)
    return out


def experiment_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """The server's bundle, then one per client actor."""
    return [bundle(cfg.server.resources)] + [bundle(cfg.clients.resources)] * cfg.num_actors


def check_gpus(cfg: ExperimentConfig) -> None:
    """Refuse, before any actor starts, a run that asks for GPUs on a Ray cluster that has none
    (Ray would wait for them for ever)."""
    import ray

    wanted = cfg.clients.resources.num_gpus * cfg.num_actors + cfg.server.resources.num_gpus
    have = ray.cluster_resources().get("GPU", 0)
    if wanted and not have:
        needs = cfg.cuda_requirements()
        why = f" ({', '.join(needs)} need{'s' if len(needs) == 1 else ''} CUDA)" if needs else ""
        raise RunError(f"clients.resources.num_gpus={cfg.clients.resources.num_gpus:g}{why}, but the Ray cluster "
                       f"has no GPU: run on a GPU node or set clients.resources.num_gpus=0")


def placement(cfg: ExperimentConfig, timeout: float = 120.0):
    """A ready placement group for the experiment's actors (RunError if not schedulable in ``timeout``)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = experiment_bundles(cfg)
    pg = placement_group(bundles, strategy=cfg.clients.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0) + v
        raise RunError(f"placement group of {len(bundles)} bundles ({total}) not schedulable within {timeout:g}s; "
                       f"cluster has {ray.cluster_resources()}") from None
    return pg
