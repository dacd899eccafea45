"""The tracking outbox's own failures and its start without a server (``orchestrator/tracking/outbox.py``,
``tracker.py``, ``courier.py``): a run opened while the server is away gets its id when the server
answers and every write lands in it; an unreadable record is set aside; a live outbox is locked; a sync
to another store is refused; a refused record is not counted as sent; no URI keeps its credentials."""

from __future__ import annotations

import json
import os
import stat

import pytest


class Switchable:
    """An MLflow client of a real sqlite store whose server can be 'away' (every call a connection error)."""

    def __init__(self, uri: str):
        from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

        self.real, self.away = MlflowClient(uri), False

    def __getattr__(self, name):
        method = getattr(self.real, name)

        def call(*args, **kw):
            if self.away:
                raise ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/create")
            return method(*args, **kw)

        return call


@pytest.fixture
def store(tmp_path):
    from fedsweep.orchestrator.tracking.tracker import prepare_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_store(uri)
    return uri


def _tracker(uri, folder, client, **kw):
    """A Tracker whose outbox and opening use ``client`` (the server that may be away)."""
    from fedsweep.orchestrator.tracking import tracker as tracking

    real = tracking.MlflowClient
    tracking.MlflowClient = lambda tracking_uri: client  # (the Tracker's own client, for the opening)
    try:
        t = tracking.Tracker(uri, "exp", run_name="r", folder=folder, **kw)
    finally:
        tracking.MlflowClient = real
    t.outbox.close()  # (the test delivers by hand: deliver_one with its client)
    return t


def test_a_run_opened_while_the_server_is_away_gets_its_id_later_and_every_write_lands_in_it(store, tmp_path):
    client = Switchable(store)
    client.away = True
    opened = []
    t = _tracker(store, tmp_path / "box", client, tags={"fedsweep.run_dir": "/x/run"}, on_open=opened.append)
    assert t.run_id is None  # the opening waits with the writes
    t.outbox.on_open = opened.append
    t.log_params({"lr": "0.1"})
    t.log_metrics({"loss": 1.5}, step=1, timestamp=1000)
    t.outbox.status(t._run(), "FINISHED")
    pending = [json.loads(p.read_text()) for p in sorted((tmp_path / "box").glob("0*.json"))]
    assert [op["op"] for op in pending] == ["open", "batch", "batch", "status"]
    assert {op.get("run") for op in pending[1:]} == {"@run"}
    assert not t.outbox.deliver_one(client) and t.outbox.waiting() == 4  # still away: nothing lost
    client.away = False
    while t.outbox.waiting():
        assert t.outbox.deliver_one(client)
    run_id = t.outbox.run_id
    assert opened == [run_id] and (tmp_path / "box" / "run_id").read_text() == run_id
    got = client.real.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.params == {"lr": "0.1"}
    assert got.data.tags["fedsweep.run_dir"] == "/x/run"
    assert [(m.step, m.value) for m in client.real.get_metric_history(run_id, "loss")] == [(1, 1.5)]
    assert len(client.real.search_runs([got.info.experiment_id])) == 1


def test_a_second_driver_on_the_folder_reuses_the_waiting_opening_or_the_run_it_made(store, tmp_path):
    """A driver killed while its opening waited: the resumed one queues no second opening; once the
    server made the run, a third finds its id in the folder (one run in all)."""
    client = Switchable(store)
    client.away = True
    first = _tracker(store, tmp_path / "box", client)
    again = _tracker(store, tmp_path / "box", client)
    ops = [json.loads(p.read_text())["op"] for p in sorted((tmp_path / "box").glob("0*.json"))]
    assert ops == ["open"] and first.run_id is None and again.run_id is None
    client.away = False
    third = _tracker(store, tmp_path / "box", client)
    assert third.run_id is not None
    exp = client.real.get_experiment_by_name("exp").experiment_id
    assert [r.info.run_id for r in client.real.search_runs([exp])] == [third.run_id]


def test_an_unreadable_record_is_set_aside_and_the_next_is_sent(store, tmp_path):
    from fedsweep.orchestrator.tracking.outbox import Outbox

    client = Switchable(store)
    run = client.real.create_run(client.real.create_experiment("e")).info.run_id
    said = []
    box = Outbox(store, tmp_path / "box", said.append, start=False)
    box.batch(run, metrics=[("loss", 1.0, 5, 1)])
    box.batch(run, metrics=[("loss", 2.0, 6, 2)])
    (tmp_path / "box" / "00000001.json").write_text('{"op": "batch", "run"')  # cut short (a full disk)
    while box.waiting():
        assert box.deliver_one(client)
    assert [m.step for m in client.real.get_metric_history(run, "loss")] == [2]
    assert (tmp_path / "box" / "00000001.unreadable").exists() and "cannot be read" in said[0]
    box.close()


