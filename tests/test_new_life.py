"""A client actor's new life that answers calls before the server has adopted it.

Ray restarts a killed client actor in well under a second when its worker is forked (and whenever
the machine is quick): the server's probe at the start of the next round then finds it restarting
(``ActorUnavailableError``) and misses it, and the round's training call reaches the new life first.
That life trains on the state it was built with; its answer is set aside, the life adopted, and the
clients trained again. The adoption must rewind the life to the last committed round whatever it did
before (as built where none is committed; round 1's files lost: written again first), and an answer the
life computed before the rewind must count as from a life adopted away (replayed). Until 2026-11-30 a
life was restored only where a round was committed, so one adopted before any was committed kept its
stray training and trained the round again on top of it (``test_end_to_end``'s killed-actor test failed in 4
of 7 loaded runs with the fork server on; its clients' AdamW steps were a round ahead).

The real server (``ServerActor.run_round``) and client actors run in this process behind handles that
answer through object refs, as in ``test_lockstep``; the independent computation is an undisturbed
run of the same config, and both rounds' checkpoints must equal its: AdamW's step counts exactly,
every tensor to 1e-9 relative in float64. Not bitwise: the clients the life trained are retried, and
their uploads reach the server's float64 sum of the actors' partial sums in other parts and order."""

from __future__ import annotations

import copy

import pytest
import ray
import torch

from fedsweep import checkpoint as ckpt
from fedsweep.actors.server import ServerActor
from fedsweep.config import validate
from fedsweep.orchestrator.experiment_data import prepare_data

from in_process import Local, client_actor, resolved

RAW = {"name": "new-life", "seed": 0, "rounds": 2, "algorithm": "fedavg", "model": {"name": "tiny", "dtype": "float64"},
       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
       "data": {"tasks": ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"], "examples_per_task": 8,
                "test_fraction": 0.25},
       "partition": {"scheme": "task"},
       "clients": {"num_clients": 4, "clients_per_actor": 2},
       "train": {"steps": 2, "batch_size": 2, "learning_rate": 0.01, "max_length": 96, "autocast": "none"},
       "eval": {"max_new_tokens": 0, "batch_size": 8}, "checkpoint": {"enabled": True, "overlap": True},
       "tracking": {"enabled": False}}


class Restarting(Local):
    """A client actor's handle whose process Ray restarts: :meth:`restart` puts a new life behind it, and
    the next ``missed`` probes of its incarnation fail as Ray's do while it restarts; with
    ``saves_lost``, a deferred save never reports its files (its life died before they were on disk)."""

    def __init__(self, actor, saves_lost: bool = False):
        super().__init__(actor)
        self.missed, self.saves_lost, self.failed = 0, saves_lost, []

    def restart(self, life, missed: int = 1) -> None:
        self.actor, self.missed = life, missed

    def __getattr__(self, name):
        call = super().__getattr__(name)
        unavailable = ray.exceptions.ActorUnavailableError("the actor is restarting", b"\x00" * 16)
        if name == "incarnation" and self.missed:
            self.missed -= 1
        elif not (name == "saved" and self.saves_lost):
            return call

        handle = self

        class Failing:
            @staticmethod
            def remote(*args, **kwargs):
                handle.failed.append(name)
                if name == "saved":
                    ray.get(call.remote(*args, **kwargs), timeout=60)  # (its files written before it "dies")
                return ray.put(unavailable)

        return Failing()


def _build(raw: dict, tmp_path, saves_lost: bool = False):
    """The server and its two client actors' handles (clients 0–1 and 2–3), and a maker of the second's new life."""
    cfg = validate(raw)
    clients, _, public = prepare_data(cfg)
    cfg = resolved(cfg, 2)
    hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val} for c in clients]
    new_life = lambda: client_actor(cfg, hosted[2:])  # noqa: E731  (Ray runs the constructor again)
    handles = [Restarting(client_actor(cfg, hosted[:2])), Restarting(new_life(), saves_lost)]
    ranks = cfg.client_ranks()
    infos = [{"cid": c.cid, "num_examples": len(c.train), "tasks": c.tasks, "rank": ranks[c.cid],
              "lora_scale": cfg.lora.alpha / ranks[c.cid]} for c in clients]
    server = ServerActor(cfg, infos, handles, {0: 0, 1: 0, 2: 1, 3: 1}, str(tmp_path), public,
                         theta0=[ray.put(handles[0].actor.initial_params())])
    return server, handles, new_life


def _round(root, rnd: int) -> dict[str, torch.Tensor]:
    """Round ``rnd``'s committed checkpoint, every tensor by file and name (verified against its manifest)."""
    folder = root / f"round_{rnd:04d}"
    assert ckpt.verify(folder) is None, folder
    return {f"{f.stem}/{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in ckpt.read_tensors(f).items()}


@pytest.fixture(scope="module")
def undisturbed(ray_session, tmp_path_factory):
    """Both rounds' checkpoints of an undisturbed run, by batching (clients trained one at a time, in groups)."""
    out = {}
    for batching in ("off", "auto"):
        root = tmp_path_factory.mktemp(f"undisturbed-{batching}")
        server, _, _ = _build(_raw(batching), root)
        for rnd in (1, 2):
            server.run_round(rnd)
        out[batching] = [_round(root, 1), _round(root, 2)]
    return out


def _raw(batching: str) -> dict:
    raw = copy.deepcopy(RAW)
    raw["train"]["batch_clients"] = batching
    return raw


@pytest.mark.parametrize("when,batching", [("before round 1", "off"), ("after round 1, its files lost", "off"),
                                           ("after round 1, its files lost", "auto")])
def test_a_life_that_answered_before_it_was_adopted_is_rewound(ray_session, undisturbed, tmp_path, when, batching):
    files_lost = when != "before round 1"
    server, handles, new_life = _build(_raw(batching), tmp_path, saves_lost=files_lost)
    reports = []
    for rnd in (1, 2):
        if rnd == (2 if files_lost else 1):
            handles[1].restart(new_life())  # Ray restarted it; the round's probe finds it restarting
            stray = handles[1].actor.incarnation_token
        reports.append(server.run_round(rnd))
    hit = reports[-1] if files_lost else reports[0]
    reasons = set(hit["retried"].values())
    assert {2, 3} <= set(hit["retried"]) and hit["failures"] == {}
    assert any("answered by a restarted actor before it was brought back" in r for r in reasons), reasons
    assert sorted(handles[1].failed) == ["incarnation"] + (["saved"] if files_lost else [])  # the faults fired
    assert reports[0]["metrics"]["checkpoint_deferred"] == 1.0  # round 1 written while round 2 trained
    assert handles[1].actor.incarnation_token != stray  # rewound: a new token
    for rnd in (1, 2):  # round 1's lost files written again from θ_0, its calls replayed, before it committed
        expected, got = undisturbed[batching][rnd - 1], _round(tmp_path, rnd)
        assert got.keys() == expected.keys()
        for key in expected:  # AdamW's step counts exactly; the rest up to float64 rounding (see above)
            if key.endswith(".step"):
                assert torch.equal(got[key], expected[key]), key
            torch.testing.assert_close(got[key], expected[key], rtol=1e-9, atol=1e-15, msg=lambda m: f"round {rnd}, {key}: {m}")
