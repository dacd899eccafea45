"""ClientActor in-process (no Ray): loss masking, local training, packing, state round trip."""

from __future__ import annotations

import pytest
import torch

from fedsweep.config import validate
from fedsweep.engine.text import IGNORE, collate, encode_sft, token_loss_rows, token_loss_sum
from fedsweep.algorithms.types import Payload
from fedsweep.data import bundled
from fedsweep.data.partition import make_clients
from fedsweep.models.loading import tiny_tokenizer

from in_process import client_actor

CFG = {"name": "t", "seed": 0, "lora": {"r": 4}, "train": {"steps": 6, "batch_size": 4, "learning_rate": 0.01},
       "eval": {"max_new_tokens": 4}}


@pytest.fixture(scope="module")
def clients():
    recs = bundled.generate(["basic_arithmetic", "gcd", "leg_counting", "spell_backward"], 16, 0)
    return [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(recs, "task", 4, seed=0, test_fraction=0.25)]


@pytest.fixture(scope="module")
def packed(clients):
    return client_actor(validate(CFG), clients)


def test_labels_cover_the_response_and_eos_only():
    tok = tiny_tokenizer()
    ex = encode_sft(tok, "What is 2+2?", "4", max_length=64)
    supervised = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]
    assert tok.decode(supervised) == "4</s>"
    assert ex.labels[: len(ex.labels) - 2] == [IGNORE] * (len(ex.labels) - 2)


def test_truncation_keeps_the_response():
    tok = tiny_tokenizer()
    ex = encode_sft(tok, "x" * 500, "answer", max_length=32)
    assert len(ex.input_ids) == 32
    assert tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE]) == "answer</s>"


def test_token_loss_matches_manual_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, 1, 2, 3, 7]])
    total, count = token_loss_sum(logits, labels)
    manual, n = 0.0, 0
    for b in range(2):
        for t in range(4):  # position t predicts token t+1
            if labels[b, t + 1] != IGNORE:
                manual -= torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]].item()
                n += 1
    assert count == n == 6
    assert total.item() == pytest.approx(manual, rel=1e-5)
    rows, counts = token_loss_rows(logits, labels)  # per row: row 0 has 2 targets, row 1 has 4
    assert counts.tolist() == [2, 4] and rows.sum().item() == pytest.approx(manual, rel=1e-5)
    first = -sum(torch.log_softmax(logits[0, t], -1)[labels[0, t + 1]].item() for t in (1, 2))
    assert rows[0].item() == pytest.approx(first, rel=1e-5)


def test_losses_from_gathered_positions_equal_full_logits_with_gradients(packed):
    """The vocabulary projection runs only where a supervised (SFT) or completion (DPO) token is
    predicted; each row's loss, the count and the adapter's gradient equal those of full logits."""
    from fedsweep.engine.objectives import sequence_logps

    from fedsweep.engine.text import pair_rows

    t = packed.base
    slot = packed.slots[1]
    examples = [slot.train_enc[i] for i in range(3)] + [encode_sft(t.tokenizer, "a much longer prompt " * 4, "a longer response here", 96)]
    batch = collate(examples, t.tokenizer.pad_token_id)
    start = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0)) for k, v in slot.params.items()}
    t.model.eval()
    with t.bind([slot.rank], [start]) as binding, binding.rows([0] * len(examples)):
        params = list(binding.tensors().values())

        def grads(loss):
            return torch.autograd.grad(loss, params, retain_graph=True)

        plen = (batch["labels"] != IGNORE).int().argmax(dim=1)
        full_rows, full_counts = token_loss_rows(t.forward(batch, plen, torch.zeros_like(plen)), batch["labels"])
        sums, counts = t.sft_rows(examples)
        assert counts == full_counts.tolist() and len(set(counts)) > 1
        assert torch.allclose(sums, full_rows, rtol=1e-5, atol=1e-6)
        for g, h in zip(grads(sums.sum()), grads(full_rows.sum())):
            assert torch.allclose(g, h, rtol=1e-4, atol=1e-7)
    pairs = t.encode_preferences([{"prompt": "2+2?", "chosen": "4", "rejected": "five"},
                                  {"prompt": "a longer question here?", "chosen": "yes", "rejected": "no"}])
    pref = pair_rows(pairs, t.tokenizer.pad_token_id)
    with t.bind([slot.rank], [start]) as binding, binding.rows([0] * 4):
        params = list(binding.tensors().values())
        plen = pref["completion_mask"].int().argmax(dim=1)
        full = sequence_logps(t.forward(pref, plen, torch.zeros_like(plen)), pref["input_ids"],
                              pref["completion_mask"]).reshape(-1, 2)
        logps = t.completion_logps(pairs)
        assert torch.allclose(logps, full, rtol=1e-5, atol=1e-5)
        for g, h in zip(torch.autograd.grad(logps.sum(), params, retain_graph=True),
                        torch.autograd.grad(full.sum(), params)):
            assert torch.allclose(g, h, rtol=1e-4, atol=1e-7)
    assert t._gather_head  # the gathered path ran, not the full-logits fallback


