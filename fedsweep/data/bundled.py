"""The bundled dataset: instruction records generated offline from reasoning-gym tasks.

Every task is a domain. Generation is seeded and needs no network; each record keeps
the reasoning-gym entry in ``meta`` so that the task's own scorer grades answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from fedsweep.data.records import DataError, Record
from fedsweep import salts


def cache_dir() -> Path:
    """Where generated records are kept (``$FEDSWEEP_CACHE/data``, default ``~/.cache/fedsweep/data``)."""
    return Path(os.environ.get("FEDSWEEP_CACHE") or Path.home() / ".cache" / "fedsweep") / "data"


def generate(tasks: list[str], examples_per_task: int, seed: int) -> list[Record]:
    """``examples_per_task`` records per task, deterministic in ``seed``.

    Kept on disk after the first time, keyed by the tasks, the count, the seed and reasoning-gym's
    version: importing reasoning-gym alone takes 1.8 s of a run's start-up, generating 0.1 s."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rg_version = version("reasoning-gym")
    except PackageNotFoundError:
        rg_version = "unknown"
    key = hashlib.sha256(json.dumps([list(tasks), examples_per_task, seed, rg_version]).encode()).hexdigest()[:20]
    path = cache_dir() / f"reasoning_gym-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    records = _generate(tasks, examples_per_task, seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    except OSError:
        pass  # a read-only home: generate every time
    return records


def _generate(tasks: list[str], examples_per_task: int, seed: int) -> list[Record]:
    import reasoning_gym

    known = set(reasoning_gym.factory.DATASETS)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise DataError(f"data.tasks: unknown reasoning-gym task(s) {unknown} (e.g. {', '.join(sorted(known)[:8])}, …)")
    records: list[Record] = []
    for i, task in enumerate(tasks):
        ds = reasoning_gym.create_dataset(task, size=examples_per_task, seed=seed * 1000 + i)
        for entry in ds:
            meta = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
            try:
                meta = json.loads(json.dumps(meta))
            except TypeError as exc:
                raise DataError(f"reasoning-gym task {task!r} has metadata that is not JSON: {exc}") from None
            records.append({"prompt": entry["question"], "response": str(entry["answer"]), "task": task,
                            "meta": {"source": "reasoning_gym", "entry": meta}})
    return records


def generate_preferences(tasks: list[str], examples_per_task: int, seed: int) -> list[Record]:
    """Preference pairs: chosen = the correct answer (with the task's worked solution where the
    entry has one), rejected = a wrong answer — another example's answer of the same task that
    the task's scorer grades below 1, else a perturbation of the right one."""
    import numpy as np

    records = generate(tasks, examples_per_task, seed)
    rng = np.random.default_rng([seed, salts.PREFERENCE_PAIRS])
    by_task: dict[str, list[Record]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    out = []
    for r in records:
        pool = by_task[r["task"]]
        rejected = None
        for j in rng.permutation(len(pool))[:8]:
            candidate = pool[j]["response"]
            if candidate != r["response"] and score(r, candidate) < 1.0:
                rejected = candidate
                break
        if rejected is None:
            rejected = _perturb(r["response"])
        meta_md = r["meta"]["entry"].get("metadata", {})
        solution = next((str(meta_md[k]) for k in ("solution", "cot", "explanation") if meta_md.get(k)), None)
        chosen = f"{solution}\nAnswer: {r['response']}" if solution else r["response"]
        out.append({"prompt": r["prompt"], "chosen": chosen, "rejected": rejected, "task": r["task"],
                    "meta": r["meta"]})
    return out


VERIFY = "{question}\nProposed answer: {answer}\nIs the proposed answer correct?"


def generate_verification(tasks: list[str], examples_per_task: int, seed: int,
                          labels: tuple[str, str] = ("no", "yes")) -> list[Record]:
    """Classification records (answer verification, a GLUE-like sentence-pair task built from the
    bundled tasks): each question with a proposed answer — its own (``labels[1]``) or, for a seeded
    half of the records, another record's answer of the same task that the task's scorer grades below 1
    (``labels[0]``; a perturbation of the right one where the task has no such answer)."""
    import numpy as np

    records = generate(tasks, examples_per_task, seed)
    rng = np.random.default_rng([seed, salts.VERIFICATION])
    by_task: dict[str, list[Record]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    wrong = rng.permutation(len(records)) < len(records) // 2
    out = []
    for r, make_wrong in zip(records, wrong):
        answer = r["response"]
        if make_wrong:
            pool = by_task[r["task"]]
            answer = next((pool[j]["response"] for j in rng.permutation(len(pool))[:8]
                           if pool[j]["response"] != r["response"] and score(r, pool[j]["response"]) < 1.0),
                          _perturb(r["response"]))
        label = labels[0] if make_wrong else labels[1]
        out.append({"prompt": VERIFY.format(question=r["prompt"], answer=answer), "label": label, "task": r["task"],
                    "meta": {"source": "verification"}})
    return out


VERBOSE = "Working it out step by step, the answer is {}."


def generate_style_preferences(tasks: list[str], examples_per_task: int, seed: int) -> list[Record]:
    """Style preference pairs: a concise answer (the answer alone) and a verbose one (the same
    answer after a fixed sentence of working), both right; ``chosen`` is the concise one here, and
    :func:`prefer_verbose` turns a record the other way round (a client of the other group)."""
    out = []
    for r in generate(tasks, examples_per_task, seed):
        concise, verbose = r["response"], VERBOSE.format(r["response"])
        out.append({"prompt": r["prompt"], "chosen": concise, "rejected": verbose, "task": r["task"],
                    "meta": r["meta"], "style": "concise"})
    return out


def prefer_verbose(record: Record) -> Record:
    """A style pair preferred the other way: the verbose answer chosen over the concise one."""
    return {**record, "chosen": record["rejected"], "rejected": record["chosen"], "response": record["rejected"],
            "style": "verbose"}


def _perturb(answer: str) -> str:
    try:
        return str(int(answer) + 1)
    except ValueError:
        return answer[::-1] if answer[::-1] != answer else answer + " x"


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


@lru_cache(maxsize=None)
def _rg_scorer(task: str) -> Callable[[str, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def warm_scorers(records: list[Record]) -> None:
    """Load the scorers :func:`score` will use for ``records`` (reasoning-gym's, whose package takes about
    a second to import on 2 CPU cores: it imports every task, and one of them matplotlib), so that the
    first evaluation does not pay for it. Called in a thread of its own beside the first round's
    training (``actors.client``); a scorer that cannot load is left for :func:`score` to meet."""
    for task in sorted({r["task"] for r in records if (r.get("meta") or {}).get("source") == "reasoning_gym"}):
        try:
            _rg_scorer(task)
        except Exception:  # noqa: BLE001  (score() scores what it cannot score as wrong)
            return


def score(record: Record, answer: str) -> float:
    """Task accuracy of ``answer`` for ``record`` in [0, 1].

    reasoning-gym records use the task's own scorer; other records use exact match
    after whitespace and case normalisation.
    """
    meta: dict[str, Any] = record.get("meta") or {}
    if meta.get("source") == "reasoning_gym":
        try:
            return float(_rg_scorer(record["task"])(answer.strip(), meta["entry"]))
        except Exception:  # a scorer that chokes on a malformed answer scores it wrong
            return 0.0
    target = record.get("response", record.get("chosen", ""))
    return float(_normalise(answer) == _normalise(target))
