"""FedCoFiT: the consensus rule on constructed embeddings, bytes, the offline encoder."""

from __future__ import annotations

import numpy as np
import pytest

from fedsweep.algorithms.types import ServerContext

from fedsweep.config import validate
from fedsweep.algorithms import create
from fedsweep.algorithms.types import AggregationContext, ClientInfo, ClientResult, Upload, payload_bytes, upload_bytes
from fedsweep.algorithms.fedcofit.consensus import choose, consensus_cluster

from in_process import client_actor


def unit(*vs):
    a = np.array(vs, dtype=float)
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def angle(deg):
    r = np.deg2rad(deg)
    return [np.cos(r), np.sin(r), 0.0]


def test_largest_cluster_wins_and_outliers_are_left_out():
    emb = unit(angle(0), angle(2), angle(4), [0, 0, 1], angle(90), angle(92))
    members, outliers = consensus_cluster(emb, eps=0.05, min_samples=2)
    assert members == [0, 1, 2] and not outliers
    c = choose(emb, [5] * 6, eps=0.05, min_samples=2)
    assert c.index == 1  # nearest to the centroid of {0°, 2°, 4°}


def test_all_outliers_fall_back_to_every_response():
    emb = unit([1, 0, 0], [0, 1, 0], [0, 0, 1])
    members, outliers = consensus_cluster(emb, eps=0.1, min_samples=2)
    assert outliers and members == [0, 1, 2]
    # centroid of the three axes is equidistant: ties go to the shortest response, then the smallest index
    assert choose(emb, [9, 4, 4], eps=0.1, min_samples=2).index == 1


def test_equal_size_clusters_prefer_the_tighter_one():
    emb = unit(angle(0), angle(6), angle(90), angle(91))  # two pairs; the second is tighter
    members, _ = consensus_cluster(emb, eps=0.02, min_samples=2)
    assert members == [2, 3]


def test_equal_size_equal_spread_clusters_prefer_the_smallest_client_index():
    emb = unit(angle(90), angle(93), angle(0), angle(3))  # same spread; {0, 1} holds the smallest index
    members, _ = consensus_cluster(emb, eps=0.01, min_samples=2)
    assert members == [0, 1]


def test_centroid_ties_break_by_length_then_index():
    emb = unit(angle(0), angle(10), angle(5), angle(5))  # clients 2 and 3 sit exactly on the centroid
    assert choose(emb, [3, 3, 7, 2], eps=0.1, min_samples=2).index == 3  # shorter wins
    assert choose(emb, [3, 3, 4, 4], eps=0.1, min_samples=2).index == 2  # then the smaller index


def test_ablation_selections():
    emb = unit(angle(0), angle(2), angle(4), angle(60), angle(62))
    rng = np.random.default_rng(0)
    picks = {choose(emb, [1] * 5, 0.01, 2, "random_in_majority", rng).index for _ in range(50)}
    assert picks == {0, 1, 2}  # only majority-cluster members, each eventually
    # the global medoid ignores clusters: the mean distance to all others decides
    d = 1 - emb @ emb.T
    expected = int(np.argmin((d.sum(1)) / 4))
    assert choose(emb, [1] * 5, 0.01, 2, "global_medoid").index == expected


def _embed_by_text(texts):
    """A deterministic stand-in encoder for server tests: texts name their direction."""
    import torch

    table = {"four": angle(0), "4": angle(3), "five": angle(80), "fourr": angle(2)}
    return torch.tensor(unit(*[table[t] for t in texts]), dtype=torch.float32)


