"""Precision and memory options on CPU, and the memory planner against measured memory.

The planner simulates a training step on the meta device; here the same step runs for real on
the CPU inside a ClientActor and :class:`LiveBytes` records the tensor storage it allocates.
The GPU counterpart (tests/test_gpu.py) checks against torch.cuda.max_memory_allocated."""

from __future__ import annotations

import pytest
import torch

from fedsweep.algorithms.types import Payload
from fedsweep.models.memory import GiB, RESERVE, LiveBytes, MemoryPlan, parse_size
from fedsweep.plan.memory import plan
from fedsweep.config import ConfigError, validate

from in_process import client_actor

LORA = {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("override, named", [
    ({"model": {"quantization": "8bit"}}, "model.quantization=8bit"),
    ({"model": {"quantization": "4bit"}}, "model.quantization=4bit"),
    ({"model": {"attn_implementation": "flash_attention_2"}}, "model.attn_implementation=flash_attention_2"),
    ({"train": {"optimizer": "adamw_8bit"}}, "train.optimizer=adamw_8bit"),
    ({"train": {"autocast": "fp16"}}, "train.autocast=fp16"),
])
def test_cuda_only_options_refused_on_a_cpu_config_in_one_line(override, named):
    with pytest.raises(ConfigError) as info:
        validate({"name": "x", **override})
    message = str(info.value)
    assert named in message and "num_gpus" in message and "\n" not in message
    validate({"name": "x", **override, "clients": {"resources": {"num_gpus": 1}}})  # fine where a GPU is asked for


@pytest.mark.parametrize("bad, field", [({"model": {"dtype": "int8"}}, "model.dtype"),
                                        ({"train": {"autocast": "bf32"}}, "train.autocast"),
                                        ({"clients": {"park": "disk"}}, "clients.park"),
                                        ({"model": {"quantization": "3bit"}}, "model.quantization")])
def test_unknown_precision_values_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate({"name": "x", **bad})


def test_flora_refuses_a_quantised_base():
    with pytest.raises(ConfigError, match="flora.*quantised base"):
        validate({"name": "x", "algorithm": "flora", "model": {"quantization": "8bit"},
                  "clients": {"resources": {"num_gpus": 1}}})


def test_autocast_auto_is_bf16_where_clients_get_gpus_and_is_written_resolved():
    on_gpu = validate({"name": "x", "clients": {"resources": {"num_gpus": 0.5}}})
    on_cpu = validate({"name": "x"})
    assert (on_gpu.train.autocast, on_cpu.train.autocast) == ("bf16", "none")
    assert on_gpu.to_dict()["train"]["autocast"] == "bf16"  # what config.yaml holds
    assert validate(on_gpu.to_dict()).train.autocast == "bf16"
    for said in ("none", "fp16", "bf16"):  # a value the config gives is kept
        assert validate({"name": "x", "train": {"autocast": said},
                         "clients": {"resources": {"num_gpus": 1}}}).train.autocast == said


def test_dtype_aliases():
    assert validate({"name": "x", "model": {"dtype": "bf16"}}).model.dtype == "bfloat16"
    assert validate({"name": "x", "model": {"dtype": "fp32"}}).model.dtype == "float32"


@pytest.fixture(scope="module")
def records():
    from fedsweep.data import bundled

    return bundled.generate(["basic_arithmetic"], 24, 0)


def _actor(records, **over):
    raw = {"name": "p", "seed": 0, "lora": {"r": 4}, "eval": {"max_new_tokens": 0},
           "train": {"steps": 10, "batch_size": 4, "learning_rate": 0.01, "max_length": 64, **over.pop("train", {})},
           **over}
    return client_actor(validate(raw), [{"cid": 0, "train": records[:18], "test": records[18:]}])


def test_bf16_base_autocast_and_checkpointing_train_on_cpu(records):
    actor = _actor(records, model={"dtype": "bf16"}, train={"autocast": "bf16", "gradient_checkpointing": True})
    assert actor.model.base_model.model.is_gradient_checkpointing
    assert next(p for n, p in actor.model.named_parameters() if "embed" in n).dtype == torch.bfloat16
    with actor.base.bind([4], [actor.slots[0].params]) as binding:
        live = binding.tensors()
        assert live and all(p.dtype == torch.float32 for p in live.values())  # adapters stay fp32
    result = actor.train(1, 0, Payload())
    assert result.metrics["train_loss_last"] < result.metrics["train_loss_first"]
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in result.upload.params.values())


