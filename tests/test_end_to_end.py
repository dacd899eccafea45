"""Real Ray, real MLflow (temporary store), the tiny model: runs, tracking and resumption."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from fedsweep import checkpoint as ckpt
from fedsweep.config import ConfigError, validate
from fedsweep.orchestrator.runner import RunError, run


def _final_state(outcome) -> dict[str, torch.Tensor]:
    """Server state and every client's state in the run's last checkpoint."""
    return _round_state(ckpt.latest(outcome.run_dir / "checkpoints"))


def _round_state(folder) -> dict[str, torch.Tensor]:
    """Server state and every client's state in one round folder (verified against its manifest)."""
    assert ckpt.verify(folder) is None, folder
    out = {f"server/{k}": v for k, v in ckpt.read_tensors(folder / "server.safetensors").items()}
    for f in sorted(folder.glob("client_*.safetensors")):
        out.update({f"{f.stem}/{k}": v for k, v in ckpt.read_tensors(f).items()})
    return out


def test_two_rounds_tracked_in_mlflow(ray_session, smoke_raw, tracking_uri):
    cfg = validate({**smoke_raw, "clients": {**smoke_raw["clients"], "clients_per_actor": "auto"}})
    outcome = run(cfg)
    assert [r["round"] for r in outcome.rounds] == [1, 2]
    client = MlflowClient(tracking_uri)
    mrun = client.get_run(outcome.run_id)
    assert mrun.info.status == "FINISHED"
    assert mrun.data.params["algorithm"] == "fedavg" and mrun.data.params["clients.num_clients"] == "4"
    for key in ("accuracy", "test_loss", "train_loss", "round_seconds", "train_seconds", "aggregation_seconds",
                "bytes_up", "bytes_down", "client/000/accuracy", "client/003/test_loss", "client/002/bytes_up",
                "client/001/bytes_down", "client/000/train_loss"):
        history = client.get_metric_history(outcome.run_id, key)
        assert [m.step for m in history] == [1, 2], key
    # the adapter travels both ways in full for FedAvg: bytes = numel * 4 of the LoRA tensors
    state = ckpt.read_tensors(ckpt.latest(outcome.run_dir / "checkpoints") / "server.safetensors")
    adapter_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if k.startswith("globals/"))
    up = client.get_metric_history(outcome.run_id, "client/002/bytes_up")[0].value
    assert up == adapter_bytes
    artifacts = {a.path for a in client.list_artifacts(outcome.run_id)}
    assert {"config.yaml", "clients.json"} <= artifacts
    # one resolved config (the layout chosen in setup), the same in the run folder and in MLflow
    logged = Path(client.download_artifacts(outcome.run_id, "config.yaml", str(outcome.run_dir / "mlflow_copy")))
    assert logged.read_text() == (outcome.run_dir / "config.yaml").read_text()
    assert "clients_per_actor: auto" not in logged.read_text()
    tags = mrun.data.tags
    assert (tags["method"], tags["variant"], tags["seed"], tags["num_clients"], tags["fedsweep.kind"]) == \
        ("fedavg", "fedavg", str(cfg.seed), "4", "run")
    assert [m.value for m in client.get_metric_history(outcome.run_id, "round")] == [1.0, 2.0]
    exp = client.get_experiment(mrun.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "mlflow.sharedViewState.fedsweep" in exp.tags  # the experiment's first run saves the view


def test_resume_equals_uninterrupted(ray_session, smoke_raw):
    smoke_raw["rounds"] = 3
    smoke_raw["clients"]["fraction"] = 0.75  # sampling differs per round: resume must reproduce it
    smoke_raw["tracking"]["enabled"] = False
    full = run(validate(smoke_raw))
    # the client that sits a round out keeps last round's files (linked, not rewritten)
    assert [r["metrics"]["checkpoint_clients_reused"] for r in full.rounds] == [0.0, 1.0, 1.0]

    smoke_raw["checkpoint"]["dir"] += "-interrupted"
    cfg = validate(smoke_raw)
    with pytest.raises(RunError, match="stopped after round 1"):
        run(cfg, stop_after=1)
    changed = validate({**smoke_raw, "lora": {**smoke_raw["lora"], "r": 8}})
    with pytest.raises(ConfigError, match=r"lora.r: 4 in the run, 8 now"):
        run(changed, resume=True)
    resumed = run(cfg, resume=True)
    assert [r["round"] for r in resumed.rounds] == [2, 3]

    a, b = _final_state(full), _final_state(resumed)
    assert a.keys() == b.keys() and any(k.startswith("server/globals/") for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    assert full.rounds[-1]["sampled"] == resumed.rounds[-1]["sampled"]
    assert full.rounds[-1]["metrics"]["accuracy"] == pytest.approx(resumed.rounds[-1]["metrics"]["accuracy"])


@pytest.fixture(scope="module")
def undisturbed_state(ray_session, tmp_path_factory, tracking_uri):
    import copy

    import yaml

    from tests.conftest import SMOKE

    raw = yaml.safe_load(SMOKE.read_text())
    raw["checkpoint"] = {"dir": str(tmp_path_factory.mktemp("undisturbed") / "runs")}
    raw["tracking"] = {"enabled": False}
    raw["rounds"] = 2
    return copy.deepcopy(raw), _final_state(run(validate(raw)))


def test_checkpoints_on_a_storage_uri_resume_like_local_ones(ray_session, smoke_raw, undisturbed_state, tmp_path):
    """checkpoint.dir as a pyarrow URI (file:// here; s3:// or gs:// on a cluster): no renames,
    rounds sealed by their COMPLETE marker, and a resumed run ends where a local one does."""
    smoke_raw["tracking"]["enabled"] = False
    raw, local = undisturbed_state
    assert smoke_raw["rounds"] == raw["rounds"] == 2
    smoke_raw["checkpoint"]["dir"] = f"file://{tmp_path}/shared"
    smoke_raw["clients"]["clients_per_actor"] = raw["clients"]["clients_per_actor"]  # the same two actors
    cfg = validate(smoke_raw)
    with pytest.raises(RunError, match="stopped after round 1"):
        run(cfg, stop_after=1)
    resumed = run(cfg, resume=True)
    assert [r["round"] for r in resumed.rounds] == [2] and str(resumed.run_dir).startswith("file://")
    on_disk = Path(str(resumed.run_dir).removeprefix("file://"))
    assert (on_disk / "run.json").exists() and not list(on_disk.glob("checkpoints/*.partial"))
    remote_final = {f"server/{k}": v for k, v in ckpt.read_tensors(
        ckpt.latest(on_disk / "checkpoints") / "server.safetensors").items()}
    for key, value in remote_final.items():
        torch.testing.assert_close(value, local[key], rtol=0, atol=1e-6, msg=key)


def test_resume_without_an_earlier_run_is_an_error(ray_session, smoke_raw):
    smoke_raw["tracking"]["enabled"] = False
    with pytest.raises(RunError, match="no earlier run"):
        run(validate(smoke_raw), resume=True)


@pytest.mark.system
def test_a_killed_client_actor_restarts_and_restores_its_clients(ray_session, smoke_raw, undisturbed_state):
    """An actor that dies between rounds is restarted by Ray, reloads the last checkpoint,
    and the run ends exactly where an undisturbed run ends."""
    import ray

    smoke_raw["rounds"] = 2
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["clients"]["clients_per_actor"] = 2  # the second of two actors is killed
    undisturbed = undisturbed_state[1]

    handles = []

    def on_event(kind, data):
        if kind == "actors":
            handles.extend(data)
        elif kind == "round" and data["round"] == 1:
            ray.kill(handles[1], no_restart=False)  # Ray restarts it (max_restarts=1)

    smoke_raw["checkpoint"]["dir"] += "-killed"
    outcome = run(validate(smoke_raw), on_event=on_event)
    assert outcome.rounds[-1]["failures"] == {}
    disturbed = _final_state(outcome)
    for key in undisturbed:
        torch.testing.assert_close(disturbed[key], undisturbed[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("algorithm,hparams", [
    ("local", {}),
    # FedICU with both parts on runs end to end in tests/test_study.py's study
    ("fedicu", {"updating": False}),  # splitting only
    ("fedicu", {"splitting": False, "smooth_mask": True}),  # updating only, smooth mask
])
def test_plugin_runs_two_rounds_end_to_end(ray_session, smoke_raw, tracking_uri, algorithm, hparams):
    smoke_raw["algorithm"] = algorithm
    smoke_raw[algorithm] = hparams
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    assert client.get_run(outcome.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(outcome.run_id, "client/001/accuracy")) == 2
    up = [m.value for m in client.get_metric_history(outcome.run_id, "client/001/bytes_up")]
    if algorithm == "local":
        assert up == [0.0, 0.0]
        # no aggregation: each client evaluates its own adapter, so clients differ
        last = outcome.rounds[-1]["client_metrics"]
        assert len({round(m["test_loss"], 6) for m in last.values()}) == 4
    elif hparams.get("updating") is False:  # dense uploads every round
        assert up[1] == up[0]
    else:  # round 1 uploads everything, round 2 only the masked entries
        assert up[1] < up[0]
        frac = client.get_metric_history(outcome.run_id, "client/001/upload_fraction")
        assert frac[0].value == 1.0 and 0.0 < frac[1].value < 1.0


@pytest.mark.parametrize("variant,objective", [("sp", "dpo"), ("mst", "sft")])
def test_drift_end_to_end_with_artifacts(ray_session, smoke_raw, tracking_uri, variant, objective):
    smoke_raw["algorithm"] = "drift"
    smoke_raw["drift"] = {"variant": variant, "delta": 0.6}
    if objective == "dpo":
        smoke_raw["data"]["kind"] = "preference"
        smoke_raw["train"].update(objective="dpo", dpo_beta=0.2)
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    for rnd in ("round_0001", "round_0002"):
        assert {a.path for a in client.list_artifacts(outcome.run_id, rnd)} == {f"{rnd}/divergence.csv", f"{rnd}/graph.png"}
    assert len(client.get_metric_history(outcome.run_id, "client/002/drift_neighbours")) == 2
    if objective == "dpo":
        for key in ("client/000/dpo_reward_margin", "client/003/dpo_reward_accuracy", "dpo_reward_margin",
                    "dpo_reward_accuracy_client_mean"):
            assert len(client.get_metric_history(outcome.run_id, key)) == 2
    state = ckpt.read_tensors(ckpt.latest(outcome.run_dir / "checkpoints") / "server.safetensors")
    personal = {k.split("/")[0] for k in state if k.startswith("personal.")}
    assert personal == {f"personal.{c}" for c in range(4)}


# FedAdagrad and FedYogi are FedAdam's class (fedopt.ServerOptimizer) with another update rule: the
# rules are checked step by step by hand in tests/test_baselines.py, and one run end to end of the
# class (fedadam: its state buffers checkpointed and tracked) stands for the three
BASELINES = {
    "fedprox": {"fedprox": {"mu": 0.1}},
    "fedavgm": {},
    "fedadam": {"fedadam": {"bias_correction": True}},
    "scaffold": {"train": {"optimizer": "sgd", "learning_rate": 0.05}},
    "fedcda": {},
    "flora": {"lora": {"ranks": [2, 4, 8, 4]}},
    "flexlora": {"lora": {"ranks": [2, 4, 8, 4]}},
    "ffa_lora": {},
    "fedsa_lora": {},
    "centralized": {},
}


@pytest.mark.parametrize("algorithm", sorted(BASELINES))
def test_every_baseline_runs_end_to_end(ray_session, smoke_raw, tracking_uri, algorithm):
    smoke_raw["algorithm"] = algorithm
    for section, values in BASELINES[algorithm].items():
        smoke_raw.setdefault(section, {}).update(values)
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    assert client.get_run(outcome.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(outcome.run_id, "client/003/accuracy")) == 2
    assert len(client.get_metric_history(outcome.run_id, "accuracy")) == 2
    trained = outcome.rounds[-1]["client_metrics"]
    if algorithm == "centralized":
        assert trained[0]["steps"] == 4 * smoke_raw["train"]["steps"] and "steps" not in trained[1]
    else:
        assert all(trained[c]["bytes_up"] > 0 for c in range(4))


def test_fedcofit_runs_with_two_different_client_models(ray_session, smoke_raw, tracking_uri):
    smoke_raw["algorithm"] = "fedcofit"
    smoke_raw["fedcofit"] = {"public_prompts": 4, "max_new_tokens": 6, "eps": 0.3,
                             "dp": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5}}
    smoke_raw["model"]["names"] = ["tiny", "tiny", "tiny@96x3", "tiny@96x3"]  # two architectures
    smoke_raw["lora"]["ranks"] = [2, 4, 4, 8]
    smoke_raw["clients"]["clients_per_actor"] = 2  # one actor per base model
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    assert client.get_run(outcome.run_id).info.status == "FINISHED"
    first, second = outcome.rounds
    # round 1: texts up, nothing down; round 2: the pseudo-labels come down
    for cid in range(4):
        assert first["client_metrics"][cid]["bytes_down"] == 0.0 < first["client_metrics"][cid]["bytes_up"]
        assert second["client_metrics"][cid]["bytes_down"] > 0
    assert {a.path for a in client.list_artifacts(outcome.run_id, "round_0001")} == {"round_0001/pseudo_labels.jsonl"}
    assert len(client.get_metric_history(outcome.run_id, "client/002/accuracy")) == 2
    # the last consensus is trained on (Algorithm 1): one more update after round 2's aggregation
    assert second["metrics"]["final_update_seconds"] > 0
    assert all("final_train_loss" in second["client_metrics"][c] for c in range(4))
    # a random tiny model never stops within 6 tokens: every response is cut, counted, and its
    # pseudo-label is broadcast without an EOS
    assert first["metrics"]["responses_truncated"] == 4 * 4
    # DP-SGD: ε grows over rounds and the final update
    eps = [client.get_metric_history(outcome.run_id, "client/001/dp_epsilon")]
    values = [m.value for m in sorted(eps[0], key=lambda m: m.step)]
    assert len(values) == 2 and 0 < values[0] < values[1]
    with pytest.raises(ConfigError, match="exchanges parameters"):
        validate({**smoke_raw, "algorithm": "fedavg"})


def test_fedreft_end_to_end_with_loss_grid(ray_session, smoke_raw, tracking_uri):
    smoke_raw["algorithm"] = "fedreft"
    smoke_raw["adapter"] = "reft"
    smoke_raw["reft"] = {"rank": 2, "first": 2, "last": 2, "tied": True}
    smoke_raw["fedreft"] = {"alpha_tuning": "loss_grid"}
    smoke_raw["data"]["val_fraction"] = 0.2
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    alphas = client.get_metric_history(outcome.run_id, "client/001/alpha")
    assert [m.step for m in alphas] == [2] and 0.0 <= alphas[0].value <= 1.0  # mixing starts in round 2
    up = client.get_metric_history(outcome.run_id, "client/001/bytes_up")[0].value
    assert up == 2 * (2 * 2 * 64 + 2) * 4
    with pytest.raises(ConfigError, match="works with adapter reft"):
        validate({**smoke_raw, "adapter": "lora"})


def test_an_actor_that_cannot_start_is_one_clear_error(ray_session, smoke_raw):
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["lora"]["target_modules"] = ["q_proj", "not_a_module"]
    with pytest.raises(RunError, match=r"failed to start: .*not_a_module.*not in the model"):
        run(validate(smoke_raw))


# two kills per run, one on each actor (clients 0–1 and 2–3); each actor restarts at most once
@pytest.mark.parametrize("faults", [
    # client 1 dies before training while its sibling 0 has trained this round (that work is replayed);
    # the other actor dies while writing round 1's checkpoint; client 0's training raises in round 1
    # (its actor lives on: it alone is trained again)
    [("train_start", 2, 1), ("save", 1, 2), ("raise", 1, 0)],
    # client 2 trained but its result never came back; the other actor dies while evaluating
    [("train_end", 1, 2), ("evaluate", 2, 0)],
    # round 1's checkpoint is written while round 2 trains (checkpoint.overlap): the actor of clients
    # 2–3 dies once round 2's training has begun, before its round-1 files are on disk; it must write
    # them again (round 1 replayed from θ_0) before round 1 commits, then catch up with round 2
    [("write", 1, 2)],
], ids=["train_start+save", "train_end+evaluate", "write"])
@pytest.mark.system
def test_an_actor_killed_mid_round_loses_nothing(ray_session, undisturbed_state, tmp_path, monkeypatch, faults):
    """Exactly-once rounds: the run ends bitwise where an undisturbed one ends, and says what it recovered."""
    from fedsweep.actors.probe import PROBE_ENV as FAULT_ENV

    raw, undisturbed = undisturbed_state
    undisturbed_dir = raw["checkpoint"]["dir"]
    raw = {**raw, "checkpoint": {"dir": str(tmp_path / "runs")}}
    markers = [tmp_path / f"fired{i}" for i in range(len(faults))]
    monkeypatch.setenv(FAULT_ENV, ";".join(f"{p}:{r}:{c}:{m}" for (p, r, c), m in zip(faults, markers)))
    outcome = run(validate(raw))
    assert all(m.exists() for m in markers)  # the faults really fired
    assert all(r["failures"] == {} for r in outcome.rounds)
    for point, rnd, _ in faults:
        hit = outcome.rounds[rnd if point == "write" else rnd - 1]  # a write fault strikes in the next round
        assert hit["metrics"]["clients_retried"] >= 1 and hit["retried"]
    if any(point == "write" for point, _, _ in faults):  # round 1 committed, its lost files written again
        assert outcome.rounds[0]["metrics"]["checkpoint_deferred"] == 1.0
        first = [_round_state(sorted(Path(raw_dir).glob("*/*/checkpoints/round_0001"))[-1])
                 for raw_dir in (undisturbed_dir, tmp_path / "runs")]
        assert first[0].keys() == first[1].keys()
        for key in first[0]:
            assert torch.equal(first[0][key], first[1][key]), key
    disturbed = _final_state(outcome)
    assert disturbed.keys() == undisturbed.keys()
    alone = any(point == "raise" for point, _, _ in faults)  # its group's clients retried alone
    for key in undisturbed:  # a replay repeats the calls as made: bitwise; a retry alone: up to rounding
        if alone:
            torch.testing.assert_close(disturbed[key], undisturbed[key], rtol=1e-5, atol=1e-7, msg=key)
        else:
            assert torch.equal(disturbed[key], undisturbed[key]), key


def test_a_diverging_client_is_left_out_and_the_round_goes_on(ray_session, undisturbed_state, tmp_path, monkeypatch):
    from fedsweep.actors.probe import PROBE_ENV as FAULT_ENV

    raw, _ = undisturbed_state
    raw = {**raw, "rounds": 1, "checkpoint": {"dir": str(tmp_path / "runs")},
           "clients": {**raw["clients"], "clients_per_actor": 4}}  # one actor: the screen is the server's
    monkeypatch.setenv(FAULT_ENV, f"poison:1:2:{tmp_path / 'fired'}")
    outcome = run(validate(raw))
    first = outcome.rounds[0]
    assert list(first["failures"]) == [2] and "update rejected: norm" in first["failures"][2]
    assert first["metrics"]["clients_rejected"] == 1.0 and first["metrics"]["clients_aggregated"] == 3.0


def test_resume_falls_back_to_the_newest_intact_round(ray_session, undisturbed_state, tmp_path):
    """A damaged newest round (truncated server state, deleted client file) is skipped with a warning
    naming it; the run goes on from the round before and still ends where an uninterrupted run does.
    With no intact round left, resuming stops with one line. The run is the undisturbed one, its
    folder copied elsewhere (a moved run folder resumes under its new ``checkpoint.dir``)."""
    raw, full = undisturbed_state
    shutil.copytree(raw["checkpoint"]["dir"], tmp_path / "runs")
    raw = {**raw, "checkpoint": {"dir": str(tmp_path / "runs")}}
    cfg = validate(raw)
    run_dir = sorted((tmp_path / "runs" / cfg.name).iterdir())[-1] / "checkpoints"
    server = run_dir / "round_0002" / "server.safetensors"
    server.write_bytes(server.read_bytes()[:-16])
    (run_dir / "round_0002" / "client_00001.safetensors").unlink()
    warnings = []
    resumed = run(cfg, resume=True, on_event=lambda k, d: warnings.append(d) if k == "warning" else None)
    assert len(warnings) == 1 and "round_0002" in warnings[0] and "round_0001" in warnings[0]
    assert [r["round"] for r in resumed.rounds] == [2]
    got = _final_state(resumed)
    for key in full:
        assert torch.equal(got[key], full[key]), key
    # every round damaged: one line, no traceback
    for folder in run_dir.glob("round_*"):
        (folder / "MANIFEST.json").unlink()
    with pytest.raises(RunError, match="no intact checkpoint round") as err:
        run(cfg, resume=True)
    assert "\n" not in str(err.value)


@pytest.mark.system
def test_a_resumed_run_survives_an_actor_restart_after_its_resume_round_is_pruned(ray_session, smoke_raw, tmp_path):
    """Faults in sequence: the run is stopped after round 1 and resumed; by round 3 pruning
    (``checkpoint.keep: 1``) has removed round 1, the folder the actors were built from; an actor
    killed then is restarted by Ray with those same constructor arguments. It must come back from the
    newest committed round (the one rule: the server restores every restarted incarnation), and the
    run end bitwise where an undisturbed one ends."""
    import ray

    smoke_raw.update(rounds=4)
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "undisturbed"), "keep": 1}
    smoke_raw["clients"]["clients_per_actor"] = 2
    undisturbed = _final_state(run(validate(smoke_raw)))

    smoke_raw["checkpoint"]["dir"] = str(tmp_path / "disturbed")
    cfg = validate(smoke_raw)
    with pytest.raises(RunError, match="stopped after round 1"):
        run(cfg, stop_after=1)
    handles, killed = [], []

    def on_event(kind, data):
        if kind == "actors":
            handles.extend(data)
        elif kind == "round" and data["round"] == 3:
            ckpts = sorted((tmp_path / "disturbed").glob("*/*/checkpoints/round_*"))
            killed.append([p.name for p in ckpts])
            ray.kill(handles[1], no_restart=False)  # Ray restarts it (max_restarts=1)

    resumed = run(cfg, resume=True, on_event=on_event)
    assert killed and "round_0001" not in killed[0]  # the round it was built from was gone
    assert [r["round"] for r in resumed.rounds] == [2, 3, 4] and all(r["failures"] == {} for r in resumed.rounds)
    disturbed = _final_state(resumed)
    assert disturbed.keys() == undisturbed.keys()
    for key in undisturbed:
        assert torch.equal(disturbed[key], undisturbed[key]), key


@pytest.mark.system
def test_a_server_actor_killed_inside_a_round_is_replaced_and_the_run_ends_bitwise(
        ray_session, smoke_raw, tmp_path, monkeypatch, tracking_uri):
    """The server actor's process dies in round 3 of 4, its clients trained and nothing aggregated:
    the driver starts a new one from the newest committed round, brings the client actors back to it,
    runs the rounds after it again, and the run ends bitwise where an undisturbed one ends — one
    FINISHED MLflow run with every round's metrics once and the replacement counted."""
    from mlflow.tracking import MlflowClient as Client

    from fedsweep.actors.probe import PROBE_ENV as FAULT_ENV

    smoke_raw.update(rounds=4)
    smoke_raw["tracking"] = {"uri": tracking_uri, "experiment": "server-replaced"}
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "undisturbed")}
    undisturbed = _final_state(run(validate({**smoke_raw, "tracking": {"enabled": False}})))
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "disturbed")}
    marker = tmp_path / "fired"
    monkeypatch.setenv(FAULT_ENV, f"server:3:0:{marker}")
    warnings = []
    outcome = run(validate(smoke_raw), on_event=lambda kind, data: warnings.append(data) if kind == "warning" else None)
    assert marker.exists() and any("server actor died in round 3" in w for w in warnings)
    (replaced,) = outcome.server_replacements
    assert replaced["died_in_round"] == 3 and replaced["restored_round"] in (1, 2)
    assert [r["round"] for r in outcome.rounds] == [1, 2, 3, 4]
    disturbed = _final_state(outcome)
    assert disturbed.keys() == undisturbed.keys()
    for key in undisturbed:
        assert torch.equal(disturbed[key], undisturbed[key]), key
    client = Client(tracking_uri)
    mlrun = client.get_run(outcome.run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.metrics["server_replacements"] == 1.0
    assert [m.step for m in client.get_metric_history(outcome.run_id, "train_loss")] == [1, 2, 3, 4]


@pytest.mark.system
def test_a_server_actor_that_cannot_be_replaced_stops_with_the_round_kept(ray_session, smoke_raw, tmp_path, monkeypatch):
    """``server.max_replacements: 0``: the run stops in one line naming the round kept and --resume;
    resuming finishes it."""
    from fedsweep.actors.probe import PROBE_ENV as FAULT_ENV

    smoke_raw.update(rounds=3)
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["server"] = {"max_replacements": 0}
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "runs"), "overlap": False}
    monkeypatch.setenv(FAULT_ENV, f"server:3:0:{tmp_path / 'fired'}")
    cfg = validate(smoke_raw)
    with pytest.raises(RunError) as err:
        run(cfg)
    message = str(err.value)
    assert "server actor died in round 3" in message and "round 2 is kept" in message and "--resume" in message
    assert "\n" not in message
    resumed = run(cfg, resume=True)
    assert [r["round"] for r in resumed.rounds] == [3]