def test_server_round_broadcasts_pseudo_labels_and_counts_text_bytes():
    algo = create("fedcofit", {"eps": 0.05, "min_samples": 2})
    ctx = AggregationContext(embed=_embed_by_text)
    public = [{"prompt": "2+2?"}, {"prompt": "2+3?"}]
    state = algo.init({}, ServerContext([ClientInfo(i, 1) for i in range(3)], public=public))
    p1 = algo.dispatch(1, [0, 1, 2], state)[0]
    assert p1.extra_train == [] and payload_bytes(p1) == 0
    uploads = [["four", "five"], ["4", "five"], ["fourr", "four"]]
    results = [ClientResult(i, 1, Upload(texts=t)) for i, t in enumerate(uploads)]
    assert [upload_bytes(r.upload) for r in results] == [8, 5, 9]
    state, report = algo.aggregate(1, results, state, ctx)
    # prompt 0: {four, 4, fourr} cluster, centroid nearest "fourr" (2°); prompt 1: {five, five} vs "four" outlier
    assert state.meta["pseudo"] == ["fourr", "five"]
    p2 = algo.dispatch(2, [0], state)[0]
    assert p2.extra_train == [{"prompt": "2+2?", "response": "fourr", "eos": True},
                                      {"prompt": "2+3?", "response": "five", "eos": True}]
    assert p2.extra_weight == 0.5
    assert payload_bytes(p2) == len("fourr") + len("five")
    assert report.client_metrics[2]["pseudo_labels_won"] == 1.0


def test_semantic_consensus_communication_formula():
    """2·K·M·ℓ̄·c_t for K=10, M=1024, ℓ̄=128, c_t=2: the paper's '5.2 MiB' is 5.24 MB = 5.0 MiB."""
    from fedsweep.models.sizes import consensus_bytes

    b = consensus_bytes(clients=10, prompts=1024, tokens=128, bytes_per_token=2)
    assert b == 5_242_880 and b / 2 ** 20 == 5.0 and round(b / 1e6, 2) == 5.24


def test_lora_bytes_reproduce_the_papers_examples():
    from fedsweep.models.shapes import load_model_config
    from fedsweep.models.sizes import lora_count, paper_lora_bytes

    cfg13 = load_model_config("llama-2-13b")
    n, _ = lora_count(cfg13, 32, ["q_proj", "v_proj"])
    assert n * 2 == 52_428_800 == paper_lora_bytes(cfg13, 32, ["q_proj", "v_proj"], 2)  # 50.0 MiB
    cfg405 = load_model_config("llama-3.1-405b")
    assert paper_lora_bytes(cfg405, 32, ["q_proj", "v_proj"], 2) == 528_482_304  # the paper's 504.0 MiB
    exact, _ = lora_count(cfg405, 32, ["q_proj", "v_proj"])
    # grouped-query attention: v_proj outputs 8·128 = 1024, not 16384
    assert exact * 2 == 2 * 126 * 32 * ((16384 + 16384) + (16384 + 1024))


def test_encoder_loads_offline_and_separates_meanings():
    from fedsweep.models.encoder import load_encoder

    embed = load_encoder("all-MiniLM-L6-v2")
    e = embed(["The answer is four.", "It is 4.", "Paris is the capital of France."])
    assert e.shape == (3, 384)
    np.testing.assert_allclose(e.norm(dim=1).numpy(), 1.0, rtol=1e-5)
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


# ---------------------------------------------------------------- ties, truncation, objective, DP


def test_identical_real_responses_tie_exactly_and_the_smallest_client_wins():
    from fedsweep.models.encoder import load_encoder

    embed = load_encoder("all-MiniLM-L6-v2")
    texts = ["Lyon", "Lyon", "Paris", "Paris"]
    emb = embed(texts).numpy()  # float32, as the server gets them
    c = choose(emb, [len(t) for t in texts], eps=0.05, min_samples=2)
    assert texts[c.index] == "Lyon" and c.cluster == [0, 1]
    # the same with the pairs swapped: Paris holds the smallest index now
    texts2 = ["Paris", "Lyon", "Paris", "Lyon"]
    c2 = choose(embed(texts2).numpy(), [len(t) for t in texts2], eps=0.05, min_samples=2)
    assert texts2[c2.index] == "Paris" and c2.cluster == [0, 2]


def test_float32_rounding_does_not_break_ties():
    base = unit(angle(10), angle(70))
    rng = np.random.default_rng(0)
    # two pairs of the same two vectors, each copy perturbed at float32 rounding level
    emb = np.stack([base[1], base[1], base[0], base[0]]).astype(np.float32)
    emb = emb + rng.normal(scale=3e-8, size=emb.shape).astype(np.float32)
    assert choose(emb, [4, 4, 4, 4], eps=0.01, min_samples=2).index == 0


