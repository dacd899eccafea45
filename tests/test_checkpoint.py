"""Atomic checkpoints: partial rounds are never taken for complete ones."""

from __future__ import annotations

import torch

from fedsweep import checkpoint as ckpt
from fedsweep.algorithms.base import ServerState


def _round(root, rnd, keep=2):
    stage = ckpt.staging_dir(root, rnd)
    ckpt.write_tensors(stage / "server.safetensors", {"globals/w": torch.full((2,), float(rnd))})
    return ckpt.commit(root, rnd, keep)


def test_commit_keeps_the_newest_and_ignores_partial(tmp_path):
    for rnd in (1, 2, 3):
        _round(tmp_path, rnd)
    assert ckpt.complete_rounds(tmp_path) == [2, 3]
    ckpt.staging_dir(tmp_path, 4)  # a crash while writing round 4
    (tmp_path / "round_0005").mkdir()  # a folder without COMPLETE
    assert ckpt.latest(tmp_path).name == "round_0003"
    assert ckpt.read_tensors(ckpt.latest(tmp_path) / "server.safetensors")["globals/w"][0] == 3


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
