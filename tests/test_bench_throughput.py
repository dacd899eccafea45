"""``fedsweep bench throughput --clients``: its JSON, the FLOP count by hand, the GPU peak table, and
``model.name: random:<architecture>`` (the base the GPU figures are measured on)."""

from __future__ import annotations

import json

import pytest
import torch

from fedsweep.config import validate
from fedsweep.errors import ModelError
from fedsweep.models import loading
from fedsweep.models.shapes import architecture
from fedsweep.orchestrator.bench.actor import lora_flops_per_token, peak_flops


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
    from fedsweep.orchestrator.cli import main

    assert main(["bench", "throughput", "configs/experiments/smoke.yaml", "--set", "train.steps=2",
                 "--clients", "1,3", "--repeats", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "K=3: batched" in printed and "grouped/bare" in printed
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


def test_the_bare_loop_takes_each_step_rows_of_every_client_in_their_order(tmp_path):
    """``group_batches``: step s's batch is every client's batch s (its own batch order), so the bare
    loop's tokens are the grouped round's real tokens."""
    from fedsweep.algorithms.types import Payload
    from fedsweep.config import load_config
    from fedsweep.engine.text import IGNORE
    from fedsweep.orchestrator.bench import grouped

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