def test_truncated_responses_are_counted_dropped_on_request_and_broadcast_without_eos():
    import torch

    public = [{"prompt": "2+2?"}]
    # clients 0 and 1 (cut) agree on "four"; client 2 (complete) says "4" within eps
    uploads = [(["four"], [True]), (["four"], [True]), (["4"], [False])]
    for rule, expected, cut in (("keep", "four", True), ("drop", "4", False)):
        algo = create("fedcofit", {"eps": 0.05, "min_samples": 1, "truncated": rule})
        ctx = AggregationContext(embed=_embed_by_text)
        state = algo.init({}, ServerContext([ClientInfo(i, 1) for i in range(3)], public=public))
        results = [ClientResult(i, 1, Upload(texts=t, tensors={"truncated": torch.tensor(c)}))
                   for i, (t, c) in enumerate(uploads)]
        state, report = algo.aggregate(1, results, state, ctx)
        assert state.meta["pseudo"] == [expected], rule
        assert report.metrics["responses_truncated"] == 2.0
        assert report.metrics["pseudo_labels_truncated"] == float(cut)
        record = algo.dispatch(2, [0], state)[0].extra_train[0]
        assert record["eos"] is (not cut)


def test_truncated_pseudo_label_is_encoded_without_eos():
    from fedsweep.engine.text import encode_sft
    from fedsweep.models.loading import tiny_tokenizer

    tok = tiny_tokenizer()
    full = encode_sft(tok, "2+2?", "four", 64)
    cut = encode_sft(tok, "2+2?", "four", 64, eos=False)
    assert full.input_ids[-1] == tok.eos_token_id and cut.input_ids[-1] != tok.eos_token_id
    assert full.input_ids[:-1] == cut.input_ids


def _by_hand_token_mean(actor, examples):
    """Mean response-token cross-entropy over ``examples`` with a plain forward (no trainer code)."""
    import torch

    from fedsweep.engine.text import collate

    batch = collate(examples, actor.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = actor.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                   labels.reshape(-1), ignore_index=-100))


def test_local_objective_weights_private_and_public_means_equally():
    """L_i = ½·E_{D_i}[CE] + ½·E_{D̃pub}[CE], both sets sampled each step (here: each whole)."""
    from fedsweep.engine.text import encode_sft
    from fedsweep.algorithms.types import Payload
    from fedsweep.data import bundled

    recs = bundled.generate(["basic_arithmetic"], 9, 0)
    private = [dict(r) for r in recs[:3]]
    public = [{"prompt": r["prompt"], "response": r["response"] + " and more words here", "eos": True} for r in recs[3:6]]
    clients = [dict(cid=0, train=private, test=[dict(r) for r in recs[6:8]])]
    cfg = {"name": "c", "algorithm": "fedcofit", "fedcofit": {"public_prompts": 3}, "data": {"tasks": ["basic_arithmetic"]},
           "partition": {"scheme": "iid"}, "clients": {"num_clients": 1}, "train": {"steps": 1, "batch_size": 3}}
    actor = client_actor(validate(cfg), clients)
    tok, ml = actor.tokenizer, actor.cfg.train.max_length
    l_priv = _by_hand_token_mean(actor, [encode_sft(tok, r["prompt"], r["response"], ml) for r in private])
    l_pub = _by_hand_token_mean(actor, [encode_sft(tok, r["prompt"], r["response"], ml) for r in public])
    pooled = _by_hand_token_mean(actor, [encode_sft(tok, r["prompt"], r["response"], ml) for r in private + public])
    payload = Payload(data={"public_prompts": [r["prompt"] for r in public], "final": True}, extra_train=public,
                      extra_weight=0.5)
    result = actor.train(1, 0, payload)
    assert result.metrics["train_loss"] == pytest.approx(0.5 * l_priv + 0.5 * l_pub, rel=1e-5)
    assert abs(pooled - (0.5 * l_priv + 0.5 * l_pub)) > 1e-3  # the two readings differ here


