"""What a run's rounds would cost at the speed of their work alone: an ideal no run can beat
(``fedsweep bench run``'s ``ideal_s``, per round and per phase).

The rates are measured in the bench's own process, on its device, after the run, from the run's own
data, at the batch the rounds use — all of the round's clients' rows, as the engine lays them out at
its best (:func:`rates`):

- training: the careful bare loop (``bench.actor.BareLoop``: one LoRA adapter, logits only at scored
  positions, fused AdamW and TF32 where they apply) over every client's batch of a step packed into
  rows without padding (``bench.padding_free``);
- forwards (evaluation's test loss, and the method's own scoring: FedReFT+'s α grid, pFedGPT's HBO):
  a bare scoring forward over every client's test rows, in one forward and in ``eval.batch_size``
  chunks, the faster;
- generation (evaluation's answers, FedCoFiT's public responses): a bare ``generate`` over every client's
  prompts, in one call and in ``eval.batch_size`` chunks, the faster;

and each of them also through fedsweep's own engine in this process (:func:`engine_rates`: no Ray, no
calls, no method hooks), the better of the two kept (on a small model the engine's stacked adapters
cost less Python than peft's layers, and beat the bare loop).

Where the round's batch has more tokens than a device measures in reasonable time (:data:`TOKEN_CAP`),
the rate is measured on as many of its clients' rows as fit the cap (the rate per token does not grow
past it). Each phase's ideal is its work (the round's ``work/*`` metrics, ``actors.round_phases``: the
tokens every client trained, the method's tools' tokens scored and generated, every client's test tokens
and answer tokens where it evaluated, the final update's tokens) at its rate::

    ideal(train) = train_tokens / r_train
    ideal(prepare) = scored_tokens / r_forward + the method's own host seconds (pFedGPT's Ax fits: as measured)
    ideal(upload) = generated_new_tokens / r_generate
    ideal(eval) = test_tokens / r_forward + answer tokens / r_generate
    ideal(aggregate) = as measured (the server's arithmetic has no bare model to run faster)
    ideal(final update) = its tokens / r_train;   checkpoint, traffic, the rest: 0

``run_over_ideal`` is the rounds' measured seconds over the sum of their ideals (set-up aside: it has its
own figures); per round and per phase the same ratio. Every rate is a bare loop's best over the layouts
the engine could choose, so a run can match its ideal but not beat it (``run_over_ideal`` ≥ 1 up to the
timers' noise).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from fedsweep.actors.round_phases import PHASES

TOKEN_CAP = {"cpu": 2048, "cuda": 262_144}
"""Tokens of a round's batch a rate is measured on at most, by device type."""



def _rows(tokenizer, records: list[dict], cfg) -> list:
    from fedsweep.engine.text import encode_sft

    return [encode_sft(tokenizer, r["prompt"], r["response"], cfg.train.max_length, system=cfg.data.system_prompt)
            for r in records]


def _timed(work, repeats: int = 2) -> float:
    work()  # warm-up (kernels, allocator)
    return statistics.median(work() for _ in range(repeats))


def _capped(per_client: list[list], cap: int) -> list:
    """Every client's items in turn (the first of each, then the second …) up to ``cap`` tokens."""
    out, total = [], 0
    for i in range(max((len(c) for c in per_client), default=0)):
        for items in per_client:
            if i < len(items):
                n = len(items[i].input_ids)
                if out and total + n > cap:
                    return out
                out.append(items[i])
                total += n
    return out


def threads_of(cfg) -> int:
    """The CPU threads the run's client actors compute with, all together (each actor's
    ``clients.resources`` threads, times the actors, at most this machine's cores): what the rates are
    measured with, so that the ideal has the machine the run had."""
    import os

    res = cfg.clients.resources
    per = res.torch_threads or max(1, int(res.num_cpus))
    actors = cfg.num_actors if cfg.layout_chosen else 1
    return max(1, min(os.cpu_count() or 1, per * actors))