def test_gradient_checkpointing_changes_memory_not_the_result(records):
    plain, ckpt = _actor(records), _actor(records, train={"gradient_checkpointing": True})
    weights = lambda a: list(a.model.parameters())  # noqa: E731
    with LiveBytes(exclude=weights(plain)) as m_plain:
        a = plain.train(1, 0, Payload())
    with LiveBytes(exclude=weights(ckpt)) as m_ckpt:
        b = ckpt.train(1, 0, Payload())
    for k, v in a.upload.params.items():
        torch.testing.assert_close(b.upload.params[k], v, rtol=1e-5, atol=1e-6)
    assert m_ckpt.peak < m_plain.peak


def test_park_cpu_resumes_identically(records):
    """Where the parked state lives can only differ on a GPU (tests/test_gpu.py checks it); here: the
    parked copy restores into the next round's optimiser without changing the result."""
    parked, kept = _actor(records, clients={"park": "cpu"}), _actor(records)
    for rnd in (1, 2):
        a, b = parked.train(rnd, 0, Payload()), kept.train(rnd, 0, Payload())
    for k, v in a.upload.params.items():
        torch.testing.assert_close(v, b.upload.params[k])


# ------------------------------------------------------------------------------ the planner

def _measured_step(name: str, extra_model: dict, extra_train: dict, max_length: int = 96):
    """Peak tensor bytes of one real ClientActor round of training on full-length rows (the planner's
    worst case: every position but the first predicts a supervised token)."""
    raw = {"name": "p", "seed": 0, "model": {"name": name, **extra_model}, "lora": LORA,
           "train": {"batch_size": 4, "max_length": max_length, "steps": 2, **extra_train},
           "eval": {"batch_size": 8, "max_new_tokens": 0},
           # the data section the planner reads gives each of 4 clients the 8 test rows handed below
           # (4 tasks x 32 examples x 0.25 / 4 clients): its one-forward evaluation is over those rows
           "data": {"examples_per_task": 32, "test_fraction": 0.25}, "clients": {"num_clients": 4}}
    recs = [{"prompt": f"Q{i}", "response": "yes no " * 400} for i in range(8)]
    from fedsweep.plan.memory import test_rows_per_client

    assert test_rows_per_client(validate(raw)) == len(recs)
    actor = client_actor(validate(raw), [{"cid": 0, "train": recs, "test": recs}])
    assert {len(e.input_ids) for e in actor.slots[0].train_enc} == {max_length}
    weights = list(actor.model.parameters()) + list(actor.model.buffers())
    with LiveBytes(exclude=weights) as train:
        actor.train(1, 0, Payload())
    with LiveBytes(exclude=weights) as evaluation:
        actor.evaluate(1, 0, Payload())
    base = sum(p.numel() * p.element_size() for n, p in actor.model.named_parameters() if "lora_" not in n)
    return validate(raw), train.peak, evaluation.peak, base


def _architecture(cfg):
    from fedsweep.bench.actor import model_config

    return model_config(cfg)


@pytest.mark.parametrize("extra_model, extra_train", [
    ({}, {}),
    ({}, {"gradient_checkpointing": True}),
    ({"dtype": "bf16"}, {"autocast": "bf16"}),
])
def test_planner_within_20_percent_of_a_measured_step_tiny(extra_model, extra_train):
    cfg, train, evaluation, base = _measured_step("tiny@128x3", extra_model, extra_train)
    est = plan(cfg, _architecture(cfg))
    assert est.train_step == pytest.approx(train, rel=0.2)
    # evaluation of a 4 MiB model: ~1 MiB of per-batch tensors the planner leaves out (token ids, the
    # mask) is a quarter of it; at 135M (below) the same tensors are lost in the 20 %
    assert est.evaluation == pytest.approx(evaluation, rel=0.2, abs=2 ** 21)
    assert est.base == base


