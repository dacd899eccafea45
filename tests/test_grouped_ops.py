"""Operator calls of a grouped round (``fedsweep bench throughput --ops``): a GPU's kernel launches,
counted on the CPU. A round of K = 50 clients trained as one group must cost at most twice the
calls of a round of one client (launches grow with layers, not with clients × layers), and a step
about what one client's step costs. The same count run one client at a time grows with K (the
counter sees what the grouping saves), and so does the by-length layout's number of forwards."""

from __future__ import annotations

from collections import Counter

import pytest

from fedsweep.config import load_config
from fedsweep.bench import grouped
from fedsweep.bench.ops import NO_KERNEL, count_ops

SETTINGS = ["train.steps=2", "data.examples_per_task=120", "partition.scheme=iid", "train.forwards=one"]


def _ops(k: int, *extra: str, alone: bool = False) -> dict:
    from fedsweep.config.schema import BatchPlan

    actor = grouped.packed_actor(load_config("configs/experiments/smoke.yaml", SETTINGS + list(extra)), k)
    if alone:
        actor.batch_plan = BatchPlan(1, "one at a time (the comparison)")
    return {**grouped.ops_of(actor), "tensors": len(next(iter(actor.init_params.values())))}


@pytest.fixture(scope="module")
def one():
    return _ops(1)


@pytest.fixture(scope="module")
def fifty():
    return _ops(50)


@pytest.mark.xdist_group("grouped_ops")
def test_a_round_of_fifty_grouped_clients_makes_at_most_twice_the_calls_of_one(one, fifty):
    assert fifty["round_compute_calls"] <= 2 * one["round_compute_calls"], (fifty, one)
    assert fifty["round_aten_calls"] <= 2 * one["round_aten_calls"], (fifty, one)
    assert fifty["step_aten_calls"] <= 1.25 * one["step_aten_calls"], (fifty, one)


def _eval_ops(k: int, how: str) -> dict:
    """A round's evaluation of ``k`` clients holding as many test rows each as one client alone (the
    data grows with k), with the global model."""
    cfg = load_config("configs/experiments/smoke.yaml", ["data.examples_per_task=" + str(12 * k), "partition.scheme=iid",
                                                        f"eval.forwards={how}", "eval.max_new_tokens=4"])
    actor = grouped.packed_actor(cfg, k)
    rows = sum(len(s.test_enc) for s in actor.slots.values())
    return {**grouped.eval_ops_of(actor), "rows": rows}


@pytest.mark.xdist_group("grouped_ops")
def test_a_round_of_fifty_clients_evaluation_makes_at_most_twice_the_calls_of_one():
    """Evaluation as lean as training: 50 clients sharing the global model, each with as many test rows
    and prompts as one client alone, evaluated in one forward and one generation (``eval.forwards:
    one``, a GPU's default) make at most twice one client's calls; by length, in forwards and generate
    calls of ``eval.batch_size`` rows (the CPU's default), the calls grow with the clients."""
    one, fifty = _eval_ops(1, "one"), _eval_ops(50, "one")
    assert fifty["rows"] >= 40 * one["rows"]  # the data grew with the clients
    assert fifty["compute_calls"] <= 2 * one["compute_calls"], (fifty, one)
    assert fifty["aten_calls"] <= 2 * one["aten_calls"], (fifty, one)
    by_length = _eval_ops(10, "by_length")
    assert by_length["compute_calls"] > 5 * one["compute_calls"]  # the count sees what one forward saves


@pytest.mark.xdist_group("grouped_ops")
def test_a_round_sets_up_fifty_clients_with_one_call_per_client_and_tensor(one, fifty):
    """The round's set-up (starts in, optimiser states in and out, results out) of 50 clients as one
    group: beyond one client's, at most one call per further client and adapter tensor (the view
    that makes its trained tensor its own) and 40 per client (its rows' copies in and out, its
    upload) — not one per tensor for each optimiser moment and step counter as well (4 per tensor
    before: 36,000 more calls for 50 SmolLM2 clients, host time a GPU waits on). Measured: 27 per
    client beside the views; before, 66 per client here (8 tensors)."""
    extra = fifty["setup_aten_calls"] - one["setup_aten_calls"]
    assert extra <= 49 * (one["tensors"] + 40), (extra, one["tensors"], fifty, one)


@pytest.mark.xdist_group("grouped_ops")
def test_the_count_sees_clients_trained_one_at_a_time(one):
    """The same round in groups of one costs about K times the calls."""
    ten = _ops(10, alone=True)
    assert ten["round_compute_calls"] > 7 * one["round_compute_calls"]
    assert ten["step_aten_calls"] > 7 * one["step_aten_calls"]