def rates(cfg, generating: bool = False) -> dict[str, float]:
    """Tokens per second of the bare training loop, a bare scoring forward and ``generate`` here, at the
    round's batch, with the run's threads (:func:`threads_of`; module docstring); ``generating``: measure
    ``generate`` too."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads_of(cfg))
        return _rates(cfg, generating)
    finally:
        torch.set_num_threads(before)


def _rates(cfg, generating: bool) -> dict[str, float]:
    from fedsweep.bench.actor import BareLoop, _device, _sync
    from fedsweep.bench.padding_free import pack_batch
    from fedsweep.engine.text import IGNORE, collate
    from fedsweep.models import loading
    from fedsweep.orchestrator.experiment_data import prepare_clients

    device = _device(cfg)
    cap = TOKEN_CAP.get(device.type, TOKEN_CAP["cpu"])
    data, _ = prepare_clients(cfg)
    tokenizer = loading.load_tokenizer(cfg.model)
    bs = cfg.train.batch_size
    step = _capped([_rows(tokenizer, c.train[:bs], cfg) for c in data], cap)  # every client's batch of a step
    batch = {k: v.to(device) for k, v in collate(step, tokenizer.pad_token_id).items()}
    loop = BareLoop(cfg, device, careful=True)
    real = int(batch["attention_mask"].sum())
    out = {"train_tokens_per_s": real / _timed(lambda: loop.run([pack_batch(batch, tokenizer.pad_token_id)])),
           "train_rows": float(len(step)), "token_cap": float(cap)}
    model, amp = loop.model, loop.amp
    model.eval()
    tests = _capped([_rows(tokenizer, c.test, cfg) for c in data], cap)

    def forward(rows) -> float:
        b = {k: v.to(device) for k, v in collate(rows, tokenizer.pad_token_id).items()}
        where = (b["labels"][:, 1:] != IGNORE).nonzero(as_tuple=True)
        handle = model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: (args[0][where[0], where[1]], *args[1:]))
        _sync(device)
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
        finally:
            handle.remove()
        _sync(device)
        return time.perf_counter() - t0

    size = max(1, cfg.eval.batch_size)
    tokens = sum(len(e.input_ids) for e in tests)
    chunks = [tests[i:i + size] for i in range(0, len(tests), size)]
    out["forward_tokens_per_s"] = tokens / min(_timed(lambda: forward(tests)),
                                               _timed(lambda: sum(forward(c) for c in chunks)))
    if generating:
        out["generate_tokens_per_s"] = _generate_rate(cfg, data, tokenizer, model, amp, device, cap)
    loop.close()
    bare = dict(out)
    engine = engine_rates(cfg, data, cap, generating)
    for key, value in engine.items():  # the best of the two on the same rows
        out[key] = max(out.get(key, 0.0), value)
    return {**out, "bare": bare, "engine": engine, "threads": float(torch.get_num_threads())}


def engine_rates(cfg, data, cap: int, generating: bool) -> dict[str, float]:
    """The same rates of fedsweep's own engine in this process (no Ray, no actor calls, no method hooks):
    a round's local training of the clients whose first batch fits ``cap``, one group of them
    (``engine.training.train_group``, their steps as the run's),
    their test rows through the one evaluation path (``engine.evaluation.evaluate_group``) and their
    prompts through its generation, each client with its own adapter. Where the engine computes faster
    than the bare loop (its stacked adapters cost less Python than peft's layers on a small model), this
    is the better rate: the ideal takes the best of both."""
    from fedsweep.actors.client import ClientActor
    from fedsweep.bench.actor import _device, _hosted, _sync
    from fedsweep.bench.one_actor import packed_config
    from fedsweep.engine.evaluation import EvalClient, evaluate_group
    from fedsweep.engine.training import Job, train_group
    from fedsweep.plan.resolve import for_actor

    device = _device(cfg)
    bs = cfg.train.batch_size
    tokens, n = 0, 0
    for c in data:  # as many whole clients as the cap takes (one client at least)
        rough = sum(len(r["prompt"]) + len(r["response"]) for r in c.train[:bs]) // 3
        if n and tokens + rough > cap:
            break
        tokens, n = tokens + rough, n + 1
    kcfg = for_actor(packed_config(cfg, n), n, device.type)
    threads = torch.get_num_threads()
    actor = ClientActor(kcfg, _hosted(kcfg, data[:n]))
    torch.set_num_threads(threads)  # (an actor sets its own: the measurement keeps the run's)
    slots = [actor.slots[cid] for cid in sorted(actor.slots)]
    base = actor.base
    seen: list[int] = []

    def step() -> float:  # a round's local training of these clients, as their actor runs it, without the actor
        jobs = [Job(cid=s.cid, rnd=1, rank=s.rank, steps=actor.local_steps(s.cid), start=s.params, opt_state=None,
                    examples=s.train_enc) for s in slots]
        _sync(device)
        t0 = time.perf_counter()
        trained = train_group(base, jobs, actor.algo.frozen)
        _sync(device)
        seen[:] = [sum(t.tokens for t in trained)]
        return time.perf_counter() - t0

    out = {"train_tokens_per_s": 0.0}
    seconds = _timed(step)
    out["train_tokens_per_s"] = seen[0] / seconds
    clients = [EvalClient(k, examples=s.test_enc) for k, s in enumerate(slots)]
    scored = sum(len(e.input_ids) for c in clients for e in c.examples)

    def evaluate() -> float:
        _sync(device)
        t0 = time.perf_counter()
        evaluate_group(base, [s.rank for s in slots], [s.params for s in slots], clients)
        _sync(device)
        return time.perf_counter() - t0

    out["forward_tokens_per_s"] = scored / _timed(evaluate)
    if generating:
        new = max(cfg.eval.max_new_tokens, 8)
        prompts = [r["prompt"] for s in slots for r in s.test]
        owners = [k for k, s in enumerate(slots) for _ in s.test]

        def generate() -> float:
            with base.bind([s.rank for s in slots], [s.params for s in slots]) as binding:
                _sync(device)
                t0 = time.perf_counter()
                base.generate(prompts, new, rows=lambda a, b: binding.rows(owners[a:b]), batch_size=len(prompts))
                _sync(device)
                return time.perf_counter() - t0

        out["generate_tokens_per_s"] = len(prompts) * new / _timed(generate, 1)
    out["clients"] = float(n)
    return out


def _generate_rate(cfg, data, tokenizer, model, amp, device, cap: int) -> float:
    """New tokens per second of a bare greedy ``generate`` over every client's prompts (as many as fit
    ``cap`` prompt tokens), in one call and in ``eval.batch_size`` chunks, the faster."""
    from fedsweep.bench.actor import _sync
    from fedsweep.engine.text import encode_prompts_left

    new = max(cfg.eval.max_new_tokens, 8)
    per_client = [[r["prompt"] for r in c.test] for c in data]
    prompts, total = [], 0
    for i in range(max((len(p) for p in per_client), default=0)):
        for mine in per_client:
            if i < len(mine) and (not prompts or total + len(mine[i]) // 3 <= cap):
                prompts.append(mine[i])
                total += len(mine[i]) // 3
    size = max(1, cfg.eval.batch_size)

    def generate(batch: list[str]) -> float:
        enc = {k: v.to(device) for k, v in encode_prompts_left(tokenizer, batch, cfg.train.max_length,
                                                                  cfg.data.system_prompt).items()}
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
        _sync(device)
        return time.perf_counter() - t0

    one = _timed(lambda: generate(prompts), 1)
    chunked = _timed(lambda: sum(generate(prompts[i:i + size]) for i in range(0, len(prompts), size)), 1)
    return len(prompts) * new / min(one, chunked)


def round_ideal(rnd: dict[str, Any], r: dict[str, float]) -> dict[str, float]:
    """Each phase's ideal seconds of one round (``rnd``: ``bench.run.round_breakdown``'s, its ``work`` the
    round's ``work/*`` metrics: ``actors.round_phases``), its work at the rates ``r`` (module docstring)."""
    w = rnd["work"]
    gen = r.get("generate_tokens_per_s")

    def generating(tokens: float) -> float:
        return tokens / gen if tokens and gen else 0.0

    return {"train": w.get("train_tokens", 0.0) / r["train_tokens_per_s"],
            "prepare": w.get("scored_tokens", 0.0) / r["forward_tokens_per_s"] + rnd["prepare_host"],
            "upload": generating(w.get("generated_new_tokens", 0.0)),
            "aggregate": rnd["aggregation"],
            "eval": w.get("test_tokens", 0.0) / r["forward_tokens_per_s"] + generating(w.get("eval_new_tokens", 0.0)),
            "final_update": w.get("final_update_tokens", 0.0) / r["train_tokens_per_s"],
            "checkpoint": 0.0, "traffic": 0.0, "rest": 0.0}


def ideal_rounds(cfg, rounds: list[dict[str, Any]], measured: dict[str, float] | None = None) -> dict[str, Any]:
    """Each round's ``ideal_s``, ``over_ideal`` and per-phase ideals (``ideal_phases``), added to the round's
    dict, and the run's totals and phase table (module docstring); ``measured``: rates already measured."""
    t0 = time.perf_counter()
    generating = any(rnd["work"].get("generated_new_tokens") or rnd["work"].get("eval_new_tokens") for rnd in rounds)
    r = measured or rates(cfg, generating)
    actual = dict.fromkeys(PHASES, 0.0)
    ideal = dict.fromkeys(PHASES, 0.0)
    for rnd in rounds:
        rnd["ideal_phases"] = round_ideal(rnd, r)
        rnd["ideal_s"] = sum(rnd["ideal_phases"].values())
        whole = rnd["round"] + rnd["final_update"]
        rnd["over_ideal"] = whole / rnd["ideal_s"] if rnd["ideal_s"] > 0 else None
        for phase in PHASES:
            actual[phase] += rnd["phases"][phase]
            ideal[phase] += rnd["ideal_phases"][phase]
    total, total_ideal = sum(actual.values()), sum(ideal.values())
    table = {p: {"actual_s": actual[p], "ideal_s": ideal[p],
                 "ratio": actual[p] / ideal[p] if ideal[p] > 0 else None} for p in PHASES}
    return {"rates": r, "rounds_s": total, "ideal_s": total_ideal, "phases": table,
            "measured_in_s": time.perf_counter() - t0,
            "run_over_ideal": total / total_ideal if total_ideal > 0 else None,
            "note": "the rounds' seconds (the final update included) over their work at the bare loop's, a bare "
                    "forward's and generate's best rates at the rounds' batch, measured here after the run "
                    "(set-up aside: see phases_s)"}
