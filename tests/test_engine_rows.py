"""The engine's layout of a step's rows into forwards (``engine.rows``), against brute force, and the
training loop's refusal of a ``client_loss`` that does not add a term."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fedsweep.engine.rows import Shape, buckets, padding

from in_process import client_actor


def _check(shapes, layout, max_padding, min_rows, max_rows):
    assert sorted(i for b in layout for i in b) == list(range(len(shapes)))  # each unit exactly once
    widths = [[shapes[i].width for i in b] for b in layout]
    flat = [w for ws in widths for w in ws]
    assert flat == sorted(flat)  # by width, bucket after bucket
    for b in layout:
        rows = sum(len(shapes[i].lengths) for i in b)
        real, padded = padding(shapes, [b])
        if max_rows is not None and len(b) > 1:
            assert rows <= max_rows
        # a bucket is within the padding bound, or was still below min_rows when its last unit came
        below = sum(len(shapes[i].lengths) for i in b[:-1]) < min_rows
        assert padded <= max_padding * real + 1e-9 or below or len(b) == 1


@pytest.mark.parametrize("seed", range(40))
def test_buckets_keep_padding_within_the_bound_and_are_maximal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    pair = rng.random() < 0.3
    shapes = [Shape(tuple(rng.randint(1, 120) for _ in range(2 if pair else 1))) for _ in range(n)]
    max_padding = rng.choice([0.0, 0.15, 0.5])
    min_rows = rng.choice([1, 4])
    max_rows = rng.choice([None, 8])
    layout = buckets(shapes, max_padding, max_rows, min_rows)
    _check(shapes, layout, max_padding, min_rows, max_rows)
    for a, b in zip(layout, layout[1:]):  # greedy: the next bucket's first unit did not fit
        merged = a + b[:1]
        real, padded = padding(shapes, [merged])
        rows = sum(len(shapes[i].lengths) for i in merged)
        fits = (padded <= max_padding * real or sum(len(shapes[i].lengths) for i in a) < min_rows) and \
               (max_rows is None or rows <= max_rows)
        assert not fits


def test_equal_lengths_are_one_forward_and_ties_keep_their_order():
    shapes = [Shape((7,))] * 5
    assert buckets(shapes) == [[0, 1, 2, 3, 4]]
    assert padding(shapes, [[0, 1, 2, 3, 4]]) == (35, 0)


def test_the_greedy_layout_pads_no_more_than_one_forward_and_meets_the_bound_by_brute_force():
    """On small cases, every contiguous cut of the sorted units is enumerated: the greedy layout's
    padding is within the bound whenever some layout is, and never above one forward's."""
    rng = random.Random(7)
    for _ in range(60):
        shapes = [Shape((rng.randint(1, 50),)) for _ in range(rng.randint(1, 8))]
        order = sorted(range(len(shapes)), key=lambda i: shapes[i].width)
        greedy = buckets(shapes, 0.15)
        real, padded = padding(shapes, greedy)
        assert padded <= padding(shapes, [order])[1]
        for cuts in itertools.product([0, 1], repeat=len(order) - 1):
            layout, cur = [], [order[0]]
            for i, cut in zip(order[1:], cuts):
                if cut:
                    layout.append(cur)
                    cur = []
                cur.append(i)
            layout.append(cur)
            if all(padding(shapes, [b])[1] <= 0.15 * padding(shapes, [b])[0] for b in layout):
                assert all(padding(shapes, [b])[1] <= 0.15 * padding(shapes, [b])[0] for b in greedy)
                break


def test_a_client_loss_that_is_not_the_loss_plus_a_term_is_refused():
    """The engine splits a step's loss over forwards, so a method's client_loss must add a term of
    the client's tensors: one that scales the loss is refused at the first step, in one line."""
    from fedsweep.config import validate
    from fedsweep.engine.training import Job, train_group
    from fedsweep.orchestrator.experiment_data import prepare_data

    cfg = validate({"name": "x", "model": {"name": "tiny"}, "lora": {"r": 2},
                    "data": {"tasks": ["basic_arithmetic", "gcd"], "examples_per_task": 8},
                    "clients": {"num_clients": 2, "clients_per_actor": 2}, "train": {"steps": 2, "batch_size": 2}})
    clients, _, _ = prepare_data(cfg)
    actor = client_actor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    slot = actor.slots[0]
    job = Job(0, 1, slot.rank, 2, slot.params, None, slot.train_enc, loss_hook=lambda raw, own: 2 * raw)
    with pytest.raises(ValueError, match="client_loss must return the loss plus a term"):
        train_group(actor.base, [job])
    job.loss_hook = lambda raw, own: raw + 0.5 * sum((t ** 2).sum() for t in own.values())
    out = train_group(actor.base, [job])[0]
    assert len(out.losses) == 2 and all(torch.isfinite(torch.tensor(out.losses)))


def test_host_to_device_helpers_on_the_cpu_are_torch_tensor_and_to():
    """models.transfer on a CPU device: tensor_on is torch.tensor (same dtype inference, same values) and
    to_device leaves values and dtypes as they are (the pinned path is tests/test_gpu.py's)."""
    import torch

    from fedsweep.models.transfer import tensor_on, to_device

    cpu = torch.device("cpu")
    for values, dtype in (([3, 1, 2], None), ([0.1, 1 / 3], None), ([0.1, 1 / 3], torch.bfloat16), ([True], None)):
        got, want = tensor_on(values, cpu, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
    batch = {"ids": torch.arange(6).view(2, 3), "x": torch.randn(2, 3, dtype=torch.float64)}
    out = to_device(batch, cpu)
    assert all(out[k].dtype == v.dtype and torch.equal(out[k], v) for k, v in batch.items())


def test_a_scoring_forward_builds_no_kv_cache_and_gives_the_same_logits():
    """Training and test-loss forwards pass ``use_cache=False``: the logits equal the cached forward's
    bit for bit, with fewer operator calls."""
    import torch

    from fedsweep.bench.ops import count_ops
    from fedsweep.config import validate
    from fedsweep.engine.text import collate
    from fedsweep.orchestrator.experiment_data import prepare_data

    from in_process import client_actor

    cfg = validate({"name": "cache", "model": {"name": "tiny"}, "clients": {"num_clients": 1},
                    "data": {"tasks": ["gcd"], "examples_per_task": 8}, "tracking": {"enabled": False},
                    "checkpoint": {"enabled": False}})
    clients, _, _ = prepare_data(cfg)
    actor = client_actor(cfg, [{"cid": 0, "train": clients[0].train, "test": clients[0].test}])
    base, slot = actor.base, actor.slots[0]
    batch = collate(slot.train_enc[:4], base.pad)
    zeros = torch.zeros(4, dtype=torch.long)
    with torch.no_grad(), base.bind([slot.rank], [slot.params]) as binding, binding.rows([0] * 4):
        ours = base.forward(batch, zeros, zeros)
        cached = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=True).logits
        assert torch.equal(ours, cached)
        without = count_ops(lambda: base.forward(batch, zeros, zeros))["aten_calls"]
        with_cache = count_ops(lambda: base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                                  use_cache=True))["aten_calls"]
    assert without < with_cache, (without, with_cache)