def test_collate_pads_with_ignored_labels():
    tok = tiny_tokenizer()
    batch = collate([encode_sft(tok, "a", "b", 64), encode_sft(tok, "long prompt", "b", 64)], tok.pad_token_id)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()


def test_training_lowers_the_training_loss(packed):
    start = packed.initial_params()
    before = packed.hooks.split_loss(packed.slots[0], start, "train")
    result = packed.train(1, 0, Payload(params=start))
    after = packed.hooks.split_loss(packed.slots[0], packed.slots[0].params, "train")
    assert after < before - 0.1
    assert result.num_examples == len(packed.slots[0].train)
    assert result.bytes_up == sum(t.numel() * 4 for t in start.values())


def test_packed_clients_do_not_leak_state_and_match_a_dedicated_actor(clients, packed):
    start = packed.initial_params()
    untouched = packed.client_params(3)
    packed.train(1, 2, Payload(params=start))
    assert all(torch.equal(untouched[k], packed.client_params(3)[k]) for k in untouched)
    alone = client_actor(validate(CFG), [clients[2]])
    a = packed.client_params(2)
    b = alone.train(1, 2, Payload(params=start)).upload.params
    assert all(torch.equal(a[k], b[k]) for k in a)  # packing does not change what a client computes


def test_evaluate_reports_loss_and_accuracy(packed):
    m = packed.evaluate(1, 1, Payload())
    assert set(m) >= {"test_loss", "accuracy", "num_test"} and 0.0 <= m["accuracy"] <= 1.0
    assert m["num_test"] == len(packed.slots[1].test) == m["num_test_loss"]


def test_test_loss_uses_the_whole_split_and_zero_new_tokens_skips_generation(clients, packed):
    """eval.max_examples caps generation only; with eval.max_new_tokens 0 nothing is generated."""
    import copy

    from fedsweep.engine.text import token_loss_sum

    capped = client_actor(validate({**CFG, "eval": {"max_new_tokens": 4, "max_examples": 1}}), clients[1:2])
    m = capped.evaluate(1, 1, Payload())
    slot = capped.slots[1]
    assert m["num_test"] == 1 and m["num_test_loss"] == len(slot.test) > 1
    total = count = 0
    base = capped.base
    with torch.no_grad(), base.bind([slot.rank], [slot.params]) as binding, binding.rows([0]):
        for ex in slot.test_enc:  # one example at a time: the token-weighted mean over the whole split
            batch = collate([ex], capped.tokenizer.pad_token_id)
            plen = (batch["labels"] != IGNORE).int().argmax(dim=1)
            s, c = token_loss_sum(base.forward(batch, plen, torch.zeros_like(plen)), torch.tensor([ex.labels]))
            total, count = total + float(s), count + c
    assert m["test_loss"] == pytest.approx(total / count, rel=1e-5)
    loss_only = client_actor(validate({**copy.deepcopy(CFG), "eval": {"max_new_tokens": 0}}), clients[1:2])
    loss_only.base.generate = None  # generating would fail
    m0 = loss_only.evaluate(1, 1, Payload())
    assert "accuracy" not in m0 and "num_test" not in m0 and m0["test_loss"] == pytest.approx(m["test_loss"], rel=1e-6)


