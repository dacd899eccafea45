"""Sharded clients (``clients.shard``): a client's frozen base over G processes.

Checked against the unsharded client, computed independently in this process:

* the row split's arithmetic, in process: the group's average of the per-process losses and
  gradients equals the whole batch's, also when a batch has fewer rows than processes (a process
  computes a row with weight 0) and rows hold different numbers of supervised tokens;
* two real processes (gloo, CPU; ``FEDSWEEP_SHARD_DEVICE=cuda`` puts both on one GPU): after a
  round of local training the adapter and optimiser state equal the unsharded client's, for
  FSDP2 and DeepSpeed ZeRO-3, LoRA and ReFT, SFT (with FedProx's proximal term) and DPO, the
  base's shards on the device or offloaded to the host;
* through Ray: a run whose client is sharded over 2 processes equals an unsharded run; resumed
  from its checkpoint unsharded (a different G), it still does; its checkpoint holds whole
  adapters.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from fedsweep import checkpoint as ckpt
from fedsweep.actors.client import ClientActor
from fedsweep.actors.shard_group import ShardGroup
from fedsweep.algorithms.types import Payload
from fedsweep.config import validate
from fedsweep.data import bundled
from fedsweep.data.partition import make_clients
from fedsweep.errors import ConfigError
from fedsweep.models.sharding import local_bytes

from in_process import client_actor

# on a CPU, DeepSpeed compiles its shared-memory op with a C++ compiler on first use
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and (
    os.environ.get("FEDSWEEP_SHARD_DEVICE") == "cuda" or shutil.which("c++") is not None)
DEVICE = os.environ.get("FEDSWEEP_SHARD_DEVICE", "cpu")
# under `pytest -n` (make test) this module stays on one worker: its module fixture is built once
pytestmark = pytest.mark.xdist_group("sharded")
BASE = {"name": "sh", "seed": 0, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "model": {"tiny": {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                           "intermediate_size": 128}},
        "train": {"steps": 3, "batch_size": 5, "learning_rate": 0.01, "max_length": 96},
        "eval": {"max_new_tokens": 0, "batch_size": 3}, "clients": {"num_clients": 2}}
# ReFT on FSDP2 runs in the offload case (adapter kind and offload are independent of each other)
CASES = {
    "fsdp-lora-fedprox": ("fsdp", {"algorithm": "fedprox", "fedprox": {"mu": 0.5}}),
    "fsdp-lora-dpo": ("fsdp", {"data": {"kind": "preference"}, "train": {"objective": "dpo"}}),
    "deepspeed-lora-fedprox": ("deepspeed", {"algorithm": "fedprox", "fedprox": {"mu": 0.5}}),
    "deepspeed-reft": ("deepspeed", {"adapter": "reft", "algorithm": "fedreft", "reft": {"rank": 2}, "fedreft": {"alpha_tuning": "fixed"}}),
    "fsdp-offload-reft": ("fsdp", {"adapter": "reft", "algorithm": "fedreft", "reft": {"rank": 2},
                                   "fedreft": {"alpha_tuning": "fixed"}, "shard": {"offload": "cpu"}}),
    "deepspeed-offload-lora": ("deepspeed", {"shard": {"offload": "cpu"}}),
}


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def case_config(name: str, shards: int) -> dict:
    backend, extra = CASES[name]
    extra = dict(extra)
    shard_extra = extra.pop("shard", {})
    raw = _merge(BASE, extra)
    if DEVICE == "cuda":
        raw["clients"]["resources"] = {"num_gpus": 0.5 if shards > 1 else 1}
    if shards > 1:
        raw["clients"]["shard"] = {"gpus_per_client": shards, "backend": backend, "comm_backend": "gloo", **shard_extra}
    return raw


def case_clients(name: str) -> list[dict]:
    preference = CASES[name][1].get("data", {}).get("kind") == "preference"
    recs = bundled.generate_preferences(["basic_arithmetic", "gcd"], 14, 0) if preference \
        else bundled.generate(["basic_arithmetic", "gcd"], 14, 0)
    if preference:  # as the runner gives them: the chosen answer is the SFT response
        recs = [{**r, "response": r["chosen"]} for r in recs]
    return [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(recs, "task", 2, seed=0, test_fraction=0.3)]


def one_round(actor: ClientActor) -> dict:
    """A round of both clients from the same start (FedProx pulls toward it), then their evaluation."""
    start = actor.initial_params()
    out = {"start": {k: v.float().numpy() for k, v in start.items()}, "held_bytes": local_bytes(actor.model)}
    for cid in (0, 1):
        result = actor.train(1, cid, Payload(params=start))
        out[f"upload{cid}"] = {k: v.float().numpy() for k, v in result.upload.params.items()}
        out[f"loss{cid}"] = result.metrics["train_loss"]
        state = actor.slots[cid].opt_state["state"]
        out[f"moments{cid}"] = [s["exp_avg"].cpu().float().numpy() for _, s in sorted(state.items())]
        out[f"eval{cid}"] = actor.evaluate(1, cid, Payload())["test_loss"]
    return out


# ---------------------------------------------------------------------- the row split, in process
class SplitOnly(ShardGroup):
    """One process's view of a group, without communication: the test averages over ranks itself."""

    def average(self, tensors):
        pass


