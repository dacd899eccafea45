"""Compiled decoder layers (``train.compile``, ``models.compiled``) against the uncompiled ones.

The independent computation is the eager path the engine always takes: two rounds of a method through
the real server, once eager and once with every decoder layer compiled by ``aot_eager`` (the traced
forward and backward, run on torch's own operators: what runs on a CPU in seconds; ``inductor``'s
generated kernels are a GPU's and are measured by ``make gpu-check``), every client's adapter and AdamW
moments compared. That the layers really ran compiled, one graph for every layer, is read from torch's
own counters: the graphs traced do not grow with the model's layers (a hook specialised per module
made one a layer), and nothing broke a graph or fell back to eager.
"""

from __future__ import annotations

import pytest
import torch

from fedsweep.config import validate

from test_lockstep import BASE, GPUS, METHODS, _merge, two_rounds, worst_slot_difference

BACKEND, BOUND = ("inductor", 1e-4) if GPUS else ("aot_eager", 1e-6)
"""On the CPU ``aot_eager`` (torch's own operators, bitwise-close: 1e-6); with ``FEDSWEEP_TEST_DEVICE=cuda``
(``make gpu-check``'s equality step) ``inductor``'s generated kernels, float32 within 1e-4 (fused
reductions reorder sums)."""

SIX_LAYERS = {"model": {"name": "tiny@64x6", "dtype": "float32"}}
LAYER_BOUND = 3 * 6
"""Fewer graphs than three a layer: one per variant serves all 6 layers (with or without gradients, the
first layer's input without one, the owners' layout, the reference forward, a width's first
specialisation; 9 to 13 measured). A hook specialised per module traced a graph a layer and variant
(30 for FedAvg's two rounds, measured before the hook read its factors from the module)."""


def _compiled_against_eager(tmp_path, method: str, extra: dict) -> tuple[float, int]:
    """The largest relative difference of any client's adapter or AdamW moment after two rounds compiled
    and eager, and the graphs torch traced for the compiled run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    raw = _merge(_merge(_merge(BASE, SIX_LAYERS), extra), {"algorithm": method, **METHODS[method]})
    eager, eager_rounds = two_rounds(raw, tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_rounds = two_rounds(_merge(raw, {"train": {"compile": BACKEND}}), tmp_path / "compiled")
    layers = [m for m in compiled.base.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 6 and all(hasattr(layer.forward, "compiled") for layer in layers)
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    worst = worst_slot_difference(eager, compiled)
    for a, b in zip(eager_rounds, compiled_rounds):
        assert a["metrics"]["train_loss"] == pytest.approx(b["metrics"]["train_loss"], rel=BOUND)
        assert a["metrics"]["test_loss"] == pytest.approx(b["metrics"]["test_loss"], rel=BOUND)
    return worst, graphs


def test_compiled_layers_train_what_eager_layers_train_in_float32(ray_session, tmp_path):
    """FedAvg on 4 clients in one group, every row of a step in one forward (a GPU's layout), 6 layers."""
    worst, graphs = _compiled_against_eager(tmp_path, "fedavg", {"train": {"forwards": "one"}})
    assert worst <= BOUND, f"compiled layers differ by {worst:.2e}"
    assert 1 <= graphs < LAYER_BOUND, graphs


@pytest.mark.long  # 74-93 s alone: make test-system
def test_compiled_layers_train_dpo_pairs_in_packed_rows(ray_session, tmp_path):
    """DRIFT: DPO pairs, the frozen base's reference forward (the stacks switched off), in packed rows
    (position ids, no attention mask)."""
    worst, graphs = _compiled_against_eager(tmp_path, "drift", {"train": {"pack_tokens": 256}})
    assert worst <= BOUND, f"compiled layers differ by {worst:.2e}"
    assert 1 <= graphs < LAYER_BOUND, graphs


@pytest.mark.parametrize("change, refusal", [
    ({"adapter": "reft"}, "compiles LoRA layers"),
    ({"lora": {"dropout": 0.1}}, "lora.dropout 0"),
    ({"train": {"gradient_checkpointing": True}}, "gradient_checkpointing"),
])
def test_what_cannot_be_compiled_is_refused_with_the_reason(change, refusal):
    raw = _merge(_merge(BASE, change), {"train": {"compile": "inductor"}})
    with pytest.raises(Exception, match=refusal):
        validate(raw)
    validate(_merge(BASE, change))  # (the same config uncompiled is valid)


def test_a_decoding_forward_runs_the_layer_uncompiled():
    """Generation hands each layer a KV cache that grows a position a step: the uncompiled forward takes
    it, and the compiled one every forward without a cache."""
    from fedsweep.models.compiled import _uncached_compiled

    calls = []
    forward = _uncached_compiled(lambda *a, **k: calls.append("eager"), lambda *a, **k: calls.append("compiled"))
    forward(torch.zeros(1), past_key_values=None, use_cache=False)
    forward(torch.zeros(1), past_key_values=object(), use_cache=True)
    forward(torch.zeros(1))
    assert calls == ["compiled", "eager", "compiled"]
