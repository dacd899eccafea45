"""What a run's rounds would cost at the speed of their work alone (``fedsweep bench run``'s ``ideal_s``).

Measured in the bench's own process, on its device, after the run, from the run's own data: the best
bare loop's training rate (``bench.actor.BareLoop`` careful: packed rows, logits only at scored
positions, fused AdamW and TF32 where they apply) over one client's training rows, a bare forward's
rate over test rows (no gradient, scored logits only) and a bare ``generate``'s rate over test
prompts. A round's ideal is its training tokens at the training rate, plus, where it evaluated, every
client's test tokens at the forward rate and its prompts' new tokens at the generation rate:

    ideal_s = train_tokens / r_train + [test_tokens / r_forward + prompts · max_new_tokens / r_generate]

``run_over_ideal`` is the rounds' measured seconds over the sum of their ideals (set-up aside: it has
its own figures); per round the same ratio.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def _rows(tokenizer, records: list[dict], cfg) -> list:
    from fedsweep.engine.text import encode_sft

    return [encode_sft(tokenizer, r["prompt"], r["response"], cfg.train.max_length, system=cfg.data.system_prompt)
            for r in records]


def _timed(work, repeats: int = 3) -> float:
    work()  # warm-up (kernels, allocator)
    return statistics.median(work() for _ in range(repeats))


def rates(cfg, sample: int = 64) -> dict[str, float]:
    """Tokens per second of the bare training loop, a bare scoring forward and ``generate``, here, on a
    sample of the run's first client's rows."""
    from fedsweep.bench.actor import BareLoop, _device, _sync
    from fedsweep.bench.padding_free import pack_batch
    from fedsweep.engine.text import IGNORE, collate
    from fedsweep.models import loading
    from fedsweep.orchestrator.experiment_data import prepare_clients

    device = _device(cfg)
    data, _ = prepare_clients(cfg)
    tokenizer = loading.load_tokenizer(cfg.model)
    train = _rows(tokenizer, data[0].train[:sample], cfg)
    test = _rows(tokenizer, data[0].test[:sample], cfg)
    bs = cfg.train.batch_size
    batches = [{k: v.to(device) for k, v in collate(train[i:i + bs], tokenizer.pad_token_id).items()}
               for i in range(0, len(train), bs)]
    packed = [pack_batch(b, tokenizer.pad_token_id) for b in batches]
    loop = BareLoop(cfg, device, careful=True)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    out = {"train_tokens_per_s": real / _timed(lambda: loop.run(packed))}
    model = loop.model
    model.eval()
    eval_batch = {k: v.to(device) for k, v in collate(test, tokenizer.pad_token_id).items()}
    tokens = int(eval_batch["attention_mask"].sum())
    amp = loop.amp

    def forward() -> float:
        where = (eval_batch["labels"][:, 1:] != IGNORE).nonzero(as_tuple=True)
        handle = model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: (args[0][where[0], where[1]], *args[1:]))
        _sync(device)
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                model(input_ids=eval_batch["input_ids"], attention_mask=eval_batch["attention_mask"], use_cache=False)
        finally:
            handle.remove()
        _sync(device)
        return time.perf_counter() - t0

    out["forward_tokens_per_s"] = tokens / _timed(forward)
    if cfg.eval.max_new_tokens > 0:
        from fedsweep.engine.text import encode_prompts_left

        prompts = [r["prompt"] for r in data[0].test[:cfg.eval.batch_size]]
        enc = {k: v.to(device) for k, v in encode_prompts_left(tokenizer, prompts, cfg.train.max_length,
                                                                  cfg.data.system_prompt).items()}

        def generate() -> float:
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                model.generate(**enc, max_new_tokens=cfg.eval.max_new_tokens, min_new_tokens=cfg.eval.max_new_tokens,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id)
            _sync(device)
            return time.perf_counter() - t0

        out["generate_tokens_per_s"] = len(prompts) * cfg.eval.max_new_tokens / _timed(generate, 2)
    loop.close()
    return out


def evaluation_work(cfg) -> dict[str, float]:
    """A round's evaluation: every client's test tokens and the prompts it generates answers to."""
    from fedsweep.models import loading
    from fedsweep.orchestrator.experiment_data import prepare_clients

    data, _ = prepare_clients(cfg)
    tokenizer = loading.load_tokenizer(cfg.model)
    tokens = sum(len(e.input_ids) for c in data for e in _rows(tokenizer, c.test, cfg))
    limit = cfg.eval.max_examples
    prompts = sum(min(len(c.test), limit) if limit else len(c.test) for c in data) if cfg.eval.max_new_tokens else 0
    return {"test_tokens": float(tokens), "prompts": float(prompts)}


def ideal_rounds(cfg, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's ``ideal_s`` and ``over_ideal`` (its seconds over it), added to the round's dict, and the
    run's totals (module docstring)."""
    t0 = time.perf_counter()
    r = rates(cfg)
    work = evaluation_work(cfg)
    total_ideal = total = 0.0
    for rnd in rounds:
        ideal = rnd["train_tokens"] / r["train_tokens_per_s"]
        if rnd["evaluated"]:
            ideal += work["test_tokens"] / r["forward_tokens_per_s"]
            if work["prompts"]:
                ideal += work["prompts"] * cfg.eval.max_new_tokens / r["generate_tokens_per_s"]
        rnd["ideal_s"] = ideal
        rnd["over_ideal"] = rnd["round"] / ideal if ideal > 0 else None
        total_ideal += ideal
        total += rnd["round"]
    return {"rates": r, "evaluation": work, "rounds_s": total, "ideal_s": total_ideal,
            "measured_in_s": time.perf_counter() - t0,
            "run_over_ideal": total / total_ideal if total_ideal > 0 else None,
            "note": "the rounds' seconds over their work at the bare loop's, a bare forward's and generate's "
                    "rates measured here after the run (set-up aside: see phases_s)"}
