"""``fedsweep bench throughput --clients``: its JSON, the FLOP count by hand, the GPU peak table, and
``model.name: random:<architecture>`` (the base the GPU figures are measured on)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedsweep.config import validate
from fedsweep.errors import ModelError
from fedsweep.models import loading
from fedsweep.models.shapes import architecture
from fedsweep.bench.actor import lora_flops_per_token, peak_flops


def test_lora_flops_per_token_of_smollm2_by_hand():
    # per layer: q 576×576, k and v 576×192 (3 KV heads × 64), o 576×576, gate and up 576×1536, down 1536×576
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert per_layer == 3_538_944
    arch = architecture(validate({"name": "x", "model": {"name": "smollm2-135m-instruct"}}).model)
    assert lora_flops_per_token(arch) == 4 * 30 * per_layer == 424_673_280


@pytest.mark.parametrize("name, dtype, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", False, 989), ("NVIDIA H100 80GB HBM3", "float32", False, 67),
    ("NVIDIA H100 80GB HBM3", "float32", True, 494), ("NVIDIA H100 PCIe", "float16", False, 756),
    ("NVIDIA H200", "bfloat16", False, 989), ("NVIDIA A100-SXM4-80GB", "bfloat16", False, 312),
])
def test_peak_flops_from_the_data_sheets(name, dtype, tf32, tflops):
    assert peak_flops(name, dtype, tf32) == tflops * 1e12


def test_an_unknown_gpu_has_no_mfu():
    assert peak_flops("Some Future GPU", "bfloat16", False) is None


def test_random_weights_of_a_named_architecture():
    cfg = validate({"name": "r", "model": {"name": "random:smollm2-135m-instruct"}})
    a, b = loading.load_base_model(cfg.model, 0), loading.load_base_model(cfg.model, 0)
    other = loading.load_base_model(cfg.model, 1)
    shape = architecture(cfg.model)
    assert shape["hidden_size"] == 576 and a.config.num_hidden_layers == 30 and a.config.vocab_size == 49152
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # seeded
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, other.model.layers[0].self_attn.q_proj.weight)
    assert not any(p.requires_grad for p in a.parameters()) and not a.training
    tok = loading.load_tokenizer(cfg.model)  # the byte-level tokenizer: its ids are inside the vocabulary
    assert len(tok) <= a.config.vocab_size and max(tok("any text at all")["input_ids"]) < a.config.vocab_size
    with pytest.raises(ModelError, match="not found"):
        loading.load_base_model(validate({"name": "r", "model": {"name": "random:no-such-model"}}).model, 0)


def test_bench_throughput_clients_writes_both_paths_with_flops(tmp_path, capsys):
    from fedsweep.cli import main

    assert main(["bench", "throughput", "configs/experiments/smoke.yaml", "--set", "train.steps=2",
                 "--set", "train.max_length=256",  # lengths 45-256: padding to pack away
                 "--clients", "1,3", "--repeats", "1", "--padding-free", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "K=3: batched" in printed and "grouped/bare" in printed and "bare padding-free" in printed
    (path,) = tmp_path.glob("throughput_batched_*_cpu.json")
    result = json.loads(path.read_text())
    assert [r["clients"] for r in result["rows"]] == [1, 3]
    one, three = result["rows"]
    assert one["batched_clients"] == 1 and three["batched_clients"] == 3  # K = 1 has nothing to batch
    assert result["peak_flops_per_s"] is None and three["batched_mfu"] is None  # no GPU here
    for mode in ("batched", "sequential", "bare"):
        assert three[f"{mode}_flops_per_s"] == pytest.approx(three[f"{mode}_tokens_per_s"] * result["model_flops_per_token"])
        assert len(three[f"{mode}_seconds"]) == 1
    assert three["batched_peak_bytes_per_client"] == three["batched_peak_bytes"] / 3
    # the ceiling: the same real tokens in the bare loop, its ratio from the medians of the seconds
    assert three["grouped_over_bare"] == pytest.approx(three["bare_seconds"][0] / three["batched_seconds"][0])
    assert three["grouped_over_bare"] == pytest.approx(three["batched_tokens_per_s"] / three["bare_tokens_per_s"])
    # --padding-free: the same tokens in fewer cells, its ratio to the padded bare loop from the same medians
    assert three["bare_padding_free_padded_tokens"] < three["bare_padded_tokens"]
    assert sum(three["bare_padding_free_rows"]) < 2 * 3 * result["batch_size"]
    assert three["bare_padding_free_over_bare"] == pytest.approx(
        three["bare_padding_free_tokens_per_s"] / three["bare_tokens_per_s"])
    assert three["bare_padding_free_flops_per_s"] == pytest.approx(
        three["bare_padding_free_tokens_per_s"] * result["model_flops_per_token"])
    # the careful user's loop (packed rows, scored logits only, fused AdamW, TF32 where fp32 on a GPU)
    assert three["grouped_over_careful"] == pytest.approx(three["bare_careful_seconds"][0] / three["batched_seconds"][0])
    assert "grouped/careful" in printed
    # the engine's own packed rows (train.pack_tokens: one forward a step) on the same actor: less padding
    # than the bare loop's one padded forward a step over the same rows, its ratios from the same medians
    assert three["pack_tokens"] is None and three["pack_tokens_measured"] == 512
    assert three["batched_packed_padded_tokens"] < three["bare_padded_tokens"]
    assert three["grouped_packed_over_careful"] == pytest.approx(
        three["bare_careful_seconds"][0] / three["batched_packed_seconds"][0])
    assert three["grouped_packed_over_grouped"] == pytest.approx(
        three["batched_seconds"][0] / three["batched_packed_seconds"][0])
    assert "grouped packed (train.pack_tokens=512)" in printed


def test_the_bare_loop_takes_each_step_rows_of_every_client_in_their_order(tmp_path):
    """``group_batches``: step s's batch is every client's batch s (its own batch order), so the bare
    loop's tokens are the grouped round's real tokens."""
    from fedsweep.algorithms.types import Payload
    from fedsweep.config import load_config
    from fedsweep.engine.text import IGNORE
    from fedsweep.bench import grouped

    cfg = load_config("configs/experiments/smoke.yaml", ["train.steps=2"])
    actor = grouped.packed_actor(cfg, 3)
    batches = grouped.group_batches(actor, 1)
    bs = cfg.train.batch_size
    assert [b["input_ids"].shape[0] for b in batches] == [3 * bs, 3 * bs]
    for step, batch in enumerate(batches):
        for j, cid in enumerate(sorted(actor.slots)):
            order = actor.batch_order(1, cid, 2).tolist()
            for r, i in enumerate(order[step * bs:(step + 1) * bs]):
                ids = actor.slots[cid].train_enc[i].input_ids
                assert batch["input_ids"][j * bs + r, :len(ids)].tolist() == ids
                assert int(batch["attention_mask"][j * bs + r].sum()) == len(ids)
    _, answers = actor.train_many(1, [(cid, 0) for cid in sorted(actor.slots)], Payload())
    real = sum(a.metrics["train_tokens"] for _, a in answers)
    assert real == sum(int(b["attention_mask"].sum()) for b in batches)
    assert all(int((b["labels"] != IGNORE).sum()) > 0 for b in batches)


def _optimal_rows(lengths, width):
    """The fewest rows of ``width`` that hold ``lengths`` (brute force over assignments: small inputs)."""
    import itertools

    for rows in range(1, len(lengths) + 1):
        for assign in itertools.product(range(rows), repeat=len(lengths)):
            if all(sum(n for n, r in zip(lengths, assign) if r == k) <= width for k in range(rows)):
                return rows
    return len(lengths)


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_decreasing_lays_every_sequence_once_within_the_width(seed):
    from fedsweep.bench.padding_free import first_fit_decreasing

    rng = np.random.default_rng(seed)
    width = 20
    lengths = [int(n) for n in rng.integers(1, width + 1, size=7)]
    if seed == 0:
        lengths = [10, 10, 10, 10, 20, 1, 19]  # ties and exact fits
    rows = first_fit_decreasing(lengths, width)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= width for r in rows)
    # first fit decreasing uses at most 11/9 OPT + 6/9 rows (Dósa 2007)
    assert len(rows) <= 11 / 9 * _optimal_rows(lengths, width) + 6 / 9
    if seed == 0:  # 20 | 19 + 1 | 10 + 10 | 10 + 10: longest first, ties in the order given
        assert rows == [[4], [6, 5], [0, 1], [2, 3]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([21], width)


def test_padding_free_rows_score_each_sequence_as_it_would_score_alone():
    """``bench.padding_free``: the packed rows' loss is the padded batch's (same supervised tokens), and
    every sequence's logits in a packed row are its logits alone (no attention across sequences, its
    positions from 0), in float32 at the demo's batch of three clients' rows."""
    from fedsweep.config import load_config
    from fedsweep.engine.text import IGNORE, token_loss_sum
    from fedsweep.bench import grouped
    from fedsweep.bench.padding_free import ROW_TOKENS, cells, first_fit_decreasing, pack_batch

    cfg = load_config("configs/experiments/smoke.yaml", ["train.steps=2"])
    actor = grouped.packed_actor(cfg, 3)
    model = loading.load_base_model(cfg.model, 0, len(actor.tokenizer))
    shared = 0
    for batch in grouped.group_batches(actor, 1):
        rows = pack_batch(batch, actor.tokenizer.pad_token_id)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        layout = first_fit_decreasing(lengths, max(batch["input_ids"].shape[1], ROW_TOKENS))
        assert rows["input_ids"].shape == (len(layout), max(batch["input_ids"].shape[1], ROW_TOKENS))
        assert int((rows["labels"] != IGNORE).sum()) == int((batch["labels"] != IGNORE).sum())
        with torch.no_grad():
            padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            packed = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
            assert float(token_loss_sum(packed, rows["labels"])[0]) == pytest.approx(
                float(token_loss_sum(padded, batch["labels"])[0]), rel=1e-5)
            for r, members in enumerate(layout):
                at = 0
                for i in members:
                    n = lengths[i]
                    alone = model(input_ids=batch["input_ids"][i:i + 1, :n], use_cache=False).logits[0]
                    torch.testing.assert_close(packed[r, at:at + n], alone, atol=1e-4, rtol=1e-4)
                    shared += at > 0
                    at += n
    assert shared > 0  # some row held more than one sequence


def test_the_careful_bare_loop_scores_the_same_loss_as_the_plain_one():
    """The careful loop's logits only at scored positions give the plain loop's token-mean loss on the
    same rows (padded and packed), so its speed is measured on the same computation."""
    from fedsweep.config import load_config
    from fedsweep.bench import grouped
    from fedsweep.bench.actor import BareLoop
    from fedsweep.bench.padding_free import pack_batch
    from fedsweep.engine.text import token_loss_sum

    cfg = load_config("configs/experiments/smoke.yaml", ["train.steps=2", "train.max_length=256"])
    actor = grouped.packed_actor(cfg, 3)
    careful = BareLoop(actor.cfg, actor.device, careful=True)
    for batch in grouped.group_batches(actor, 1):
        for rows in (batch, pack_batch(batch, actor.tokenizer.pad_token_id)):
            kw = ({"position_ids": rows["position_ids"], "use_cache": False} if "position_ids" in rows
                  else {"attention_mask": rows["attention_mask"], "use_cache": False})
            with torch.no_grad():
                full = careful.model(input_ids=rows["input_ids"], **kw).logits
                total, count = token_loss_sum(full, rows["labels"])
                scored = careful._scored_loss(rows, kw)
            assert float(scored) == pytest.approx(float(total / count), rel=1e-5)
