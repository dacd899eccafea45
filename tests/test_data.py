"""Records, the bundled reasoning-gym data, and the partitioners."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsweep.data import bundled
from fedsweep.data.partition import make_clients, partition, split_holdout, task_labels
from fedsweep.data.records import DataError, load_hf, load_jsonl
from fedsweep.errors import ConfigError

TASKS = ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"]


@pytest.fixture(scope="module")
def records():
    return bundled.generate(TASKS, 50, seed=0)


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: missing field 'response'"):
        load_jsonl(path)


def test_jsonl_bad_json_and_preference_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "task": "t"}\n{oops\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid JSON"):
        load_jsonl(path, "preference")
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "task": "t"}\n')
    assert load_jsonl(path, "preference") == [{"prompt": "a", "chosen": "b", "rejected": "c", "task": "t"}]
    with pytest.raises(DataError, match="not found"):
        load_jsonl(tmp_path / "none.jsonl")


def test_hf_dataset_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "p", "response": "r", "task": "t"}]).save_to_disk(str(tmp_path / "ds"))
    assert load_hf(str(tmp_path / "ds"))[0]["response"] == "r"
    datasets.Dataset.from_list([{"prompt": "p"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="row 0: missing field 'response'"):
        load_hf(str(tmp_path / "bad"))


def test_dataset_columns_map_to_record_fields(tmp_path):
    """A Dolly-shaped dataset: instruction + context become the prompt, category the task."""
    datasets = pytest.importorskip("datasets")
    rows = [{"instruction": "Summarise.", "context": "Some text.", "response": "Short.", "category": "summarization"},
            {"instruction": "Name a colour.", "context": "", "response": "Red.", "category": "brainstorming"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "dolly"))
    cols = {"prompt": ["instruction", "context"], "task": "category"}
    recs = load_hf(str(tmp_path / "dolly"), columns=cols)
    assert recs[0] == {"prompt": "Summarise.\n\nSome text.", "response": "Short.", "task": "summarization"}
    assert recs[1]["prompt"] == "Name a colour." and recs[1]["task"] == "brainstorming"  # empty context skipped
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    assert load_jsonl(path, columns=cols)[0]["prompt"] == "Summarise.\n\nSome text."
    with pytest.raises(DataError, match=r"d\.jsonl:1: data.columns.prompt names 'question', not a column"):
        load_jsonl(path, columns={"prompt": "question"})


def test_bundled_records_are_deterministic_and_scored_by_the_task(records):
    assert records == bundled.generate(TASKS, 50, seed=0)
    assert records != bundled.generate(TASKS, 50, seed=1)
    assert {r["task"] for r in records} == set(TASKS)
    json.dumps(records)  # plain data: travels to actors without custom pickling
    for r in records[::25]:
        assert bundled.score(r, r["response"]) == 1.0
        assert bundled.score(r, r["response"] + "9x") < 1.0
    arith = next(r for r in records if r["task"] == "basic_arithmetic")
    assert bundled.score(arith, str(int(arith["response"]) + 1)) == 0.0


def test_unknown_task_is_a_clear_error():
    with pytest.raises(DataError, match="unknown reasoning-gym task"):
        bundled.generate(["no_such_task"], 4, 0)


def test_holdout_is_stratified_and_disjoint(records):
    rest, hold = split_holdout(records, 0.2, np.random.default_rng(0))
    assert len(rest) + len(hold) == len(records)
    assert {r["prompt"] + r["task"] for r in rest}.isdisjoint({r["prompt"] + r["task"] for r in hold})
    per_task = {t: sum(r["task"] == t for r in hold) for t in TASKS}
    assert set(per_task.values()) == {10}


def test_task_split_gives_each_client_exactly_one_task(records):
    clients = make_clients(records, "task", 8, seed=0, test_fraction=0.2)
    assert all(len(c.tasks) == 1 for c in clients)
    assert all({r["task"] for r in c.train + c.test} == set(c.tasks) for c in clients)
    assert sorted(c.tasks[0] for c in clients) == sorted(TASKS * 2)
    # every record goes to exactly one client, in train or in test
    seen = [r["prompt"] for c in clients for r in c.train + c.test]
    assert sorted(seen) == sorted(r["prompt"] for r in records)


def test_mixed_task_split(records):
    clients = make_clients(records, "mixed_task", 4, seed=0, test_fraction=0.2, tasks_per_client=2)
    assert all(len(c.tasks) == 2 for c in clients)


def _task_shares(records, shares):
    names, labels = task_labels(records)
    return np.array([np.bincount(labels[s], minlength=len(names)) / max(len(s), 1) for s in shares])


def test_dirichlet_skew_follows_beta(records):
    many = records * 4  # 800 records, 4 labels
    skewed = _task_shares(many, partition(many, "dirichlet", 10, seed=0, beta=0.1))
    uniform = _task_shares(many, partition(many, "dirichlet", 10, seed=0, beta=100.0))
    # β = 0.1: most clients are dominated by one task; β = 100: every client is near 1/4 per task
    assert skewed.max(axis=1).mean() > 0.7
    assert np.abs(uniform - 0.25).max() < 0.15
    assert uniform.max(axis=1).mean() < 0.35


def test_iid_shares_are_balanced_and_cover_everything(records):
    shares = partition(records, "iid", 7, seed=3)
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate(shares).tolist()) == list(range(len(records)))


def test_partition_is_deterministic_in_the_seed(records):
    a = partition(records, "dirichlet", 5, seed=1, beta=0.5)
    b = partition(records, "dirichlet", 5, seed=1, beta=0.5)
    c = partition(records, "dirichlet", 5, seed=2, beta=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_holdout_is_withheld_only_from_methods_that_use_the_pool():
    """pFedGPT's protocol (App. E.1): other methods train on the original data; the test splits are
    the same for every method; each returned record goes to a client holding its task."""
    from fedsweep.config import validate
    from fedsweep.orchestrator.runner import prepare_data

    raw = {"name": "h", "algorithm": "fedavg", "data": {"tasks": ["basic_arithmetic", "gcd", "chain_sum"],
                                                       "examples_per_task": 20, "holdout_fraction": 0.2},
           "partition": {"scheme": "dirichlet", "dirichlet_beta": 0.5}, "clients": {"num_clients": 3}}
    key = lambda r: (r["prompt"], r["response"])  # noqa: E731
    fed, hold, _ = prepare_data(validate(raw))
    pf, hold2, _ = prepare_data(validate({**raw, "algorithm": "pfedgpt"}))
    strict, _, _ = prepare_data(validate({**raw, "data": {**raw["data"], "holdout_for": "all"}}))
    assert [key(r) for r in hold] == [key(r) for r in hold2] and len(hold) == 12
    held = {key(r) for r in hold}
    fed_train = [key(r) for c in fed for r in c.train]
    assert held <= set(fed_train) and len(fed_train) == len(set(fed_train))  # each returned exactly once
    assert not held & {key(r) for c in pf for r in c.train}
    assert not held & {key(r) for c in strict for r in c.train}
    for a, b, s in zip(fed, pf, strict):
        assert [key(r) for r in a.test] == [key(r) for r in b.test] == [key(r) for r in s.test]
        assert [key(r) for r in b.train] == [key(r) for r in s.train]
        returned = [r for r in a.train if key(r) in held]
        own_tasks = {r["task"] for r in b.train}
        assert all(r["task"] in own_tasks for r in returned)


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "a", "response": "\xff\xfe"}\n', "not UTF-8"),
    (b'{"prompt": "caf\xe9", "response": "b"}\n', "not UTF-8"),
    (b'{"prompt": "a", "response": "b", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", "nested deeper"),
    (b'{"prompt": "a", "response": "b", "meta": ' + b'{"x": ' * 40 + b"1" + b"}" * 40 + b"}\n", "nested deeper"),
    (b'{"prompt": "' + b"x" * 30000 + b'", "response": "b"}\n', "over data.max_record_bytes"),
], ids=["invalid-byte", "latin-1", "deep-arrays", "deep-objects", "oversized"])
def test_bad_jsonl_lines_fail_in_one_line_naming_file_and_line(tmp_path, content, message):
    from fedsweep.data.records import DataError, load_jsonl

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok", "response": "fine"}\n' + content)
    with pytest.raises(DataError) as err:
        load_jsonl(path, max_record_bytes=20_000)
    text = str(err.value)
    assert message in text and f"{path}:2" in text and "\n" not in text


def test_conflicting_style_preferences_split_the_clients_into_two_groups():
    """data.preferences: conflicting_styles: the same prompts as the bundled data, the concise answer
    against a verbose one (both right); even-numbered clients prefer the concise one, odd ones the
    verbose one, in every split, and SFT/test loss use the preferred answer."""
    from fedsweep.config import validate
    from fedsweep.data import bundled
    from fedsweep.orchestrator.experiment_data import prepare_data

    raw = {"name": "p", "data": {"kind": "preference", "preferences": "conflicting_styles",
                                 "tasks": ["basic_arithmetic", "gcd"], "examples_per_task": 12},
           "partition": {"scheme": "iid"}, "clients": {"num_clients": 4}}
    clients, _, _ = prepare_data(validate(raw))
    plain = {r["prompt"]: r["response"] for r in bundled.generate(["basic_arithmetic", "gcd"], 12, 0)}
    for c in clients:
        for r in c.train + c.test:
            answer = plain[r["prompt"]]
            concise, verbose = answer, bundled.VERBOSE.format(answer)
            want = (verbose, concise) if c.cid % 2 else (concise, verbose)
            assert (r["chosen"], r["rejected"]) == want and r["response"] == r["chosen"]
    with pytest.raises(ConfigError, match="data.preferences"):
        validate({"name": "p", "data": {"preferences": "conflicting_styles"}})


def test_a_public_set_for_every_method_keeps_the_clients_data_identical():
    """data.public_prompts: N records are drawn out for every method; FedCoFiT takes its M ≤ N public
    prompts from them and FedAvg leaves them unused, so both methods' clients hold the same records;
    asking more than the set holds is refused in one line."""
    from fedsweep.config import validate
    from fedsweep.orchestrator.experiment_data import prepare_data

    base = {"name": "p", "data": {"tasks": ["basic_arithmetic", "gcd"], "examples_per_task": 24, "public_prompts": 8},
            "partition": {"scheme": "task"}, "clients": {"num_clients": 2}}
    fedavg, _, none = prepare_data(validate(base))
    cofit, _, public = prepare_data(validate({**base, "algorithm": "fedcofit", "fedcofit": {"public_prompts": 5}}))
    few, _, public3 = prepare_data(validate({**base, "algorithm": "fedcofit", "fedcofit": {"public_prompts": 3}}))
    assert none == [] and len(public) == 5 and len(public3) == 3
    assert {r["prompt"] for r in public3} <= {r["prompt"] for r in public}
    for a, b, c in zip(fedavg, cofit, few):
        assert a.train == b.train == c.train and a.test == b.test == c.test
    seen = {r["prompt"] for c in fedavg for r in c.train + c.test}
    assert not seen & {r["prompt"] for r in public}
    with pytest.raises(ConfigError, match="public set") as err:
        prepare_data(validate({**base, "algorithm": "fedcofit", "fedcofit": {"public_prompts": 9}}))
    assert "\n" not in str(err.value)
