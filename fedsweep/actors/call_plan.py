"""How a round's work is cut into calls to the client actors: training in a few calls per actor
(:func:`training_calls`), evaluation in one, its clients grouped by the payload they share
(:func:`evaluation_groups`)."""

from __future__ import annotations

from fedsweep.algorithms.types import Payload

TRAIN_CALLS_PER_ACTOR = 4
"""A round trains an actor's clients in at most this many calls (``ClientActor.train_many``) where they
train one at a time: a call per client costs a Ray round trip and a payload fetch each (at K=50 most
of a round's overhead), one call per actor would leave the progress line still until the actor is
done. Where its clients train in groups, an actor gets one call."""


def training_calls(cids: list[int], assignment: dict[int, int], per_actor: int = TRAIN_CALLS_PER_ACTOR) -> list[tuple[int, list[int]]]:
    """``cids`` (in training order) as ``[(actor index, clients)]``: each actor's clients cut, in order,
    into at most ``per_actor`` consecutive runs whose sizes differ by at most one."""
    mine: dict[int, list[int]] = {}
    for cid in cids:
        mine.setdefault(assignment[cid], []).append(cid)
    calls = []
    for index, own in mine.items():
        n = min(per_actor, len(own))
        bounds = [len(own) * i // n for i in range(n + 1)]
        calls += [(index, own[a:b]) for a, b in zip(bounds, bounds[1:])]
    return calls


def evaluation_groups(payloads: dict[int, Payload], assignment: dict[int, int]) -> dict[int, list[tuple[list[int], Payload]]]:
    """Per client actor, its clients' evaluation payloads as ``[(clients, payload)]``: clients whose
    payloads carry the same parameter object and nothing else (a global model) form one group, so it
    is sent once and may be evaluated in shared batches; every other client is a group of its own."""
    out: dict[int, list[tuple[list[int], Payload]]] = {}
    shared: dict[tuple[int, int], list[int]] = {}
    for cid in sorted(payloads):
        p, index = payloads[cid], assignment[cid]
        if p.params is not None and p == Payload(params=p.params):  # only params set (compared by identity below)
            key = (index, id(p.params))
            if key not in shared:
                shared[key] = []
                out.setdefault(index, []).append((shared[key], p))
            shared[key].append(cid)
        else:
            out.setdefault(index, []).append(([cid], p))
    return out
