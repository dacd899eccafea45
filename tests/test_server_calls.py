"""The client fleet's calls to its client actors (``ClientFleet``) against scripted client actors: real Ray
object refs and ``ray.wait``, but no actor processes. Checked: a few calls per actor carry every
client once with the right payload; a client whose training raised is retried alone once, then
left out with its reason; a result trained by an actor incarnation the server has since adopted
away is replayed on the current one (otherwise the actor would hold the client's state from before
the round while the server aggregates its update); an answer from a life the server never adopted
(restarted between calls, no probe since) is set aside, the actor adopted, and the call made again."""

from __future__ import annotations

import pytest
import ray
import torch

from fedsweep.actors.fleet import ClientFleet
from fedsweep.actors.progress import Progress
from fedsweep.algorithms.types import ClientResult, Payload, Upload


class Method:
    """``actor.method.remote(*args)``: record the call, resolve top-level object refs as Ray does, and
    answer with the script's value as an object ref."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def remote(self, *args):
        self.calls.append(args)
        return ray.put(self.script(*(ray.get(a, timeout=30) if isinstance(a, ray.ObjectRef) else a for a in args)))


class ScriptedActor:
    def __init__(self, token: str, fail_first: dict[int, int] | None = None):
        self.token = token
        self.fail_left = dict(fail_first or {})  # cid -> how many more times its training raises
        self.train_many = Method(self._train_many)
        self.train = Method(lambda rnd, cid, payload: result(cid, payload))
        self.incarnation = Method(lambda: {"token": self.token})
        self.rewinds = []
        self.rewind = Method(self._rewind)
        self.evaluate_many = Method(lambda rnd, groups: (self.token, {c: {"test_loss": float(c)}
                                                                      for cids, _ in groups for c in cids}))

    def _rewind(self, folder):
        """As ``ClientActor.rewind``: back to ``folder`` (None: as built) under a new token."""
        self.rewinds.append(folder)
        self.token = f"{self.token}-rewound"
        return {"token": self.token}

    def _train_many(self, rnd, items, *payloads):
        out = []
        for cid, which in items:
            if self.fail_left.get(cid, 0) > 0:
                self.fail_left[cid] -= 1
                out.append((cid, f"ValueError: client {cid} broke"))
            else:
                out.append((cid, result(cid, payloads[which])))
        return self.token, out


def result(cid: int, payload: Payload) -> ClientResult:
    """An 'update' that shows which payload the client trained from."""
    return ClientResult(cid=cid, num_examples=1, upload=Upload(params={"w": payload.params["w"] + cid}),
                        metrics={"train_loss": float(cid)})


def server(actors, assignment, known) -> ClientFleet:
    """The server's fleet, a few calls per actor (groups of one), no checkpoints to restore from."""
    calls = ClientFleet(actors, assignment, 30.0, Progress())
    calls.known = dict(known)
    return calls


@pytest.fixture
def payloads():
    glob = Payload(params={"w": torch.zeros(2)})
    own = Payload(params={"w": torch.full((2,), 100.0)})
    return {c: (own if c == 5 else glob) for c in range(12)}


def test_a_few_calls_per_actor_carry_every_client_with_its_payload(ray_session, payloads, monkeypatch):
    a, b = ScriptedActor("a"), ScriptedActor("b")
    assignment = {c: (0 if c < 9 else 1) for c in range(12)}
    s = server([a, b], assignment, {0: "a", 1: "b"})
    put, server_puts = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value, **kw: (server_puts.append(value), put(value, **kw))[1])
    results, failures = s.train(1, payloads)
    monkeypatch.setattr(ray, "put", put)
    # one object per distinct payload (at K = 50 a put per client cost 0.3 s of every 135M round)
    assert sum(isinstance(v, Payload) for v in server_puts) == 2
    assert failures == {} and s.retried == {} and sorted(results) == list(range(12))
    for cid, r in results.items():
        assert torch.equal(r.upload.params["w"], payloads[cid].params["w"] + cid)
    # by hand: actor a's 9 clients in 4 calls (2, 2, 2, 3), actor b's 3 clients in 3 calls of one
    assert [len(call[1]) for call in a.train_many.calls] == [2, 2, 2, 3] and len(b.train_many.calls) == 3
    sent = [len(call[2:]) for call in a.train_many.calls]  # distinct payload objects per call
    assert sent == [1, 1, 2, 1]  # client 5's own payload rides along in its call only, beside the global one
    assert a.train.calls == [] and s.progress.snapshot()["done"] == 12
    recorded = [cid for _, cids, _ in s.round_calls for cid in cids]  # every answered call, once
    assert sorted(recorded) == list(range(12)) and len(s.round_calls) == 7