@pytest.mark.system
def test_a_server_killed_while_a_client_actor_restarts_is_replaced(ray_session, smoke_raw, tmp_path, undisturbed_state):
    """Compound: a client actor and the server actor killed at the same moment. The new server's
    keeper finds the client actor still restarting and waits for it before bringing it back to the
    committed round; the run ends bitwise where an undisturbed one ends (found by
    ``fedsweep bench faults``: the keeper gave up on an actor Ray was restarting)."""
    import ray

    raw, undisturbed = undisturbed_state
    raw = {**raw, "checkpoint": {"dir": str(tmp_path / "runs")}}
    handles, server, fired = [], [], []

    def on_event(kind, data):
        if kind == "actors":
            handles.extend(data)
        elif kind == "server":
            server.append(data)
        elif kind in ("progress", "round") and not fired and (kind == "round" and data["round"] == 1):
            fired.append(True)
            ray.kill(handles[-1], no_restart=False)
            ray.kill(server[-1], no_restart=False)

    outcome = run(validate(raw), on_event=on_event)
    assert fired and len(outcome.server_replacements) == 1 and len(server) == 2
    disturbed = _final_state(outcome)
    for key in undisturbed:
        assert torch.equal(disturbed[key], undisturbed[key]), key


@pytest.mark.system
def test_a_client_actor_with_its_data_in_the_object_store_restarts(ray_session, smoke_raw, tmp_path):
    """Ray puts a large constructor argument (an actor's clients' data) in the object store; a restart
    needs it again. The driver owns those arguments for the run, so an actor killed after the first
    construction comes back (before: the restart failed with ReferenceCountingAssertionError, the
    argument freed once the first construction ran)."""
    import pickle

    import ray

    smoke_raw.update(rounds=2)
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["data"]["examples_per_task"] = 400
    smoke_raw["eval"]["max_new_tokens"] = 0
    smoke_raw["clients"]["clients_per_actor"] = 2  # the second of two actors is killed
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "runs")}
    handles = []

    def on_event(kind, data):
        if kind == "actors":
            handles.extend(data)
        elif kind == "round" and data["round"] == 1:
            ray.kill(handles[1], no_restart=False)

    cfg = validate(smoke_raw)
    from fedsweep.orchestrator.experiment_data import prepare_data

    clients, _, _ = prepare_data(cfg)
    hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val} for c in clients[2:]]
    assert len(pickle.dumps(hosted)) > 100 * 1024  # Ray's limit for an argument passed inline
    outcome = run(cfg, on_event=on_event)
    assert [r["round"] for r in outcome.rounds] == [1, 2] and outcome.rounds[-1]["failures"] == {}
