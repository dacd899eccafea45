"""A client actor's partial sum of its clients' uploads (``server.partial_sums``): what it sends instead of
each upload, so that the traffic between it and the server does not grow with its clients."""

from __future__ import annotations

from fedsweep.federation.chain import partial_sum
from fedsweep.federation.screening import UpdateNorms, nonfinite


def summed_uploads(items, payloads, done: dict) -> tuple[dict | None, dict]:
    """(the weighted partial sum of the trained clients' uploads, ``federation.chain.partial_sum``; the
    uploads by client, which the actor keeps for the server's :meth:`ClientActor.uploads`). Each trained
    result keeps its update's norms, measured as the server's screening measures them
    (``UpdateNorms.measure``), and no upload. ``items``: ``(client, payload index)`` of the call; ``done``:
    each client's result, or its error's line."""
    trained = [(cid, done[cid]) for cid, _ in items if not isinstance(done[cid], str)]
    if not trained:
        return None, {}
    norms = UpdateNorms({cid: payloads[i].params for cid, i in items})
    kept = {cid: r.upload.params for cid, r in trained}
    summed = partial_sum([(cid, r.num_examples, r.upload.params) for cid, r in trained])
    for cid, r in trained:
        norm, size = norms.measure(cid, r.upload.params)
        r.screen = {"norm": norm, "start_norm": size, "nonfinite": nonfinite(r.upload.params)}
        r.upload.params = None
    return summed, kept


def round_uploads(before: tuple[int, dict] | None, rnd: int, kept: dict) -> tuple[int, dict]:
    """An actor's kept uploads (``(round, uploads by client)``) after one more call of round ``rnd``
    kept ``kept``: added to the round's earlier calls' (an actor's clients come in several calls when
    they train one at a time, and in more for a retry alone or a replay), or, in a new round, in place
    of the round before's. Until 2026-11-30 each call replaced them, and a client screening rejected
    in a round of several calls per actor made the server's fetch fail (``LookupError``)."""
    if before is not None and before[0] == rnd:
        return rnd, {**before[1], **kept}
    return rnd, dict(kept)