def test_a_client_whose_training_raised_is_retried_alone_once_then_left_out(ray_session, payloads):
    a = ScriptedActor("a", fail_first={3: 1, 7: 2})
    s = server([a], dict.fromkeys(range(12), 0), {0: "a"})
    results, failures = s.train(1, payloads)
    assert sorted(results) == [c for c in range(12) if c != 7]
    assert failures == {7: "ValueError: client 7 broke"}
    assert s.retried == {3: "train retried: ValueError: client 3 broke", 7: "train retried: ValueError: client 7 broke"}
    singles = [call for call in a.train_many.calls if len(call[1]) == 1]
    assert sorted(call[1][0][0] for call in singles) == [3, 7]  # each retried alone, once
    recorded = [cid for _, cids, _ in s.round_calls for cid in cids]
    assert recorded.count(3) == 1 and 7 not in recorded  # a failed try is never replayed


def test_a_result_from_an_incarnation_adopted_away_is_replayed_on_the_current_one(ray_session, payloads):
    old = ScriptedActor("before-restart")
    s = server([old], dict.fromkeys(range(4), 0), {0: "after-restart"})
    s.former.add("before-restart")
    subset = {c: payloads[c] for c in range(4)}
    results, failures = s.train(1, subset)
    assert failures == {} and sorted(results) == [0, 1, 2, 3]
    # each answered call made again as it was made (the same clients together), once
    replays = old.train_many.calls[4:]
    replayed = [(cid, ray.get(call[2 + which])) for call in replays for cid, which in call[1]]
    assert len(replays) == 4 and sorted(cid for cid, _ in replayed) == [0, 1, 2, 3]
    assert all(torch.equal(p.params["w"], subset[cid].params["w"]) for cid, p in replayed)
    assert all(s.retried[c].startswith("replayed after a restart") for c in range(4))
    same = server([ScriptedActor("now")], dict.fromkeys(range(4), 0), {0: "now"})
    same.train(1, subset)
    assert len(same.actors[0].train_many.calls) == 4 and same.retried == {}


def test_an_answer_from_a_life_never_adopted_is_asked_for_again_after_adopting_it(ray_session, payloads):
    restarted = ScriptedActor("new")  # restarted between calls; the server still knows "old"
    s = server([restarted], dict.fromkeys(range(4), 0), {0: "old"})
    subset = {c: payloads[c] for c in range(4)}
    results, failures = s.train(1, subset)
    assert failures == {} and sorted(results) == [0, 1, 2, 3]
    # adopted once, rewound to how it was built (no round committed) under a new token
    assert s.known == {0: "new-rewound"} and s.former == {"old"} and len(restarted.incarnation.calls) == 1
    assert restarted.rewinds == [None]
    launched = [[cid for cid, _ in call[1]] for call in restarted.train_many.calls]
    # every call the life answered before the rewind was computed on state the rewind undid: each of
    # their clients trained again, alone, once
    assert sorted(c for call in launched[:4] for c in call) == [0, 1, 2, 3]
    assert sorted(launched[4:]) == [[0], [1], [2], [3]]
    assert s.retried == dict.fromkeys(range(4), "train retried: answered by a restarted actor before it was brought back")
    assert restarted.train.calls == []  # nothing of this round had been received before the restart: no replay

    again = ScriptedActor("newer")
    s = server([again], dict.fromkeys(range(4), 0), {0: "new"})
    metrics, failures = s.evaluate(1, dict.fromkeys(range(4), payloads[0]))
    assert failures == {} and sorted(metrics) == [0, 1, 2, 3]
    assert len(again.evaluate_many.calls) == 2 and s.known == {0: "newer-rewound"}  # evaluated again once adopted
    same = server([ScriptedActor("now")], dict.fromkeys(range(4), 0), {0: "now"})
    same.evaluate(1, dict.fromkeys(range(4), payloads[0]))
    assert len(same.actors[0].evaluate_many.calls) == 1 and same.actors[0].incarnation.calls == []


def test_a_deferred_checkpoint_is_written_again_only_for_an_actor_that_is_gone():
    """A failed ``ClientActor.saved`` means "write again" only when its actor died, or a new
    incarnation answered that it never made that save; any other error (a full disk) stops the round."""
    from fedsweep.actors.actor_health import died as _died

    def raised(cause: Exception) -> Exception:  # what ray.get raises for an error inside the method
        return ray.exceptions.RayTaskError("saved", "traceback", cause).as_instanceof_cause()

    assert _died(ray.exceptions.ActorDiedError())
    assert _died(ray.exceptions.ActorUnavailableError("restarting", b"\x00" * 16))
    assert _died(raised(LookupError("no deferred checkpoint of round_0001.partial")))
    assert not _died(raised(OSError(28, "No space left on device")))
    assert not _died(ray.exceptions.GetTimeoutError("slow"))