def test_dp_accountant_reproduces_opacus_documented_example():
    """Opacus' own test: σ = 1.5, q = 0.04, 90 epochs (2250 steps), δ = 1e-5 → ε = 7.32911117143;
    composed here as nine rounds of 250 steps."""
    from fedsweep.engine.dp import epsilon

    assert epsilon([[1.5, 0.04, 250]] * 9, 1e-5) == pytest.approx(7.32911117143, rel=1e-9)
    assert epsilon([[1.5, 0.04, 250]] * 3, 1e-5) < epsilon([[1.5, 0.04, 250]] * 4, 1e-5)
    assert epsilon([], 1e-5) == 0.0


def test_dp_step_clips_every_per_sample_gradient_and_adds_calibrated_noise():
    import torch

    from fedsweep.engine.dp import noisy_clipped_gradient

    w = torch.nn.Parameter(torch.zeros(3))
    xs = torch.tensor([[10.0, 0, 0], [0, 0.1, 0], [0, 0, -5.0]])  # per-sample gradient of w·x is x

    def loss(i):
        return (w * xs[i]).sum()

    g, _ = noisy_clipped_gradient(loss, [0, 1, 2], {"w": w}, max_grad_norm=1.0, noise_multiplier=0.0,
                                  expected_batch=3, gen=torch.Generator().manual_seed(0))
    expected = (torch.tensor([1.0, 0, 0]) * 10 / (10 + 1e-6) + xs[1] + torch.tensor([0, 0, -1.0]) * 5 / (5 + 1e-6)) / 3
    torch.testing.assert_close(g["w"], expected)
    # noise: std σ·C / B per coordinate
    draws = torch.stack([noisy_clipped_gradient(loss, [], {"w": w}, 2.0, 1.5, 4, torch.Generator().manual_seed(s))[0]["w"]
                         for s in range(400)])
    assert float(draws.mean()) == pytest.approx(0.0, abs=0.05)
    assert float(draws.std()) == pytest.approx(1.5 * 2.0 / 4, rel=0.08)


def test_uploaded_bytes_are_the_response_text_the_flags_reported_apart():
    """The communication formula 2·K·M·ℓ̄·c_t counts response text; the per-response truncation flag
    (fedsweep's addition) is reported as its own metric, not inside the bytes."""
    import torch

    from fedsweep.algorithms.types import ClientContext, Payload

    algo = create("fedcofit", {"max_new_tokens": 4})
    prompts = ["2+2?", "3+3?", "naïve?"]
    answers, cut = ["four", "six", "très long"], [False, False, True]
    ctx = ClientContext(cid=0, rnd=1, num_examples=1, local_params={}, state={}, meta={},
                        payload=Payload(data={"public_prompts": prompts}),
                        generate=lambda p, n, **kw: (answers, cut) if kw.get("with_truncation") else answers)
    up = algo.client_upload(ctx, {})
    assert upload_bytes(up) == sum(len(a.encode("utf-8")) for a in answers) == 4 + 3 + 10
    assert up.metrics["truncation_flag_bytes"] == 3.0 and up.metrics["responses_truncated"] == 1.0
    assert torch.equal(up.tensors["truncated"], torch.tensor(cut))