def _perturbed(params: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in params.items()}


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_clients_sharing_a_global_adapter_are_evaluated_together_as_each_alone(clients, batch_size):
    """evaluate_many with one global payload for every packed client: shared batches across clients
    (batch size 3 straddles clients whose test sets differ in length; 1 is one row per pass; 64 all
    rows in one pass) give each client the loss and answers it gets when evaluated alone."""
    cfg = validate({**CFG, "eval": {"max_new_tokens": 4, "batch_size": batch_size}})
    actor = client_actor(cfg, clients)
    lengths = {len(s.test_enc) for s in actor.slots.values()}
    shared = Payload(params=_perturbed(actor.initial_params(), 1))
    _, together = actor.evaluate_many(1, [(sorted(actor.slots), shared)])
    for cid in sorted(actor.slots):
        alone = actor.evaluate(1, cid, Payload(params=shared.params))
        assert together[cid]["test_loss"] == pytest.approx(alone["test_loss"], rel=1e-5), (cid, lengths)
        assert {k: together[cid][k] for k in ("accuracy", "num_test", "num_test_loss")} == \
            {k: alone[k] for k in ("accuracy", "num_test", "num_test_loss")}


def test_shared_generation_gives_each_client_its_own_answers(clients):
    """Generated answers are split back to the client whose prompt they answer: a generator that
    answers clients 0 and 2 correctly and 1 and 3 wrongly gives accuracies 1, 0, 1, 0."""
    actor = client_actor(validate({**CFG, "eval": {"max_new_tokens": 4, "batch_size": 3}}), clients)
    right = {r["prompt"]: r["response"] for cid in (0, 2) for r in actor.slots[cid].test}
    actor.base.generate = lambda prompts, max_new_tokens, **kw: [right.get(p, "\u2205") for p in prompts]
    _, got = actor.evaluate_many(1, [(sorted(actor.slots), Payload(params=actor.initial_params()))])
    assert [got[cid]["accuracy"] for cid in sorted(got)] == [1.0, 0.0, 1.0, 0.0]


def test_evaluate_many_evaluates_alone_what_it_cannot_share(clients):
    """A payload of no parameters (each client's own adapter), a group of one, and a method whose
    evaluation adapter is its own (FedSA-LoRA: the shared A with the client's own B) are each
    evaluated as evaluate() would; different payloads in one call do not leak into each other."""
    actor = client_actor(validate(CFG), clients)
    own = Payload()
    other = Payload(params=_perturbed(actor.initial_params(), 2))
    _, got = actor.evaluate_many(1, [([0, 1], own), ([2], other), ([3], own)])
    for cid, payload in ((0, own), (1, own), (2, other), (3, own)):
        assert got[cid]["test_loss"] == pytest.approx(actor.evaluate(1, cid, payload)["test_loss"], rel=1e-6)
    assert not actor.evaluation.shares_adapter([0, 1], own)
    fedsa = client_actor(validate({**CFG, "algorithm": "fedsa_lora"}), clients[:2])
    assert not fedsa.evaluation.shares_adapter([0, 1], other)


def test_save_and_restore_continue_identically(clients, tmp_path):
    a = client_actor(validate(CFG), clients[:2])
    start = a.initial_params()
    a.train(1, 0, Payload(params=start))
    a.save(str(tmp_path))
    (tmp_path / "COMPLETE").write_text('{"round": 1}')
    b = client_actor(validate(CFG), clients[:2])
    b.restore(str(tmp_path))
    assert b.restored_round == 1 and b.slots[0].opt_state is not None
    ra, rb = a.train(2, 0, Payload()), b.train(2, 0, Payload())
    assert all(torch.equal(ra.upload.params[k], rb.upload.params[k]) for k in ra.upload.params)


