"""The bundled dataset: instruction records generated offline from reasoning-gym tasks.

Every task is a domain. Generation is seeded and needs no network; each record keeps
the reasoning-gym entry in ``meta`` so that the task's own scorer grades answers.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Callable

from fedsweep.data.records import DataError, Record


def generate(tasks: list[str], examples_per_task: int, seed: int) -> list[Record]:
    """``examples_per_task`` records per task, deterministic in ``seed``."""
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


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


@lru_cache(maxsize=None)
def _rg_scorer(task: str) -> Callable[[str, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


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
