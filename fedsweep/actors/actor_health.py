"""Whether a client actor is gone, coming back, or cannot be placed again: what the fleet
(``actors.fleet``) asks before it retries a call."""

from __future__ import annotations

import time

import ray

UNPLACEABLE_AFTER_S = 15.0
"""How long an actor that does not answer gets to be placed again before the cluster is asked whether it
can be at all (Ray reschedules a lost node's bundles as soon as it has room)."""


class UnplaceableError(RuntimeError):
    """A client actor lost its node and the cluster left cannot place it again."""


def died(exc: BaseException) -> bool:
    """Whether a failed call means its actor's process is gone (or answers as a new incarnation)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, LookupError)


def await_actor(actor, hosted: list[int], index: int, patience_s: float = 300.0) -> bool:
    """Wait until a (restarting) client actor (``index``, hosting clients ``hosted``) answers again; False
    if it is gone for good. Raises :class:`UnplaceableError` when it lost its node and the cluster left
    has no room to place it again."""
    start = time.monotonic()
    deadline = start + patience_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=min(60.0, patience_s))
            return True
        except ray.exceptions.ActorDiedError:
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() - start > UNPLACEABLE_AFTER_S:
                why = unplaceable()
                if why:
                    raise UnplaceableError(f"client actor {index} (clients {', '.join(map(str, hosted))}) lost its "
                                           f"node and cannot be placed again: {why}; the run keeps its last "
                                           f"committed round: --resume once the cluster has room") from None
            time.sleep(0.5)
    return False


def unplaceable() -> str | None:
    """What the run's placement group lacks where a node it had bundles on was lost and the nodes left
    cannot take them (its state ``RESCHEDULING`` and the lost bundles' resources more than the cluster has
    free); None where nothing is lost or it fits (Ray places it again)."""
    from ray.util.placement_group import get_current_placement_group, placement_group_table

    pg = get_current_placement_group()
    if pg is None:
        return None
    table = placement_group_table(pg)
    if table.get("state") != "RESCHEDULING":
        return None
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    lost = [b for b, node in table["bundles_to_node_id"].items() if node not in alive]
    need: dict[str, float] = {}
    for b in lost:
        for key, value in table["bundles"][b].items():
            if "_group_" not in key:  # (a bundle's own resource names are internal)
                need[key] = need.get(key, 0.0) + float(value)
    free = ray.available_resources()
    short = {k: round(v - free.get(k, 0.0), 3) for k, v in need.items() if v > free.get(k, 0.0) + 1e-9}
    if not short:
        return None
    return f"its bundles need {need}, the nodes left lack {short}"