def test_a_live_outbox_is_locked_and_sync_leaves_it_to_its_run(store, tmp_path):
    from fedsweep.orchestrator.tracking.outbox import Outbox, OutboxBusy, sync

    client = Switchable(store)
    run = client.real.create_run(client.real.create_experiment("e")).info.run_id
    live = Outbox(store, tmp_path / "a" / "tracking-outbox", start=False)
    live.batch(run, metrics=[("loss", 1.0, 5, 1)])
    with pytest.raises(OutboxBusy):
        Outbox(store, tmp_path / "a" / "tracking-outbox", start=False)
    said = []
    got = sync(tmp_path, said.append, wait_s=5)
    assert got["busy"] == 1 and got["sent"] == 0 and live.waiting() == 1
    live.close()
    got = sync(tmp_path, said.append, wait_s=5)
    assert got["sent"] == 1 and [m.value for m in client.real.get_metric_history(run, "loss")] == [1.0]


def test_sync_refuses_another_store_and_counts_refused_records_apart(store, tmp_path):
    from fedsweep.orchestrator.tracking.outbox import Outbox, sync

    client = Switchable(store)
    run = client.real.create_run(client.real.create_experiment("e")).info.run_id
    box = Outbox(store, tmp_path / "r" / "tracking-outbox", start=False)
    box.batch(run, metrics=[("loss", 1.0, 5, 1)])
    box.batch("no-such-run", metrics=[("loss", 1.0, 5, 1)])
    box.close()
    said = []
    other = f"sqlite:///{tmp_path / 'other.db'}"
    got = sync(tmp_path, said.append, wait_s=5, uri=other)
    assert got["other_store"] == 1 and got["sent"] == 0 and store in said[0] and other in said[0]
    got = sync(tmp_path, said.append, wait_s=5)
    assert got["sent"] == 1 and got["refused"] == 1
    assert len(list((tmp_path / "r" / "tracking-outbox").glob("*.refused.json"))) == 1


def test_an_outbox_keeps_no_credentials_and_is_its_users_alone(tmp_path):
    from fedsweep.orchestrator.tracking.outbox import Outbox

    said = []
    box = Outbox("https://alice:t0ken@mlflow.example:5000", tmp_path / "box", said.append, start=False)
    box.batch("r", metrics=[("loss", 1.0, 5, 1)])
    assert box.store() == "https://mlflow.example:5000"
    box.say(f"tracking server {box.uri} does not answer")
    assert "t0ken" not in said[0] and "alice" not in said[0]
    for path in (tmp_path / "box").iterdir():
        assert "t0ken" not in path.read_text(errors="replace"), path
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, (path, oct(mode))
    assert stat.S_IMODE(os.stat(tmp_path / "box").st_mode) == 0o700
    box.close()


def test_the_courier_sends_what_ended_trials_left_and_counts_what_waits(store, tmp_path):
    from fedsweep.orchestrator.tracking.courier import Courier
    from fedsweep.orchestrator.tracking.outbox import Outbox

    client = Switchable(store)
    run = client.real.create_run(client.real.create_experiment("e")).info.run_id
    for trial in ("t1", "t2"):
        box = Outbox(store, tmp_path / "trials" / trial / "tracking-outbox", start=False)
        box.batch(run, metrics=[(f"loss_{trial}", 1.0, 5, 1)])
        box.close()
    live = Outbox(store, tmp_path / "trials" / "t3" / "tracking-outbox", start=False)  # a trial still running
    live.batch(run, metrics=[("loss_t3", 1.0, 5, 1)])
    counts = []
    courier = Courier(tmp_path / "trials", store, lambda n, away: counts.append((n, away)), client=client)
    client.away = True
    assert courier.deliver() == 3 and counts[-1] == (3, True)
    client.away = False
    assert courier.deliver() == 1 and counts[-1] == (1, False)  # the live one's is its own to send
    assert {k for k in client.real.get_run(run).data.metrics} == {"loss_t1", "loss_t2"}
    live.close()
    assert courier.finish(5.0) == 0
    assert "loss_t3" in client.real.get_run(run).data.metrics


def test_persisted_configs_and_printed_lines_carry_no_credentials(capsys):
    from fedsweep.orchestrator.terminal import console, err
    from fedsweep.storage import redacted, without_userinfo

    assert without_userinfo("at https://u:p@h:1/x and s3://k:s@b/p") == "at https://h:1/x and s3://b/p"
    assert without_userinfo("sqlite:////tmp/a@b/m.db") == "sqlite:////tmp/a@b/m.db"  # a path, not userinfo
    assert redacted({"tracking": {"uri": "http://u:p@h"}, "n": [1, "https://x:y@z"]}) == \
        {"tracking": {"uri": "http://h"}, "n": [1, "https://z"]}
    console.print("MLflow at https://bob:s3cret@mlflow.example/")
    err.print("error: http://bob:s3cret@host:1")
    out = capsys.readouterr()
    assert "s3cret" not in out.out + out.err and "https://mlflow.example/" in out.out


def test_kept_actor_inputs_round_trip_and_are_private(tmp_path):
    from fedsweep.actors.inputs import Kept, keep, loaded

    value = [{"cid": 3, "train": [{"prompt": "a", "response": "b"}], "test": [], "val": None}]
    kept = keep(tmp_path / "inputs", "actor_000.pkl", value)
    assert isinstance(kept, Kept) and len(__import__("pickle").dumps(kept)) < 400  # a path, not the data
    assert loaded(kept) == value and loaded(value) is value
    assert stat.S_IMODE(os.stat(kept.path).st_mode) & 0o077 == 0
