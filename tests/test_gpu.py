"""The GPU path (marked ``gpu``: skipped without CUDA). Each test checks a CUDA result against an
independent computation: the same training on the CPU, the planner against
``torch.cuda.max_memory_allocated``, the loss falling under mixed precision."""

from __future__ import annotations

import pytest
import torch

from fedsweep.config import validate
from fedsweep.algorithms.types import Payload
from fedsweep.data import bundled
from fedsweep.data.partition import make_clients

from in_process import client_actor

pytestmark = pytest.mark.gpu

BASE = {"name": "g", "seed": 0, "lora": {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "model": {"tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                           "intermediate_size": 256}},
        "train": {"steps": 12, "batch_size": 4, "learning_rate": 0.01, "max_length": 96, "autocast": "none"},
        "eval": {"max_new_tokens": 4, "batch_size": 8}, "clients": {"resources": {"num_gpus": 1}}}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def clients():
    recs = bundled.generate(["basic_arithmetic", "gcd"], 24, 0)
    return [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(recs, "task", 2, seed=0, test_fraction=0.25)]


def test_cuda_training_matches_cpu_and_uploads_cpu_fp32(clients):
    gpu = client_actor(validate(BASE), clients)
    cpu = client_actor(validate(_merge(BASE, {"clients": {"resources": {"num_gpus": 0}}})), clients)
    assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    g = gpu.train(1, 0, Payload())
    c = cpu.train(1, 0, Payload())
    for k, v in g.upload.params.items():
        assert v.device.type == "cpu" and v.dtype == torch.float32, k
        torch.testing.assert_close(v, c.upload.params[k], rtol=2e-3, atol=2e-4)
    assert g.metrics["train_loss_last"] < g.metrics["train_loss_first"]
    state = gpu.slots[0].opt_state["state"]
    assert all(t.device.type == "cuda" for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim())


def test_park_cpu_moves_idle_optimizer_state_off_the_gpu_and_changes_nothing(clients):
    parked = client_actor(validate(_merge(BASE, {"clients": {"park": "cpu"}})), clients)
    kept = client_actor(validate(BASE), clients)
    for rnd in (1, 2):
        a, b = parked.train(rnd, 0, Payload()), kept.train(rnd, 0, Payload())
    state = parked.slots[0].opt_state["state"]
    assert all(t.device.type == "cpu" for s in state.values() for t in s.values() if torch.is_tensor(t))
    for k, v in a.upload.params.items():
        torch.testing.assert_close(v, b.upload.params[k])


@pytest.mark.parametrize("precision", [
    {"model": {"dtype": "bf16"}, "train": {"autocast": "bf16", "gradient_checkpointing": True}},
    {"train": {"autocast": "fp16"}},
    {"model": {"dtype": "fp16"}, "train": {"autocast": "fp16"}},
])
def test_mixed_precision_trains_on_cuda(clients, precision):
    actor = client_actor(validate(_merge(BASE, precision)), clients)
    with actor.base.bind([actor.slots[0].rank], [actor.slots[0].params]) as binding:
        assert all(p.dtype == torch.float32 for p in binding.tensors().values())  # adapters stay fp32
    result = actor.train(1, 0, Payload())
    assert result.metrics["train_loss_last"] < result.metrics["train_loss_first"]
    assert all(torch.isfinite(v).all() for v in result.upload.params.values())
    ev = actor.evaluate(1, 0, Payload())
    assert ev["test_loss"] == pytest.approx(ev["test_loss"]) and ev["test_loss"] < 100


@pytest.mark.parametrize("extra", [{}, {"train": {"gradient_checkpointing": True}},
                                   {"model": {"dtype": "bf16"}, "train": {"autocast": "bf16"}}])
def test_planner_within_20_percent_of_cuda_peak(extra):
    """A training step of the 135M architecture (random weights: memory does not depend on them)
    measured by the CUDA allocator against the planner's estimate from the config alone."""
    from transformers import AutoModelForCausalLM

    from fedsweep.models.memory import hf_config
    from fedsweep.plan.memory import plan
    from fedsweep.models.shapes import load_model_config
    from fedsweep.models.lora import attach_lora
    from fedsweep.config import validate
    from fedsweep.actors.engine_setup import prepare_base

    mc = load_model_config("smollm2-135m-instruct")
    cfg = validate(_merge({"name": "p", "model": {"name": "smollm2-135m-instruct"},
                           "lora": {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                           "train": {"batch_size": 8, "max_length": 256}, "eval": {"max_new_tokens": 0}}, extra))
    est = plan(cfg, mc)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_config(hf_config(mc), dtype=dtype).cuda()
    model.requires_grad_(False)
    model = prepare_base(model, cfg)
    model = attach_lora(model, cfg.lora, 0, [8]).cuda()
    model.train()
    ids = torch.randint(0, mc["vocab_size"], (8, 256), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    amp = torch.bfloat16 if cfg.train.autocast == "bf16" else None
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    del logits
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - resident
    assert est.train_step == pytest.approx(measured, rel=0.2), (est.train_step / 2 ** 20, measured / 2 ** 20)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    assert est.base == pytest.approx(weights, rel=0.02)


@pytest.mark.parametrize("variant", ["sp", "mst"])
def test_drift_on_cuda_matches_the_cpu_path(variant):
    """DRIFT's dense accelerator path against the blocked CPU path on the same close uploads:
    divergences within 1e-5 relative, the same graph selections, the same personalised sets."""
    from fedsweep.algorithms import create
    from fedsweep.algorithms.drift import divergence as dv
    from fedsweep.algorithms.drift import graph as dg

    g = torch.Generator().manual_seed(0)
    base = {"l.lora_A.weight": torch.randn(16, 512, generator=g) * 0.05, "l.lora_B.weight": torch.randn(512, 16, generator=g) * 1e-3}
    ups = [{k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(8)]
    cuda_ups = [{k: v.cuda() for k, v in u.items()} for u in ups]
    d_cpu = dv.divergence_matrix(ups, 1e-20, dense=False)
    d_gpu = dv.divergence_matrix(cuda_ups, 1e-20)  # auto: dense on CUDA
    torch.testing.assert_close(d_gpu, d_cpu, rtol=1e-5, atol=0)
    algo = create("drift", {"variant": variant, "delta": 0.5})
    sels = algo.select(d_cpu)
    assert [s.neighbours for s in algo.select(d_gpu)] == [s.neighbours for s in sels]
    mixed_cpu, mixed_gpu = dg.mix(ups, sels), dg.mix(cuda_ups, sels)
    for a, b in zip(mixed_cpu, mixed_gpu):
        for k in a:
            assert b[k].device.type == "cuda"
            torch.testing.assert_close(b[k].cpu(), a[k], rtol=1e-6, atol=1e-7)


def test_a_group_read_to_the_host_is_pinned_rows_and_writes_back_exactly():
    """``FlatStack.read_rows`` from the GPU: one pinned host row per client (its own storage), equal to
    the buffer's row; written back (asynchronously from the pinned rows) into another buffer: equal."""
    from fedsweep.models.flat import FlatStack

    flat = FlatStack({"a": (8, 576), "b": (192, 8)}, 5, "cuda", torch.float32)
    flat.values.copy_(torch.randn(flat.values.shape, device="cuda"))
    sets = flat.read_rows(flat.values)
    assert all(s["a"].device.type == "cpu" and s["a"].is_pinned() for s in sets)
    assert len({s["a"].untyped_storage().data_ptr() for s in sets}) == 5
    for k, s in enumerate(sets):
        assert torch.equal(torch.cat([s["a"].flatten(), s["b"].flatten()]), flat.values[k].cpu())
    other = FlatStack(flat.shapes, 5, "cuda", torch.float32)
    other.write_rows(other.values, sets)
    assert torch.equal(other.values, flat.values)


def test_a_batch_goes_to_the_gpu_through_pinned_memory_and_arrives_whole():
    """models.transfer.to_device: a batch and its scored positions copied without a host wait arrive equal
    to the host's values, though the host tensors are overwritten at once (the pinned copy is its own)."""
    from fedsweep.models.transfer import to_device

    g = torch.Generator().manual_seed(0)
    host = {"input_ids": torch.randint(0, 49_152, (64, 160), generator=g), "rows": torch.arange(5_000) % 64,
            "x": torch.randn(64, 160, generator=g)}
    want = {k: v.clone() for k, v in host.items()}
    out = to_device(host, torch.device("cuda"))
    for v in host.values():
        v.zero_()
    torch.cuda.synchronize()
    for k, v in out.items():
        assert v.device.type == "cuda" and v.dtype == want[k].dtype
        assert torch.equal(v.cpu(), want[k]), k
    from fedsweep.models.transfer import tensor_on

    for values, dtype in (([3, 1, 2], None), ([0.1, 1 / 3], torch.float32), ([0.1, 1 / 3], torch.bfloat16)):
        got = tensor_on(values, torch.device("cuda"), dtype)
        assert torch.equal(got.cpu(), torch.tensor(values, dtype=dtype))
