"""A round's seconds by phase, under one naming: ``phase/<name>_s`` (what MLflow and ``fedsweep compare``
show beside each other for every method).

The server's calls give the round's wall-clock parts (training, aggregation, evaluation, checkpoint,
the final update); the client actors' answers split training into its parts for each actor (its
clients' ``prepare_seconds``: the method's preparation, FedReFT+'s α grid and pFedGPT's HBO;
``upload_seconds``: the method's upload work, FedCoFiT's generation; the rest local training; of the
preparation, ``prepare_host_seconds`` outside the model, pFedGPT's Ax fits: ``phase/prepare_host_s``). The
training call waits for its busiest actor, whose parts are the round's::

    phase/train_s + phase/prepare_s + phase/upload_s = the busiest actor's seconds
    phase/traffic_s = the training call's wall time − the busiest actor's seconds

``phase/own_work_s`` is the method's own work: preparation, upload work, aggregation and (the last round)
the final update; ``phase/rest_s`` what no part names (sampling, dispatch, screening, the record).
Work counters of the method's tools (``method_*`` per client: tokens scored, prompts completed) are
summed into ``work/<name>`` for the run's ideal (``bench.ideal``).
"""

from __future__ import annotations

PHASES = ("train", "prepare", "upload", "aggregate", "eval", "final_update", "checkpoint", "traffic", "rest")
"""A round's phases (``phase/<name>_s``) in the order the round runs them; with ``final_update``, they sum to
the round's seconds and its final update's."""


WORK = {"train_tokens": "train_tokens", "final_train_tokens": "final_update_tokens", "test_tokens": "test_tokens",
        "eval_new_tokens": "eval_new_tokens"}
"""Client metrics summed into a round's ``work/<name>`` (client metric -> name): the work its ideal prices."""


def work(client_metrics: dict[int, dict[str, float]]) -> dict[str, float]:
    """The round's work from every client's metrics (:data:`WORK`): tokens trained (the final update's
    apart), test tokens scored and answer tokens generated where it evaluated."""
    out = dict.fromkeys((f"work/{name}" for name in WORK.values()), 0.0)
    for m in client_metrics.values():
        for key, name in WORK.items():
            out[f"work/{name}"] += float(m.get(key, 0.0))
    return out


def phases(seconds: dict[str, float], results: dict, assignment: dict[int, int], round_s: float) -> dict[str, float]:
    """``phase/<name>_s`` of a round: ``seconds`` the server's parts (``train_seconds``, ``aggregation_seconds``,
    ``eval_seconds``, ``checkpoint_seconds``, ``final_update_seconds``), ``results`` the training results by
    client (their metrics' seconds), ``assignment`` each client's actor, ``round_s`` the round's wall time
    (the final update left out)."""
    per_actor: dict[int, dict[str, float]] = {}
    work: dict[str, float] = {}
    for cid, res in results.items():
        m = res.metrics
        mine = per_actor.setdefault(assignment[cid], {"total": 0.0, "prepare": 0.0, "upload": 0.0, "host": 0.0})
        mine["total"] += m.get("train_seconds", 0.0)
        mine["prepare"] += m.get("prepare_seconds", 0.0)
        mine["upload"] += m.get("upload_seconds", 0.0)
        mine["host"] += m.get("prepare_host_seconds", 0.0)
        for key, value in m.items():
            if key.startswith("method_"):
                work[f"work/{key.removeprefix('method_')}"] = work.get(f"work/{key.removeprefix('method_')}", 0.0) + value
    busiest = max(per_actor.values(), key=lambda a: a["total"],
                  default={"total": 0.0, "prepare": 0.0, "upload": 0.0, "host": 0.0})
    out = {"phase/train_s": busiest["total"] - busiest["prepare"] - busiest["upload"],
           "phase/prepare_s": busiest["prepare"], "phase/upload_s": busiest["upload"],
           "phase/prepare_host_s": busiest["host"],
           "phase/traffic_s": max(0.0, seconds.get("train_seconds", 0.0) - busiest["total"]),
           "phase/aggregate_s": seconds.get("aggregation_seconds", 0.0), "phase/eval_s": seconds.get("eval_seconds", 0.0),
           "phase/checkpoint_s": seconds.get("checkpoint_seconds", 0.0)}
    if "final_update_seconds" in seconds:
        out["phase/final_update_s"] = seconds["final_update_seconds"]
    out["phase/own_work_s"] = out["phase/prepare_s"] + out["phase/upload_s"] + out["phase/aggregate_s"] + \
        out.get("phase/final_update_s", 0.0)
    named = seconds.get("train_seconds", 0.0) + out["phase/aggregate_s"] + out["phase/eval_s"] + out["phase/checkpoint_s"]
    out["phase/rest_s"] = max(0.0, round_s - named)
    return {**out, **work}