def test_consensus_draws_come_from_their_own_stream_of_the_runs_seed():
    """``random_in_majority`` draws each round from ``salts.CONSENSUS`` with the run's seed and the round:
    the same seed and round draw the same, another seed draws anew (until 2026-11-28 every seed drew
    from ``[0, round]``, the partition's stream in round 1), and no run-level stream shares its draws."""
    from fedsweep import salts

    algo = create("fedcofit", {"eps": 0.05, "min_samples": 2, "selection": "random_in_majority"})
    public = [{"prompt": f"p{j}"} for j in range(24)]
    uploads = [["four"] * 24, ["4"] * 24, ["fourr"] * 24]  # one majority cluster of three on every prompt

    def picks(seed, rnd):
        state = algo.init({}, ServerContext([ClientInfo(i, 1) for i in range(3)], public=public, seed=seed))
        results = [ClientResult(i, rnd, Upload(texts=t)) for i, t in enumerate(uploads)]
        state, _ = algo.aggregate(rnd, results, state, AggregationContext(embed=_embed_by_text))
        return state.meta["pseudo"]

    def expected(seed, rnd):
        rng = np.random.default_rng(salts.derive_seed(seed, rnd, salts.CONSENSUS))
        return [["four", "4", "fourr"][int(rng.choice([0, 1, 2]))] for _ in range(24)]

    assert picks(0, 1) == expected(0, 1) == picks(0, 1)
    assert picks(1, 1) == expected(1, 1) != picks(0, 1)
    assert picks(0, 2) == expected(0, 2) != picks(0, 1)
    old_partition_stream = np.random.default_rng([0, salts.PARTITION])
    assert picks(0, 1) != [["four", "4", "fourr"][int(old_partition_stream.choice([0, 1, 2]))] for _ in range(24)]
    draws = {tuple(np.random.default_rng(salts.derive_seed(s, r, salts.CONSENSUS)).integers(0, 2**31, 4))
             for s in range(4) for r in range(1, 11)}
    run_level = {tuple(np.random.default_rng([s, v]).integers(0, 2**31, 4)) for s in range(4)
                 for k, v in vars(salts).items() if k.isupper() and isinstance(v, int)}
    assert len(draws) == 40 and not draws & run_level


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_groups_public_responses_generated_together_are_each_clients_own_bit_for_bit(dtype):
    """``client_upload_group`` (every client's responses to the public prompts generated in shared
    batches, each row with its own trained adapter) against ``client_upload`` of each client alone (its
    own generate call, the independent computation): the same texts, character for character, and the
    same truncation flags, under greedy decoding; a final update's upload stays empty."""
    import torch

    from fedsweep.algorithms.types import Payload
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    tasks = ["basic_arithmetic", "gcd", "leg_counting"]
    parts = make_clients(bundled.generate(tasks, 16, 0), "task", 3, seed=0, test_fraction=0.25)
    cfg = validate({"name": "c", "algorithm": "fedcofit", "model": {"dtype": dtype},
                    "fedcofit": {"public_prompts": 4, "max_new_tokens": 6}, "data": {"tasks": tasks},
                    "partition": {"scheme": "task"}, "clients": {"num_clients": 3}})
    actor = client_actor(cfg, [dict(cid=c.cid, train=c.train, test=c.test) for c in parts])
    gen = torch.Generator().manual_seed(4)
    slots = [actor.slots[c] for c in sorted(actor.slots)]
    for slot in slots:  # each client's own adapter (B non-zero): its answers differ from the others'
        slot.params = {k: v + 2.0 * torch.randn(v.shape, generator=gen) for k, v in slot.params.items()}
    prompts = ["What is 7 + 5?", "Spell 'cat' backwards.", "How many legs have 3 ducks?", "gcd of 12 and 18?"]
    payloads = [Payload(data={"public_prompts": prompts}), Payload(data={"public_prompts": prompts, "final": True}),
                Payload(data={"public_prompts": prompts})]
    algo = actor.algo
    alone = [algo.client_upload(actor.hooks.context(1, s, p), s.params) for s, p in zip(slots, payloads)]
    work: dict = {}
    together = algo.client_upload_group([actor.hooks.context(1, s, p) for s, p in zip(slots, payloads)],
                                        [s.params for s in slots], actor.hooks.tools(slots, work))
    assert work["generated_prompts"] == 8  # the two clients that answer, in one generation
    assert together[1].texts is None and together[1].nbytes == 0 == alone[1].nbytes
    for a, b in ((alone[0], together[0]), (alone[2], together[2])):
        assert b.texts == a.texts and torch.equal(b.tensors["truncated"], a.tensors["truncated"])
    assert alone[0].texts != alone[2].texts  # the clients' adapters do answer differently
