"""The fast safetensors writer against safetensors' own reader, and its digests against hashlib."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fedsweep import checkpoint as ckpt
from fedsweep import tensor_file


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN payloads and signed zeros included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def layout(path) -> tuple[int, dict]:
    """(header length, header) parsed by hand from the format's definition."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def awkward() -> dict[str, torch.Tensor]:
    base = torch.randn(6, 5)
    return {
        "matrix": torch.randn(3, 4),
        "transposed": torch.randn(5, 3).t(),  # not contiguous
        "sliced": base[2:, 1:4],  # a view with a storage offset
        "shared_a": base, "shared_b": base,  # one storage twice (safetensors' save_file refuses this)
        "scalar": torch.tensor(3.0),  # AdamW's step counter is 0-dimensional
        "empty": torch.empty(0, 4),
        "nan_and_signed_zero": torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]),
        "half": torch.randn(7).half(),
        "bf16": torch.randn(9).bfloat16(),
        "f64": torch.randn(2, dtype=torch.float64),
        "i64": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(3).to(torch.float8_e4m3fn),
        "grad": torch.randn(4, requires_grad=True) * 2,  # part of a graph
    }


def test_every_tensor_reads_back_bit_for_bit_with_safetensors_own_loader(tmp_path):
    tensors = awkward()
    path = tmp_path / "x.safetensors"
    digest = ckpt.write_tensors(path, tensors)
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert same(back[name], value.detach()), name
    raw = path.read_bytes()
    assert digest == tensor_file.Digest(len(raw), hashlib.sha256(raw).hexdigest())


def test_the_layout_is_the_formats_contiguous_aligned_and_complete(tmp_path):
    path = tmp_path / "x.safetensors"
    ckpt.write_tensors(path, awkward())
    n, header = layout(path)
    assert n % 8 == 0
    spans = sorted(entry["data_offsets"] for entry in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no holes, no overlap
    assert spans[-1][1] == path.stat().st_size - 8 - n  # every byte of the data indexed
    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        assert begin % sizes[entry["dtype"]] == 0, name  # each tensor aligned to its element size
        numel = 1
        for d in entry["shape"]:
            numel *= d
        assert end - begin == numel * sizes[entry["dtype"]], name


def test_an_empty_mapping_is_a_valid_file_and_the_formats_own_key_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    ckpt.write_tensors(path, {})
    assert load_file(str(path)) == {}
    with pytest.raises(ValueError, match="__metadata__"):
        tensor_file.encode({"__metadata__": torch.ones(1)})


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3)
names = st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__")  # the format's own key: refused above
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8])


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(names, st.tuples(shapes, dtypes, st.integers(0, 2**31 - 1)), max_size=8))
def test_any_mapping_of_tensors_reads_back_the_same(tmp_path_factory, spec):
    tensors = {}
    for name, (shape, dtype, seed) in spec.items():
        g = torch.Generator().manual_seed(seed)
        tensors[name] = (torch.randn(shape, generator=g) * 100).to(dtype)
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    ckpt.write_tensors(path, tensors)
    back = load_file(str(path))
    assert set(back) == set(tensors) and all(same(back[k], v) for k, v in tensors.items())


def test_encoded_chunks_are_copies_that_later_in_place_changes_do_not_reach(tmp_path, monkeypatch):
    """What a deferred checkpoint relies on: the chunks hold the tensors as they were when encoded,
    for every group shape (one tensor alone in its dtype, several, a view) and for the fallback."""
    tensors = {**awkward(), "alone_f16": torch.randn(4, 3).half()}
    want = {k: v.clone() for k, v in tensors.items()}
    chunks = tensor_file.encode(tensors)
    with monkeypatch.context() as m:  # safetensors' own writer, for a dtype this one does not name
        m.setattr(tensor_file, "DTYPE_NAMES", {"int64": "I64"})
        fallback = ckpt.tensor_chunks({"alone": tensors["matrix"]})
    for v in tensors.values():
        v.fill_(1)  # in place ("shared_a" and "sliced" share one storage)
    assert not same(tensors["alone_f16"], want["alone_f16"]) and not same(tensors["matrix"], want["matrix"])
    digest = tensor_file.write_chunks(tmp_path / "a.safetensors", chunks)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert all(same(back[k], v.contiguous()) for k, v in want.items())
    assert digest.sha256 == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    ckpt.write_chunks(tmp_path / "b.safetensors", fallback)
    assert same(load_file(str(tmp_path / "b.safetensors"))["alone"], want["matrix"])