@pytest.mark.parametrize("extra_model, extra_train", [({}, {}), ({}, {"gradient_checkpointing": True})])
def test_planner_within_20_percent_of_a_measured_step_135m(extra_model, extra_train):
    from fedsweep.models.loading import BUNDLED, _bundled_gguf

    try:
        _bundled_gguf(next(iter(BUNDLED)))
    except Exception:
        pytest.skip("the bundled SmolLM2 is not installed")
    cfg, train, evaluation, base = _measured_step("smollm2-135m-instruct", extra_model, extra_train)
    est = plan(cfg, _architecture(cfg))
    assert est.train_step == pytest.approx(train, rel=0.2)
    assert est.evaluation == pytest.approx(evaluation, rel=0.2)
    assert est.base == base


def test_planner_within_20_percent_of_a_measured_lockstep_step_tiny():
    """Four clients trained in lockstep (train.batch_clients: auto) on full-length rows: the planner's
    step of four (one step's peak, three further batches' slope, four clients' stacked factors,
    gradients and moments) against the measured peak of the real round."""
    raw = {"name": "p", "seed": 0, "model": {"name": "tiny@128x3"}, "lora": LORA,
           "train": {"batch_size": 4, "max_length": 96, "steps": 2, "batch_clients": "auto"},
           "eval": {"batch_size": 8, "max_new_tokens": 0},
           # the data section the planner reads gives each of 4 clients the 8 test rows handed below
           # (4 tasks x 32 examples x 0.25 / 4 clients): its one-forward evaluation is over those rows
           "data": {"examples_per_task": 32, "test_fraction": 0.25}, "clients": {"num_clients": 4}}
    recs = [{"prompt": f"Q{i}", "response": "yes no " * 400} for i in range(8)]
    actor = client_actor(validate(raw), [{"cid": c, "train": recs, "test": recs} for c in range(4)])
    weights = list(actor.model.parameters()) + list(actor.model.buffers())
    with LiveBytes(exclude=weights) as train:
        _, answers = actor.train_many(1, [(c, 0) for c in range(4)], Payload())
    assert {a.metrics["batched_clients"] for _, a in answers} == {4.0}
    est = plan(validate(raw), _architecture(validate(raw)))
    assert est.batch_clients is None and est.batch_slope > 0
    assert est.train_step_of(4) == pytest.approx(train.peak, rel=0.2)
    assert est.train_step_of(4) > 3 * est.train_step  # the lockstep step really is planned bigger


def test_lockstep_plan_by_hand():
    gib = GiB
    p = MemoryPlan(base=10 * gib, live_adapters=gib // 2, optimizer_per_client=gib // 4, train_step=4 * gib,
                   evaluation=2 * gib, park="gpu", batch_slope=3 * gib, stacked_per_client=gib, batch_clients=4)
    # 8 clients, 4 per step: 10 + 0.5 + 8 × 0.25 + (4 + 3 × 3 + 4 × 1) = 29.5 GiB
    assert p.per_actor(8) == int(29.5 * gib)
    assert p.per_actor(2) == int(10 * gib + gib / 2 + 2 * gib / 4 + 4 * gib + 3 * gib + 2 * gib)
    assert p.per_actor(8, together=1) == int(10 * gib + gib / 2 + 2 * gib + 4 * gib)
    # auto on 40 GiB (36 usable) for 8 clients: 12.5 + (4 + 3(m−1) + m) ≤ 36 → 4m ≤ 22.5 → m = 5
    auto = MemoryPlan(**{**p.as_dict(), "batch_clients": None})
    assert auto.batch_limit(40 * gib, 8) == 5 and auto.batch_limit(400 * gib, 8) == 8
    assert auto.batch_limit(10 * gib, 8) == 1  # not even one: the layout's own problem, one at a time
    assert auto.per_actor(8) == p.per_actor(8, together=1)  # a layout is planned one client at a time
    # the most clients a fixed N = 4 fits on 36 GiB usable: 10.5 + 0.25 n + (4 + 3·3 + 4) ≤ 36 → n ≤ 34
    assert p.clients_per_gpu(40 * gib, 1000) == 34


