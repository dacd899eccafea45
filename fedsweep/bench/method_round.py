"""A method's round on one actor of K clients, in this process, counted: the operator calls of its
client side, the method's own work included (``fedsweep bench throughput --ops``'s ``round_model_*``).

The server's side runs here as plain calls of the plugin (``init``, ``dispatch``, ``aggregate``,
``eval_payload``: no Ray, no chain), the client side is a ClientActor hosting the K clients. Round 1
gives every client a local model and the server its first aggregate; round 2 is counted: the actor's
training call (the method's preparation of the group — FedReFT+'s α grid, pFedGPT's HBO —, the local
training, the uploads — FedCoFiT's generation) and its evaluation call, under torch's profiler
(``bench.ops``). The method's host work that no model computes (pFedGPT's Ax: GP fits and acquisition,
which run torch too) is counted apart: it runs in ``fedsweep.host_work`` blocks.
"""

from __future__ import annotations

from typing import Any


def method_round(cfg, k: int, host: bool = True) -> dict[str, Any]:
    """Round 2 of ``cfg``'s method over ``k`` clients on one actor: its client side's calls (module
    docstring), in the model and apart (``host=False``: the host work unprofiled, its counts 0)."""
    from fedsweep.actors.call_plan import evaluation_groups
    from fedsweep.algorithms import registry
    from fedsweep.algorithms.types import AggregationContext, ClientInfo, ServerContext
    from fedsweep.bench.ops import count_ops
    from fedsweep.orchestrator.experiment_data import prepare_data

    from fedsweep.actors.client import ClientActor
    from fedsweep.bench.actor import _device, _hosted
    from fedsweep.bench.one_actor import packed_config
    from fedsweep.plan.resolve import for_actor

    kcfg = for_actor(packed_config(cfg, k), k, _device(cfg).type)
    algo = registry.create(kcfg.algorithm, kcfg.algo_params)
    clients, holdout, public = prepare_data(kcfg)
    actor = ClientActor(kcfg, _hosted(kcfg, clients), pool=holdout if algo.capabilities.validation_pool else None)
    ranks = kcfg.client_ranks()
    infos = [ClientInfo(cid=c.cid, num_examples=len(c.train), tasks=c.tasks, rank=ranks[c.cid],
                        lora_scale=kcfg.lora.alpha / ranks[c.cid]) for c in clients]
    embed = None
    if algo.server_encoder_name():
        from fedsweep.models.encoder import load_encoder

        embed = load_encoder(algo.server_encoder_name())
    state = algo.init(actor.initial_params(), ServerContext(infos, public if algo.capabilities.public_prompts else None,
                                                            embed, kcfg.seed))
    cids = sorted(actor.slots)
    counted = {}
    for rnd in (1, 2):
        payloads = algo.dispatch(rnd, cids, state)
        distinct = list({id(p): p for p in payloads.values()}.values())
        items = [(cid, next(i for i, p in enumerate(distinct) if p is payloads[cid])) for cid in cids]
        train = count_ops(lambda: actor.train_many(rnd, items, *distinct), host) if rnd == 2 else None
        entries = actor.train_many(rnd, items, *distinct)[1] if rnd == 1 else train.pop("result")[1]
        failed = [(cid, r) for cid, r in entries if isinstance(r, str)]
        if failed:
            raise RuntimeError(f"client {failed[0][0]}'s training failed: {failed[0][1]}")
        state, _ = algo.aggregate(rnd, [r for _, r in entries], state, AggregationContext(embed=embed))
        if rnd == 2:
            groups = evaluation_groups({cid: algo.eval_payload(state, cid) for cid in cids}, dict.fromkeys(cids, 0))[0]
            evaluate = count_ops(lambda: actor.evaluate_many(rnd, groups), host)
            counted = {"train": train, "evaluate": evaluate}
    out = {"clients": k}
    for kind in ("aten_calls", "compute_calls"):
        out[f"round_model_{kind}"] = counted["train"][kind] + counted["evaluate"][kind]
        out[f"round_host_{kind}"] = counted["train"][f"apart_{kind}"] + counted["evaluate"][f"apart_{kind}"]
        out[f"round_host_{kind}_per_client"] = out[f"round_host_{kind}"] / k
    out["train_aten_calls"], out["eval_aten_calls"] = counted["train"]["aten_calls"], counted["evaluate"]["aten_calls"]
    out["top_train_calls"], out["top_eval_calls"] = counted["train"]["top_calls"], counted["evaluate"]["top_calls"]
    return out


def bench_method_ops(cfg, clients: list[int], progress=None) -> list[dict[str, Any]]:
    """:func:`method_round` per K of ``clients`` (and K = 1, the reference), each with its calls over K = 1's."""
    progress = progress or (lambda line: None)
    rows = []
    for k in sorted(set(clients) | {1}):
        rows.append(method_round(cfg, k))
        progress(f"K={k}: the method's round {rows[-1]['round_model_aten_calls']:,} aten calls in the model, "
                 f"{rows[-1]['round_host_aten_calls']:,} on the host")
    one = rows[0]
    for row in rows:
        for kind in ("round_model_aten_calls", "round_model_compute_calls"):
            row[f"{kind}_over_one"] = row[kind] / max(one[kind], 1)
    return rows