def test_a_client_that_sat_out_a_round_has_its_files_reused_not_rewritten(clients, tmp_path):
    import os

    from fedsweep import checkpoint as ckpt

    a = client_actor(validate(CFG), clients[:2])
    a.train(1, 0, Payload(params=a.initial_params()))
    first = a.save(str(ckpt.staging_dir(tmp_path, 1)), None)
    assert (first["written"], first["reused"]) == ([0, 1], [])  # nothing saved before: everything written
    r1 = ckpt.commit(tmp_path, 1, keep=1, known=first["files"])
    assert ckpt.verify(r1) is None
    a.train(2, 0, Payload())  # client 1 sits round 2 out
    second = a.save(str(ckpt.staging_dir(tmp_path, 2)), str(r1))
    assert (second["written"], second["reused"]) == ([0], [1])
    r1_manifest = ckpt.manifest_entries(r1)
    for name in ("client_00001.safetensors", "client_00001.json"):  # the reused files' digests: round 1's
        assert second["files"][name] == r1_manifest[name]
    r1_inode = os.stat(r1 / "client_00001.safetensors").st_ino
    r2 = ckpt.commit(tmp_path, 2, keep=1, known=second["files"])  # prunes round 1: the link keeps the bytes
    assert ckpt.verify(r2) is None
    assert not r1.exists() and os.stat(r2 / "client_00001.safetensors").st_ino == r1_inode
    b = client_actor(validate(CFG), clients[:2])
    b.restore(str(r2))
    for cid in (0, 1):
        for k, v in a.slots[cid].params.items():
            assert torch.equal(b.slots[cid].params[k], v), (cid, k)
    assert b.slots[1].rounds_trained == 0 and b.slots[0].rounds_trained == 2
    # restored clients are clean: saving again reuses both
    third = b.save(str(ckpt.staging_dir(tmp_path, 3)), str(r2))
    assert (third["written"], third["reused"]) == ([], [0, 1])
    # a round staged but never committed (a crash before COMPLETE) is not a source to reuse from
    b.train(3, 0, Payload())
    b.save(str(ckpt.staging_dir(tmp_path, 3)), str(r2))  # client 0 saved as round_0003, uncommitted
    stage = ckpt.staging_dir(tmp_path, 3)  # the retry: round 2 is still the last complete round
    retry = b.save(str(stage), str(r2))
    assert (retry["written"], retry["reused"]) == ([0, 1], [])  # nothing stale reused
    saved = ckpt.nest(ckpt.read_tensors(stage / "client_00000.safetensors"))["params"]
    assert all(torch.equal(saved[k], v) for k, v in b.slots[0].params.items())


def test_a_reused_file_altered_after_its_round_was_sealed_is_not_blessed_by_the_next_round(clients, tmp_path):
    """A reused file's manifest entry is the one its first round recorded, not a digest of what is on
    disk now: a file altered in between (same size, one byte) fails the new round's check too."""
    from fedsweep import checkpoint as ckpt

    a = client_actor(validate(CFG), clients[:2])
    a.train(1, 0, Payload(params=a.initial_params()))
    r1 = ckpt.commit(tmp_path, 1, keep=2, known=a.save(str(ckpt.staging_dir(tmp_path, 1)), None)["files"])
    damaged = r1 / "client_00001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))  # in place: the inode (and a later hard link) is the same
    a.train(2, 0, Payload())  # client 1 sits round 2 out: its round-1 files are reused
    second = a.save(str(ckpt.staging_dir(tmp_path, 2)), str(r1))
    assert second["reused"] == [1]
    r2 = ckpt.commit(tmp_path, 2, keep=2, known=second["files"])
    assert ckpt.verify(r1) == "client_00001.safetensors does not match its SHA-256"
    assert ckpt.verify(r2) == "client_00001.safetensors does not match its SHA-256"


