"""How payloads and uploads cross processes: tensors as numpy buffers, bitwise what went in."""

from __future__ import annotations

import pickle

import pytest
import torch

from fedsweep.algorithms.tensors import WireSet, from_wire, to_wire
from fedsweep.algorithms.types import ClientResult, Payload, Upload


def _tensors() -> dict:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return {
        "f32": torch.randn(3, 4, generator=gen),
        "bf16": torch.randn(4, 3, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=gen).half(),
        "f64": torch.randn(5, generator=gen, dtype=torch.float64),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous
        "row_view": base[2:4],  # a view into a larger storage
        "neg_zero_nan": torch.tensor([-0.0, float("nan"), float("inf")]),
        "grad": torch.ones(2, requires_grad=True),  # left to torch's pickling, flag kept
        "not_a_tensor": 3,
    }


def _same(a, b) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
            and torch.equal(a.detach().reshape(-1).view(torch.uint8) if a.element_size() else a,
                            b.detach().reshape(-1).view(torch.uint8) if b.element_size() else b))


def _pickle5_out_of_band(obj):
    """As Ray moves objects: pickle protocol 5 with out-of-band buffers, read back from read-only memory."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    readonly = [memoryview(bytes(b.raw())) for b in buffers]
    return pickle.loads(data, buffers=readonly), len(buffers)


@pytest.mark.parametrize("transport", ["in_band", "out_of_band"])
def test_a_payload_arrives_bitwise_as_sent(transport):
    params = _tensors()
    sent = Payload(params=params, tensors={"c": torch.randn(2, 2)}, steps_scale=3)
    if transport == "in_band":
        got = pickle.loads(pickle.dumps(sent))
    else:
        got, n = _pickle5_out_of_band(sent)
        dtypes = {t.dtype for t in params.values() if isinstance(t, torch.Tensor) and not t.requires_grad}
        assert len(dtypes) == 6 and n == len(dtypes) + 1  # one buffer per dtype of a set (params, tensors);
        # the grad tensor is torch's, in band
    assert got.steps_scale == 3 and list(got.params) == list(params)  # in the order sent
    for key in params:
        assert _same(got.params[key], params[key]), key
    assert _same(got.tensors["c"], sent.tensors["c"])
    got.params["f32"].add_(1.0)  # received tensors are writable, and writing does not touch what was sent
    assert not torch.equal(got.params["f32"], params["f32"])
    assert isinstance(sent.params["f32"], torch.Tensor)  # the sender's object is not changed by sending


@pytest.mark.parametrize("rows", [2, 300])  # packed, and alone (76.8 KB)
def test_a_view_travels_with_its_own_elements_only(rows):
    big = torch.zeros(1000, 64)
    view = big[:rows]
    size = len(pickle.dumps(Upload(params={"v": view})))
    assert size < 4 * rows * 64 + 1000 < big.numel() * 4
    wire = to_wire({"v": view})
    assert isinstance(wire, WireSet) and [b.nbytes for b in wire.buffers] == [rows * 64 * 4]
    got, _ = _pickle5_out_of_band(Upload(params={"v": view}))
    assert torch.equal(got.params["v"], view)


@pytest.mark.parametrize("chunk, alone", [(None, None), (40, 64)])
def test_many_tensors_of_interleaved_dtypes_and_odd_sizes_arrive_bitwise_and_independent(monkeypatch, chunk, alone):
    """The packing's offsets: odd element counts of 1- and 2-byte dtypes between 4- and 8-byte ones,
    a 0-d tensor, empty ones, large ones that travel alone (one a transposed view), in an order that
    interleaves the dtypes; with the default sizes and with buffers cut every few tensors."""
    from fedsweep.algorithms import tensors

    if chunk:
        monkeypatch.setattr(tensors, "WIRE_CHUNK_BYTES", chunk)
        monkeypatch.setattr(tensors, "WIRE_ALONE_BYTES", alone)
    gen = torch.Generator().manual_seed(1)
    kinds = [torch.float32, torch.bfloat16, torch.bool, torch.float64, torch.int8, torch.float16, torch.int64]
    sent = {}
    for i in range(60):
        dtype, shape = kinds[i % len(kinds)], [(3,), (), (0, 2), (5, 7), (1, 1, 3)][i % 5]
        raw = torch.randn(shape, generator=gen) * 50
        sent[f"t{i}"] = raw > 0 if dtype is torch.bool else raw.to(dtype)
        if i % 17 == 0:  # 72 KiB and more: alone at the default sizes
            sent[f"big{i}"] = torch.randn(130, 140 + i, generator=gen).to(torch.float64 if i % 2 else torch.float32)
    sent["big_t"] = torch.randn(200, 100, generator=gen).t()  # not contiguous, 80 KB
    before = {k: v.clone() for k, v in sent.items()}
    got, n = _pickle5_out_of_band(Upload(params=sent))
    if not chunk:
        assert n == len(kinds) + 5  # one packed buffer per dtype, one per large tensor
    else:
        assert n > len(kinds) + 5  # buffers cut
    assert list(got.params) == list(sent)
    assert all(_same(got.params[k], before[k]) for k in sent)
    for key, t in got.params.items():  # writing each received tensor changes no other, nor the sender's
        if t.numel():
            t.fill_(1)
            assert all(_same(got.params[k], before[k]) for k in list(got.params)[list(got.params).index(key) + 1:])
    assert all(_same(sent[k], before[k]) for k in sent)


def test_a_received_set_is_checkpointed_by_safetensors_own_writer_too(tmp_path, monkeypatch):
    """Received tensors of one dtype are views of one buffer; safetensors' writer (the fallback for a
    dtype the fast writer does not name) checks tensors for shared storage, and takes these."""
    from safetensors.torch import load_file

    from fedsweep import checkpoint, tensor_file

    got, _ = _pickle5_out_of_band(Upload(params={"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}))
    assert got.params["a"].untyped_storage().data_ptr() == got.params["b"].untyped_storage().data_ptr()
    monkeypatch.setattr(tensor_file, "DTYPE_NAMES", {})
    checkpoint.write_tensors(tmp_path / "x.safetensors", got.params)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(back["a"], torch.arange(6.0).reshape(2, 3)) and torch.equal(back["b"], torch.ones(4))


def test_results_and_non_tensor_values_round_trip():
    result = ClientResult(cid=4, num_examples=9, upload=Upload(params={"a": torch.ones(3)}, texts=["x"],
                                                               metrics={"m": 1.0}), bytes_up=12)
    got = pickle.loads(pickle.dumps(result))
    assert got.cid == 4 and got.upload.texts == ["x"] and got.upload.metrics == {"m": 1.0}
    assert torch.equal(got.upload.params["a"], torch.ones(3))
    assert Payload(params=None).__getstate__()["params"] is None
    assert from_wire(to_wire({"k": "text", "n": None})) == {"k": "text", "n": None}


def test_through_ray_the_object_store_gives_back_what_went_in(ray_session):
    import ray

    params = _tensors()
    got = ray.get(ray.put(Payload(params=params)), timeout=60)
    for key in params:
        assert _same(got.params[key], params[key]), key
    got.params["bf16"].mul_(2)  # out of the object store's read-only memory, yet writable


def test_an_actor_call_moves_a_payload_and_returns_an_upload(ray_session):
    import ray

    @ray.remote(num_cpus=0)
    def echo(p: Payload) -> Upload:
        return Upload(params={k: v * 2 for k, v in p.params.items()})

    params = {"w": torch.randn(8, 8, dtype=torch.float32), "h": torch.randn(4).to(torch.bfloat16)}
    up = ray.get(echo.remote(Payload(params=params)), timeout=60)
    assert torch.equal(up.params["w"], params["w"] * 2) and torch.equal(up.params["h"], params["h"] * 2)
    assert up.params["h"].dtype == torch.bfloat16


def test_bench_transport_writes_its_json_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    """``fedsweep bench transport`` times both ways on the real LoRA shape (SmolLM2-135M r=8 on q,v:
    30 layers × 2 modules × A,B = 120 tensors of 576·8 + 8·576 (q) and 8·576 + 192·8 (v) values)."""
    import json

    from fedsweep.cli import main

    assert main(["bench", "transport", "--repeats", "2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("transport_*.json")
    result = json.loads(path.read_text())
    assert result["tensors"] == 120 and result["params"] == 30 * (2 * 576 * 8 + 8 * 576 + 192 * 8)
    assert result["bytes"] == 4 * result["params"]
    assert result["fedsweep_wire_seconds_median"] > 0 and result["torch_pickle_seconds_median"] > 0
    assert main(["bench", "transport", "--targets", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown target modules" in err[0]
