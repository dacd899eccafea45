"""Atomic checkpoints: partial rounds are never taken for complete ones."""

from __future__ import annotations

import pytest
import torch

from fedsweep import checkpoint as ckpt
from fedsweep.storage import RemotePath, location, remove_tree
from fedsweep.algorithms.types import ServerState


def _round(root, rnd, keep=2):
    stage = ckpt.staging_dir(root, rnd)
    ckpt.write_tensors(stage / "server.safetensors", {"globals/w": torch.full((2,), float(rnd))})
    return ckpt.commit(root, rnd, keep)


@pytest.mark.parametrize("uri", [False, True])
def test_commit_keeps_the_newest_and_ignores_partial(tmp_path, uri):
    root = location(f"file://{tmp_path}/ckpt") if uri else tmp_path  # URI: pyarrow, no rename
    for rnd in (1, 2, 3):
        _round(root, rnd)
    assert ckpt.complete_rounds(root) == [2, 3]
    assert not (tmp_path / "ckpt" / "round_0001").exists() if uri else not (tmp_path / "round_0001").exists()
    stage = ckpt.staging_dir(root, 4)  # a crash while writing round 4: files but no COMPLETE
    ckpt.write_tensors(stage / "server.safetensors", {"globals/w": torch.full((2,), 4.0)})
    (location(root) / "round_0005").mkdir()  # a folder without COMPLETE
    assert ckpt.latest(root).name == "round_0003"
    assert ckpt.read_tensors(ckpt.latest(root) / "server.safetensors")["globals/w"][0] == 3
    assert ckpt.read_json(ckpt.latest(root) / "COMPLETE") == {"round": 3}
    _round(root, 4)  # rewriting the crashed round seals it
    assert ckpt.complete_rounds(root) == [3, 4] and ckpt.read_tensors(ckpt.latest(root) / "server.safetensors")["globals/w"][0] == 4


def test_remote_paths_behave_like_local_ones(tmp_path):
    remote = location(f"file://{tmp_path}/a")
    assert isinstance(remote, RemotePath) and str(remote / "b" / "c.json") == f"file://{tmp_path}/a/b/c.json"
    (remote / "b" / "c.json").write_text('{"x": 1}')
    assert (tmp_path / "a" / "b" / "c.json").read_text() == '{"x": 1}'  # the same bytes on disk
    assert [p.name for p in remote.iterdir()] == ["b"] and (remote / "b").is_dir()
    assert (remote / "b" / "c.json").with_suffix(".txt").name == "c.txt" and not (remote / "nope").exists()
    assert [p.name for p in (remote / "b").glob("*.json")] == ["c.json"]
    remove_tree(remote)
    assert not (tmp_path / "a").exists()


def test_server_state_round_trip():
    state = ServerState(globals={"a": torch.randn(3)}, personal={4: {"a": torch.randn(3)}},
                        buffers={"m": {"a": torch.zeros(3)}}, meta={"t": 3})
    back = ckpt.server_state_from(ckpt.server_state_tensors(state), state.meta)
    assert torch.equal(back.globals["a"], state.globals["a"])
    assert torch.equal(back.personal[4]["a"], state.personal[4]["a"])
    assert torch.equal(back.buffers["m"]["a"], state.buffers["m"]["a"]) and back.meta == {"t": 3}


def test_optimizer_state_round_trip():
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    tensors, meta = ckpt.optimizer_to_tensors(opt.state_dict())
    import json

    meta = json.loads(json.dumps(meta))
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    opt2.load_state_dict(ckpt.optimizer_from_tensors(tensors, meta))
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("uri", [False, True])
@pytest.mark.parametrize("damage", ["delete", "truncate", "flip", "manifest"])
def test_a_damaged_round_is_skipped_for_the_newest_intact_one(tmp_path, uri, damage):
    root = location(f"file://{tmp_path}/ckpt") if uri else tmp_path / "ckpt"
    for rnd in (1, 2):
        stage = ckpt.staging_dir(root, rnd)
        ckpt.write_tensors(stage / "server.safetensors", {"globals/w": torch.full((3,), float(rnd))})
        ckpt.write_json(stage / "client_00000.json", {"cid": 0, "round": rnd})
        ckpt.commit(root, rnd, keep=2)
    local = tmp_path / "ckpt" / "round_0002"
    manifest = ckpt.read_json(location(root) / "round_0002" / "MANIFEST.json")["files"]
    for name in ("server.safetensors", "client_00000.json"):  # the manifest against hashlib, independently
        assert manifest[name] == {"bytes": (local / name).stat().st_size, "sha256": _sha(local / name)}
    assert ckpt.latest_intact(root) == (location(root) / "round_0002", [])
    target = local / "server.safetensors"
    if damage == "delete":
        target.unlink()
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-5])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (local / "MANIFEST.json").unlink()
    last, skipped = ckpt.latest_intact(root)
    assert last.name == "round_0001" and len(skipped) == 1 and skipped[0].startswith("round_0002: ")
    assert {"delete": "missing", "truncate": "bytes", "flip": "SHA-256", "manifest": "MANIFEST.json missing"}[damage] \
        in skipped[0]
    assert ckpt.latest(root).name == "round_0001"
    with pytest.raises(FileNotFoundError):  # a missing file is never read as an empty default
        ckpt.read_tensors(location(root) / "round_0002" / "nope.safetensors")