class _HeldPool:
    """A writer pool whose tasks (copies and writes) wait for ``gate``."""

    def __init__(self):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.gate, self._pool = threading.Event(), ThreadPoolExecutor(2)

    def submit(self, fn, *args):
        return self._pool.submit(lambda: (self.gate.wait(30), fn(*args))[1])


def test_a_deferred_save_writes_the_state_as_it_was_when_saved(clients, tmp_path, monkeypatch):
    """checkpoint.overlap: the files hold the state as it was copied out, though the next round trains
    (and a tensor is changed in place) before they are written; the digests returned match the disk."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fedsweep import checkpoint as ckpt
    from fedsweep.actors import client_state
    from fedsweep.actors.client_state import detach_state, stage_slots

    a = client_actor(validate(CFG), clients[:2])
    a.train(1, 0, Payload(params=a.initial_params()))
    want = {cid: ({k: v.clone() for k, v in s.params.items()}, detach_state(s.opt_state) if s.opt_state else None)
            for cid, s in a.slots.items()}
    gate, write = threading.Event(), client_state.write_files  # the copies run, the writes wait
    monkeypatch.setattr(client_state, "write_files", lambda todo: (gate.wait(30), write(todo))[1])
    pending = stage_slots(a.slots, str(ckpt.staging_dir(tmp_path, 1)), None, ThreadPoolExecutor(4))
    assert pending.staged() == {"written": [0, 1], "reused": []}
    pending.copied(timeout=30)
    a.train(2, 0, Payload())  # the next round trains client 0 before anything is written
    for v in a.slots[1].params.values():
        v.add_(1.0)  # and client 1's tensors change in place
    assert not any(torch.equal(a.slots[0].params[k], v) for k, v in want[0][0].items())
    gate.set()
    r1 = ckpt.commit(tmp_path, 1, keep=1, known=pending.result(timeout=30)["files"])
    assert ckpt.verify(r1) is None  # the digests are those of the bytes on disk
    b = client_actor(validate(CFG), clients[:2])
    b.restore(str(r1))
    for cid, (params, opt) in want.items():
        assert all(torch.equal(b.slots[cid].params[k], v) for k, v in params.items()), cid
        if opt is not None:
            for i, state in opt["state"].items():
                got = b.slots[cid].opt_state["state"][i]
                assert all(torch.equal(got[k], v) for k, v in state.items() if torch.is_tensor(v)), (cid, i)


def test_an_actor_copies_its_state_out_behind_save_and_trains_only_after(clients, tmp_path):
    """``save(defer=True)`` answers before the state is copied (the copies run on the writer threads);
    the next training waits until they are done, so the files hold the state as it was at ``save``:
    AdamW's moments and step, which the next round's steps change in place, included."""
    import threading

    from fedsweep import checkpoint as ckpt
    from fedsweep.actors.client_state import detach_state

    a = client_actor(validate(CFG), clients[:2])
    a.train(1, 0, Payload(params=a.initial_params()))
    want = detach_state(a.slots[0].opt_state)
    a.saves._write_pool = pool = _HeldPool()  # copies and writes wait for the gate
    stage = str(ckpt.staging_dir(tmp_path, 1))
    assert a.save(stage, None, defer=True)["deferred"]  # answered with nothing copied yet
    trainer = threading.Thread(target=a.train, args=(2, 0, Payload()))
    trainer.start()
    trainer.join(1.0)
    assert trainer.is_alive()  # the next round's training waits for the copies
    pool.gate.set()
    trainer.join(60)
    assert not trainer.is_alive() and a.slots[0].rounds_trained == 2
    r1 = ckpt.commit(tmp_path, 1, keep=1, known=a.saved(stage)["files"])
    b = client_actor(validate(CFG), clients[:2])
    b.restore(str(r1))
    for i, state in want["state"].items():
        got = b.slots[0].opt_state["state"][i]
        assert all(torch.equal(got[k], v) for k, v in state.items() if torch.is_tensor(v)), i
    moved = a.slots[0].opt_state["state"]
    assert any(not torch.equal(moved[i]["exp_avg"], want["state"][i]["exp_avg"]) for i in moved)  # it did train


def test_the_actors_deferred_save_is_collected_by_saved(clients, tmp_path):
    from fedsweep import checkpoint as ckpt

    a = client_actor(validate(CFG), clients[:2])
    a.train(1, 1, Payload(params=a.initial_params()))
    stage = str(ckpt.staging_dir(tmp_path, 1))
    ack = a.save(stage, None, defer=True)
    assert ack == {"written": [0, 1], "reused": [], "deferred": True, "token": a.incarnation_token}
    with pytest.raises(LookupError, match="no deferred checkpoint"):
        a.saved(str(tmp_path / "round_0009.partial"))  # what this incarnation never saved
    files = a.saved(stage)["files"]
    assert sorted(files) == ["client_00000.json", "client_00000.safetensors", "client_00001.json",
                             "client_00001.safetensors"]
    assert ckpt.verify(ckpt.commit(tmp_path, 1, keep=1, known=files)) is None
    with pytest.raises(LookupError):  # collected once
        a.saved(stage)


def test_the_shared_pool_is_embedded_once_for_all_packed_clients(packed):
    calls = []
    packed.hooks._embed = lambda texts: calls.append(tuple(texts)) or torch.zeros(len(texts), 2)
    packed.hooks._embedded = {}
    pool = ["p1", "p2"]
    for cid in range(6):  # more clients than memo slots: the pool, used by each, is never evicted
        packed.hooks.embed([f"local {cid}"])
        packed.hooks.embed(pool)
    assert calls.count(tuple(pool)) == 1 and len(calls) == 7
    packed.hooks._embed = None


def test_system_prompt_replaces_the_templates_default():
    from fedsweep.engine.text import prompt_text

    import copy

    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = None
    assert prompt_text(tok, "2+2?", "Be brief.") == "Be brief.\n2+2?\n"
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert prompt_text(tok, "2+2?") == "<user>2+2?<assistant>"
    assert prompt_text(tok, "2+2?", "Be brief.") == "<system>Be brief.<user>2+2?<assistant>"
    ex = encode_sft(tok, "2+2?", "4", 64, system="Be brief.")
    assert ex.input_ids[:len(ex.input_ids) - 2] == tok(prompt_text(tok, "2+2?", "Be brief."),
                                                       add_special_tokens=False)["input_ids"]


def test_evaluation_groups_share_only_a_global_payload_within_one_actor():
    """Clients evaluated with one parameter object and nothing else are one group per actor; a
    personal adapter, extra tensors or a base update make a client a group of its own."""
    from fedsweep.actors.call_plan import evaluation_groups

    glob, mine = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    payloads = {0: Payload(params=glob), 1: Payload(params=glob), 2: Payload(params=glob), 3: Payload(params=mine),
                4: Payload(params=glob, tensors={"c": torch.zeros(1)}), 5: Payload(), 6: Payload(params=glob),
                7: Payload(params=glob, base_version=1, base_deltas={"m": torch.zeros(1)})}
    assignment = {0: 0, 1: 0, 2: 1, 3: 0, 4: 0, 5: 1, 6: 1, 7: 0}
    groups = evaluation_groups(payloads, assignment)
    as_ids = {i: [(cids, id(p)) for cids, p in g] for i, g in groups.items()}
    assert as_ids == {0: [([0, 1], id(payloads[0])), ([3], id(payloads[3])), ([4], id(payloads[4])),
                          ([7], id(payloads[7]))],
                      1: [([2, 6], id(payloads[2])), ([5], id(payloads[5]))]}
    assert sorted(c for g in groups.values() for cids, _ in g for c in cids) == sorted(payloads)
    same_values = {0: Payload(params={"w": torch.zeros(2)}), 1: Payload(params={"w": torch.zeros(2)})}
    assert [cids for cids, _ in evaluation_groups(same_values, {0: 0, 1: 0})[0]] == [[0], [1]]  # by identity


def test_training_calls_cut_each_actors_clients_in_order_into_near_equal_runs():
    from fedsweep.actors.call_plan import training_calls

    # actor 0 holds 10 clients, actor 1 holds 3, actor 2 holds 1; the order clients come in is kept
    assignment = {c: 0 for c in range(10)} | {10: 1, 11: 1, 12: 1, 13: 2}
    order = [13, 0, 10, 1, 2, 3, 11, 4, 5, 6, 7, 12, 8, 9]
    calls = training_calls(order, assignment, per_actor=4)
    # by hand: 10 clients in 4 runs at 10*i//4 = 0, 2, 5, 7, 10; 3 clients in 3 runs of one; 1 in one
    assert calls == [(2, [13]), (0, [0, 1]), (0, [2, 3, 4]), (0, [5, 6]), (0, [7, 8, 9]),
                     (1, [10]), (1, [11]), (1, [12])]
    assert training_calls(order, assignment, per_actor=1) == [(2, [13]), (0, list(range(10))), (1, [10, 11, 12])]
    for per_actor in (1, 2, 3, 7, 50):  # every client once, in order, runs within one of each other in size
        got = training_calls(order, assignment, per_actor)
        assert sorted(c for _, cids in got for c in cids) == sorted(order)
        for index in (0, 1, 2):
            runs = [cids for i, cids in got if i == index]
            assert [c for r in runs for c in r] == [c for c in order if assignment[c] == index]
            assert len(runs) <= per_actor and max(map(len, runs)) - min(map(len, runs)) <= 1


def test_train_many_equals_training_each_client_alone_and_reports_a_failing_client(clients, monkeypatch):
    """One call training three clients (two sharing a payload object) gives bitwise what one call
    each gives on an identical actor; a client whose training raises is reported as a line and the
    clients after it still train. (Groups of one: ``batch_clients: off``; larger groups are
    tests/test_lockstep.py's.)"""
    cfg = validate({**CFG, "train": {**CFG["train"], "batch_clients": "off"}})
    together, alone = client_actor(cfg, clients), client_actor(cfg, clients)
    start = together.initial_params()
    other = {k: v + 0.01 for k, v in start.items()}
    shared, own = Payload(params=start), Payload(params=other)
    token, answers = together.train_many(1, [(2, 0), (0, 1), (3, 0)], shared, own)
    assert token == together.incarnation_token and [cid for cid, _ in answers] == [2, 0, 3]
    expected = {2: alone.train(1, 2, Payload(params=start)), 0: alone.train(1, 0, Payload(params=other)),
                3: alone.train(1, 3, Payload(params=start))}
    for cid, result in answers:
        assert result.metrics["train_loss"] == expected[cid].metrics["train_loss"]
        for k, v in expected[cid].upload.params.items():
            assert torch.equal(result.upload.params[k], v), (cid, k)

    from fedsweep.actors.client_training import ClientTraining

    real = ClientTraining._begin_all

    def broken_for_client_1(self, rnd, work, done):
        if any(cid == 1 for cid, _ in work):
            raise ValueError("client 1 has no training examples\nsecond line")
        return real(self, rnd, work, done)

    monkeypatch.setattr(ClientTraining, "_begin_all", broken_for_client_1)
    _, answers = together.train_many(2, [(1, 0), (2, 0)], shared)
    assert answers[0] == (1, "ValueError: client 1 has no training examples")
    assert answers[1][0] == 2 and answers[1][1].cid == 2 and answers[1][1].metrics["steps"] > 0