def test_count_ops_counts_nested_calls_and_leaves_views_out_of_compute():
    import torch

    x = torch.ones(4, 3)
    w = torch.ones(2, 3)
    got = count_ops(lambda: torch.nn.functional.linear(x, w).view(-1))
    names = dict(got["top_calls"])
    assert names.get("aten::linear") == 1 and names.get("aten::t") == 1 and names.get("aten::view") == 1
    assert got["aten_calls"] == sum(names.values()) if len(names) < 10 else got["aten_calls"] >= sum(names.values())
    assert got["compute_calls"] == got["aten_calls"] - sum(c for n, c in got["top_calls"] if n in NO_KERNEL)
    assert "aten::view" not in dict(got["top_compute_calls"])


def test_count_ops_counts_host_work_apart_as_one_profiler_window_would():
    """Host work (``fedsweep.host_work``) is counted apart, nested blocks once; the windows the count
    closes at its edges see what one window over the whole work sees, split by the scope's parents."""
    import torch

    from fedsweep.host_work import SCOPE, host_work

    x, w = torch.ones(4, 3), torch.ones(2, 3)

    def work():
        a = torch.nn.functional.linear(x, w)
        with host_work():
            b = (a * 2).sum()
            with host_work():
                c = torch.cdist(a, a).exp()
        return a.view(-1).relu() + b + c.sum()

    got = count_ops(work)
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        expected = work()
    model, host = Counter(), Counter()
    for e in prof.function_events:
        if e.name.startswith("aten::"):
            parent = e.cpu_parent
            while parent is not None and parent.name != SCOPE:
                parent = parent.cpu_parent
            (host if parent is not None else model)[e.name] += 1
    assert torch.equal(got["result"], expected)
    assert got["aten_calls"] == sum(model.values()) > 0 and got["apart_aten_calls"] == sum(host.values()) > 0
    assert got["apart_compute_calls"] == sum(c for n, c in host.items() if n not in NO_KERNEL)
    assert "aten::cdist" not in dict(got["top_calls"]) and dict(got["top_calls"]).get("aten::linear") == 1
    assert got["apart_aten_calls"] >= host["aten::cdist"] + host["aten::mul"] == 2
    unprofiled = count_ops(work, host=False)  # the host work run unprofiled: the model's count alone
    assert unprofiled["aten_calls"] == got["aten_calls"] and unprofiled["apart_aten_calls"] == 0


def test_a_set_read_from_the_layout_is_written_back_as_its_row():
    """``FlatStack.row_of``: a client's tensors as :meth:`read_rows` made them are one row; a set
    laid out otherwise (another order, a copy, a missing key) is not, and both write the same values."""
    import torch

    from fedsweep.models.flat import FlatStack

    flat = FlatStack({"a": (2, 3), "b": (4,)}, 3, "cpu", torch.float32)
    flat.values.copy_(torch.arange(30.0).view(3, 10))
    sets = flat.read_rows(flat.values)
    assert all(flat.row_of(s) is not None for s in sets)
    assert torch.equal(flat.row_of(sets[1]), torch.arange(10.0, 20.0))
    moved = {"b": sets[0]["b"], "a": sets[0]["a"].clone()}
    assert flat.row_of(moved) is None and flat.row_of({"a": sets[0]["a"]}) is None
    other = FlatStack({"a": (2, 3), "b": (4,)}, 3, "cpu", torch.float32)
    other.write_rows(other.values, [moved, sets[1], sets[2]])
    assert torch.equal(other.values, flat.values)
    other.write_rows(other.values, [sets[2]] * 3)  # one start for all: one row, broadcast
    assert torch.equal(other.values, torch.arange(20.0, 30.0).expand(3, 10))
    # each client's row is a storage of its own: a client's upload never carries (or keeps) the others'
    assert len({s["a"].untyped_storage().data_ptr() for s in sets}) == 3
    assert all(s["a"].untyped_storage().nbytes() == 10 * 4 for s in sets)
    sets[0]["a"].zero_()
    assert torch.equal(flat.values[0, :6], torch.arange(6.0)) and torch.equal(sets[1]["a"].flatten(), torch.arange(10.0, 16.0))
    with pytest.raises(ValueError, match="holds? 9 values"):
        other.write_rows(other.values, [{"a": torch.zeros(2, 3), "b": torch.zeros(3)}] + sets[1:])


def test_profile_kernels_reports_the_host_ops_of_the_work():
    """``bench.ops.profile_kernels`` (the GPU profile of ``--ops``) on the CPU: no kernels, and the host
    operators of the work with their true counts (five products, one sum)."""
    import torch

    from fedsweep.bench.ops import profile_kernels

    a = torch.randn(32, 32)
    got = profile_kernels(lambda: torch.stack([a @ a for _ in range(5)]).sum())
    calls = {o["name"]: o["calls"] for o in got["top_host_ops"]}
    assert got["kernels"] == 0 and got["kernel_seconds"] == 0 and got["top_kernels"] == []
    assert calls["aten::mm"] == 5 and calls["aten::sum"] == 1