@pytest.fixture(scope="module")
def unsharded_actor():
    return client_actor(validate(case_config("fsdp-lora-fedprox", 1)), case_clients("fsdp-lora-fedprox"))


@pytest.mark.parametrize("rows,size", [(5, 2), (2, 3), (4, 4), (1, 2)])
def test_row_split_averages_to_the_whole_batch(unsharded_actor, rows, size):
    """The engine's forward of a sharded client (``GroupTraining._forwards`` with a process group):
    each process's share of a step's rows, its loss scaled by its weight × G over the whole batch's
    tokens; averaged over the processes, the loss and the gradient are the whole batch's."""
    from fedsweep.engine.objectives import Sft
    from fedsweep.engine.training import GroupTraining, Job, _Stream

    actor = unsharded_actor
    base, slot = actor.base, actor.slots[0]
    examples = slot.train_enc[:rows]  # rows of different lengths: different token counts
    gen = torch.Generator().manual_seed(1)
    start = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in slot.params.items()}

    def loss_and_grads(group):
        base.group = group
        training = GroupTraining(base, [Job(slot.cid, 1, slot.rank, 1, start, None, examples)])
        try:
            training._tokens, training._padded = [0], [0]
            losses = torch.zeros(1, dtype=torch.float64)
            training._forwards([_Stream(0, examples, 1.0, Sft.size(examples))], losses, {})
            return float(losses[0]), [t.grad.clone() for t in training.stepped]
        finally:
            training.close()
            base.group = None

    whole, whole_grads = loss_and_grads(None)
    losses, grads = [], []
    for rank in range(size):
        loss, g = loss_and_grads(SplitOnly(rank, size))
        losses.append(loss)
        grads.append(g)
    assert np.mean(losses) == pytest.approx(whole, rel=1e-5)
    assert any(float(g.abs().max()) > 0 for g in whole_grads)
    for i, g in enumerate(whole_grads):
        torch.testing.assert_close(torch.stack([gr[i] for gr in grads]).mean(0), g, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("n,size,expect", [(5, 2, [([0, 2, 4], 1.0), ([1, 3], 1.0)]),
                                           (1, 3, [([0], 1.0), ([0], 0.0), ([0], 0.0)])])
def test_rows_are_dealt_round_robin_and_empty_ranks_weigh_nothing(n, size, expect):
    assert [ShardGroup(r, size).rows(n) for r in range(size)] == expect


# ------------------------------------------------------------------- two real processes (gloo)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(rank: int, size: int, address: str, names: list[str], queue) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")
        group = ShardGroup.join(rank, size, address, "gloo", device, timeout_s=300)
        for name in names:  # a case that fails fails alike on both processes: the next case still runs
            try:
                out = one_round(client_actor(validate(case_config(name, size)), case_clients(name), group=group))
            except Exception:
                import traceback

                out = f"process {rank}: {traceback.format_exc()[-2000:]}"
            if rank == 0:
                queue.put((name, out))
        group.leave()
    except BaseException as exc:  # the parent fails the test with the reason
        import traceback

        queue.put(("error", f"process {rank}: {traceback.format_exc()[-2000:]}"))
        raise SystemExit(1) from exc


@pytest.fixture(scope="module")
def two_process_results():
    names = [n for n in CASES if HAS_DEEPSPEED or not n.startswith("deepspeed")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_process, args=(r, 2, address, names, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < len(names):
            name, value = queue.get(timeout=600)
            if name == "error":  # the group itself failed
                pytest.fail(value)
            out[name] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_two_process_client_equals_the_unsharded_one(two_process_results, name):
    if name.startswith("deepspeed") and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (make setup installs it) or, on a CPU, no C++ compiler is found")
    if name.endswith("dpo") and importlib.util.find_spec("trl") is None:
        pytest.skip("DPO batches are collated by trl, which is not installed")
    got = two_process_results[name]
    if isinstance(got, str):
        pytest.fail(got)
    torch.manual_seed(0)
    expected = one_round(client_actor(validate(case_config(name, 1)), case_clients(name)))
    # the base really is split: each process holds about half of its bytes (the adapter is whole on both)
    assert got["held_bytes"] < 0.6 * expected["held_bytes"]
    for cid in (0, 1):
        assert got[f"loss{cid}"] == pytest.approx(expected[f"loss{cid}"], rel=1e-5)
        assert got[f"eval{cid}"] == pytest.approx(expected[f"eval{cid}"], rel=1e-5)
        assert got[f"upload{cid}"].keys() == expected[f"upload{cid}"].keys()
        for k, v in expected[f"upload{cid}"].items():
            np.testing.assert_allclose(got[f"upload{cid}"][k], v, rtol=1e-3, atol=1e-5, err_msg=k)
        moved = max(np.abs(got[f"upload{cid}"][k] - v).max() for k, v in expected["start"].items())
        assert moved > 1e-3  # training moved the adapter: the equality is not of two untouched starts
        for a, b in zip(got[f"moments{cid}"], expected[f"moments{cid}"]):
            # float32 rounding of two half-batch gradients averaged against one full batch is relative
            # to each tensor's scale, not to each element: an element near cancellation in AdamW's
            # moment differs by more than 1e-3 of itself on some CPUs (measured 1.5e-3 on AVX-512,
            # tensor-relative 7e-5), so the bound is the tensor's
            assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-3 * float(np.abs(b).max()))


# ---------------------------------------------------------------------------- config and plan
def test_refused_combinations_say_why(smoke_raw):
    shard = {"gpus_per_client": 2, "backend": "fsdp"}
    for extra, words in [({"model": {"quantization": "4bit"}, "clients": {"resources": {"num_gpus": 1}}},
                          "bitsandbytes-quantised base cannot be sharded"),
                         ({"algorithm": "flora"}, "merges aggregates into the frozen base"),
                         ({"clients": {"resources": {"num_gpus": 2}}}, "one GPU at most")]:
        raw = _merge(smoke_raw, {"clients": {"shard": shard}})
        raw = _merge(raw, extra)
        with pytest.raises(ConfigError, match=words):
            validate(raw)


def test_plan_shards_the_base_and_splits_the_batch():
    from fedsweep.plan.memory import plan
    from fedsweep.models.shapes import architecture

    raw = {"name": "p", "model": {"name": "tinyllama-1.1b", "dtype": "bfloat16"},
           "clients": {"num_clients": 2, "resources": {"num_gpus": 1}},
           "train": {"batch_size": 8, "max_length": 64}, "eval": {"max_new_tokens": 0, "batch_size": 8}}
    whole = validate(raw)
    arch = architecture(whole.model)
    one = plan(whole, arch)
    sharded = plan(validate(_merge(raw, {"clients": {"shard": {"gpus_per_client": 8}}})), arch)
    offloaded = plan(validate(_merge(raw, {"clients": {"shard": {"gpus_per_client": 8, "offload": "cpu"}}})), arch)
    # one decoder layer's bf16 weights (q, o: 2048²; k, v: 2048×256 with 4 KV heads; MLP 3 × 2048×5632; 2 norms)
    layer = 2 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048)
    root = 2 * (2 * 32000 * 2048 + 2048)  # embeddings, head, final norm
    assert sharded.base == -(-one.base // 8) and offloaded.base == 0
    assert sharded.gathered == root + layer  # the two largest units gathered at once
    assert sharded.live_adapters == one.live_adapters and sharded.optimizer_per_client == one.optimizer_per_client
    assert sharded.train_step < one.train_step  # one row in eight
    quarter = plan(validate(_merge(raw, {"train": {"batch_size": 1}})), arch)
    assert sharded.train_step == quarter.train_step  # 8 rows over 8 GPUs: one row each


# ------------------------------------------------------------------------------- through Ray
def _adapters(run_dir) -> dict:
    state = ckpt.read_tensors(ckpt.latest(run_dir / "checkpoints") / "server.safetensors")
    return {k: v for k, v in state.items() if k.startswith("globals/")}


def test_sharded_run_equals_unsharded_and_resumes_on_another_group_size(ray_session, smoke_raw):
    from fedsweep.orchestrator.runner import run

    smoke_raw["clients"].update(clients_per_actor=4, resources={"num_cpus": 0.5})
    smoke_raw["eval"]["max_new_tokens"] = 2
    sharded = _merge(smoke_raw, {"name": "sharded", "clients": {"shard": {"gpus_per_client": 2, "backend": "fsdp"}}})
    plain = run(validate(_merge(smoke_raw, {"name": "plain"})))
    with pytest.raises(Exception, match="stop_after"):
        run(validate(sharded), stop_after=1)
    first = ckpt.latest(next((smoke_raw_dir(smoke_raw) / "sharded").iterdir()) / "checkpoints")
    whole = ckpt.read_tensors(first / "client_00000.safetensors")
    assert all(v.numel() > 0 for v in whole.values()) and any("lora_A" in k for k in whole)
    resumed = run(validate(_merge(smoke_raw, {"name": "sharded"})), resume=True)  # unsharded now
    a, b = _adapters(plain.run_dir), _adapters(resumed.run_dir)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert [r["metrics"]["test_loss"] for r in resumed.rounds] == pytest.approx(
        [plain.rounds[1]["metrics"]["test_loss"]], rel=1e-5)


def smoke_raw_dir(raw: dict):
    from pathlib import Path

    return Path(raw["checkpoint"]["dir"])