def test_write_tensors_falls_back_to_safetensors_for_a_dtype_the_writer_does_not_name(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_file, "DTYPE_NAMES", {"float32": "F32"})
    tensors = {"a": torch.randn(3), "b": torch.arange(4)}  # int64 is "not named" now
    assert not tensor_file.supported(tensors)
    digest = ckpt.write_tensors(tmp_path / "x.safetensors", tensors)
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert digest.sha256 == hashlib.sha256(raw).hexdigest()
    assert all(same(load_file(str(tmp_path / "x.safetensors"))[k], v) for k, v in tensors.items())


def test_a_manifest_from_the_writers_digests_equals_one_read_back_from_disk(tmp_path):
    stage = ckpt.staging_dir(tmp_path, 1)
    known = {"a.safetensors": ckpt.write_tensors(stage / "a.safetensors", awkward()).as_json(),
             "a.json": ckpt.write_json(stage / "a.json", {"x": [1, 2]}).as_json()}
    ckpt.write_tensors(stage / "unlisted.safetensors", {"w": torch.ones(2)})  # not in known: hashed from disk
    from_writers = ckpt.write_manifest(stage, known)
    read_back = ckpt.write_manifest(stage)
    assert from_writers == read_back and set(read_back["files"]) == {"a.safetensors", "a.json", "unlisted.safetensors"}


@pytest.mark.gpu
def test_gpu_tensors_and_cpu_step_counters_in_one_file_read_back(tmp_path):
    params = [torch.nn.Parameter(torch.randn(8, 16, device="cuda")) for _ in range(3)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # exp_avg, exp_avg_sq on the GPU; step on the CPU (capturable=False)
    tensors, _ = ckpt.optimizer_to_tensors(opt.state_dict())
    tensors.update({f"p{i}": p for i, p in enumerate(params)})
    assert {t.device.type for t in tensors.values()} == {"cuda", "cpu"}
    path = tmp_path / "x.safetensors"
    ckpt.write_tensors(path, tensors)
    back = load_file(str(path))
    assert all(same(back[k], v.detach().cpu()) for k, v in tensors.items())


def test_bench_checkpoint_writes_its_json_cleans_its_scratch_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    """``fedsweep bench checkpoint`` on SmolLM2-135M r=8 on q,v: per client 120 LoRA tensors of
    P = 30·(576·8 + 8·576 + 8·576 + 192·8) floats, plus AdamW's two moments and step counter each."""
    from fedsweep.cli import main

    scratch = tmp_path / "scratch"
    assert main(["bench", "checkpoint", "--clients", "3", "--repeats", "1", "--scratch", str(scratch),
                 "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("checkpoint_*.json")
    result = json.loads(path.read_text())
    p = 30 * (576 * 8 + 8 * 576 + 8 * 576 + 192 * 8)
    assert result["tensors_per_client"] == 4 * 120
    assert 3 * (3 * 4 * p + 4 * 120) < result["round_bytes"] < 3 * (3 * 4 * p + 4 * 120) + 200_000  # + headers, JSON
    assert result["fedsweep_seconds_median"] > 0 and result["safetensors_save_file_seconds_median"] > 0
    assert not scratch.exists()
    assert main(["bench", "checkpoint", "--clients", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--clients 0" in err[0]