def test_quantised_base_bytes_by_hand():
    """8bit: 1 byte per decoder Linear weight + 4 per output row; embeddings stay in dtype."""
    mc = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": True}
    cfg = validate({"name": "q", "model": {"quantization": "8bit", "dtype": "bf16"}, "lora": LORA,
                    "clients": {"resources": {"num_gpus": 1}}, "train": {"max_length": 16, "batch_size": 1}})
    est = plan(cfg, mc)
    head = 16  # 64 / 4
    per_layer_linear = [(64, 4 * head), (64, 2 * head), (64, 2 * head), (4 * head, 64), (64, 128), (64, 128), (128, 64)]
    linear = sum(i * o + 4 * o for i, o in per_layer_linear) * 2
    norms = (2 * 64 * 2 + 64) * 2  # two RMSNorms per layer + the final one, bf16
    embed = 300 * 64 * 2
    assert est.base == linear + norms + embed


def test_clients_per_gpu_by_hand():
    gib = GiB
    p = MemoryPlan(base=10 * gib, live_adapters=gib // 2, optimizer_per_client=gib // 4, train_step=4 * gib,
                   evaluation=2 * gib, park="gpu")
    assert p.per_actor(1) == int(10 * gib + gib / 2 + gib / 4 + 4 * gib)
    usable = 80 * gib * (1 - RESERVE)  # 72 GiB
    # 72 − 14.75 = 57.25 GiB left after the first client; 0.25 GiB each → 229 more
    assert p.clients_per_gpu(80 * gib, 10_000) == 1 + int((usable - p.per_actor(1)) // (gib / 4)) == 230
    assert p.clients_per_gpu(80 * gib, 50) == 50
    assert p.clients_per_gpu(16 * gib, 50) == 0  # 14.4 GiB usable < 14.75 needed
    parked = MemoryPlan(**{**p.as_dict(), "park": "cpu"})
    assert parked.clients_per_gpu(24 * gib, 50) == 50 and parked.per_actor(50) == parked.per_actor(1)


@pytest.mark.parametrize("text, value", [("80GB", 80 * GiB), ("24GiB", 24 * GiB), ("512MiB", 512 * 2 ** 20),
                                         ("1.5g", 1.5 * GiB)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["eighty", "80XB", "-4GB", "0GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


def test_plan_command(capsys):
    from fedsweep.cli import main

    assert main(["plan", "configs/experiments/smoke.yaml", "--gpu-memory", "24GB", "--set", "train.batch_clients=off"]) == 0
    out = capsys.readouterr().out
    assert "frozen base weights" in out and "clients_per_actor=4" in out and "group step" not in out
    assert main(["plan", "configs/experiments/smoke.yaml", "--gpu-memory", "24GB", "--set", "train.batch_clients=2"]) == 0
    assert "group step of 2 clients" in capsys.readouterr().out
    assert main(["plan", "configs/experiments/smoke.yaml", "--gpu-memory", "lots"]) == 2


def test_gpu_run_on_a_gpu_less_cluster_fails_before_any_actor(ray_session, smoke_raw):
    from fedsweep.config import validate as v
    from fedsweep.errors import RunError
    from fedsweep.orchestrator.runtime.placement import check_gpus

    smoke_raw["clients"]["resources"] = {"num_cpus": 1, "num_gpus": 1}
    smoke_raw["train"]["autocast"] = "fp16"
    with pytest.raises(RunError, match=r"train.autocast=fp16 needs CUDA.*has no GPU"):
        check_gpus(v(smoke_raw))


def test_tf32_is_asked_only_for_float32_without_autocast_and_switched_on_only_on_a_gpu(monkeypatch):
    """``train.tf32``: the engine's settings carry it only where the model computes in float32 without
    autocast; the actor turns torch's TF32 switches on only on a CUDA device (nothing changes on the CPU)."""
    import torch

    from fedsweep.actors.engine_setup import apply_tf32, settings_from
    from fedsweep.config import validate
    from fedsweep.config.schema import BatchPlan

    def settings(**train):
        raw = {"name": "tf32", "train": {"tf32": True, **train}, "tracking": {"enabled": False}}
        return settings_from(validate(raw).with_batch_plan(BatchPlan(2)))

    assert settings().tf32 and not settings(autocast="bf16").tf32 and not settings(tf32=False).tf32
    before = torch.backends.cuda.matmul.allow_tf32
    assert apply_tf32(settings(), torch.device("cpu")) is False and torch.backends.cuda.matmul.allow_tf32 == before
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert apply_tf32(settings(), torch.device("cuda")) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
