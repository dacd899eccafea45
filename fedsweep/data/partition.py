"""Splitting records across federated clients.

Schemes (``partition.scheme``):

* ``iid``        — a random permutation cut into K near-equal shares;
* ``dirichlet``  — per task label c, client shares p_c ~ Dir(β·1_K) (Hsu et al. 2019);
                   small β skews each client toward few tasks, large β is near IID;
* ``task``       — one task per client, as in the papers' task-specific settings
                   (client k gets task k mod T; a task's records are split among its clients);
* ``mixed_task`` — each client gets ``tasks_per_client`` consecutive tasks (cyclically).

A held-out pool (stratified by task) is removed first, and every client's share is
then split into a train and a test part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsweep.data.records import DataError, Record
from fedsweep import salts


@dataclass
class ClientData:
    cid: int
    train: list[Record]
    test: list[Record]
    tasks: list[str] = field(default_factory=list)
    val: list[Record] = field(default_factory=list)


def task_labels(records: list[Record]) -> tuple[list[str], np.ndarray]:
    names = sorted({r.get("task", "default") for r in records})
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[r.get("task", "default")] for r in records], dtype=np.int64)


def split_holdout(records: list[Record], fraction: float, rng: np.random.Generator) -> tuple[list[Record], list[Record]]:
    """(rest, holdout): ``fraction`` of each task's records go to the held-out pool."""
    if fraction <= 0:
        return list(records), []
    _, labels = task_labels(records)
    hold = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        hold.extend(idx[: int(round(fraction * len(idx)))].tolist())
    held = set(hold)
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(hold)]


def iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(s) for s in np.array_split(rng.permutation(n), num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, beta: float, rng: np.random.Generator,
              min_examples: int = 1, max_tries: int = 1000) -> list[np.ndarray]:
    """Per-label Dirichlet(β) allocation, re-drawn until every client has ``min_examples``."""
    if len(labels) < num_clients * min_examples:
        raise DataError(f"{len(labels)} records cannot give {num_clients} clients {min_examples} each")
    for _ in range(max_tries):
        shares: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(num_clients, beta))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for k, part in enumerate(np.split(idx, cuts)):
                shares[k].extend(part.tolist())
        if min(len(s) for s in shares) >= min_examples:
            return [np.sort(np.array(s, dtype=np.int64)) for s in shares]
    raise DataError(
        f"partition.dirichlet_beta={beta}: no draw in {max_tries} gave every one of {num_clients} clients "
        f"{min_examples} examples; raise dirichlet_beta or the data size, or lower partition.min_examples"
    )


def by_task(labels: np.ndarray, num_clients: int, tasks_per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Client k holds tasks (k + j) mod T, j < tasks_per_client; each task split among its holders."""
    num_tasks = int(labels.max()) + 1
    holders: dict[int, list[int]] = {t: [] for t in range(num_tasks)}
    for k in range(num_clients):
        for j in range(tasks_per_client):
            holders[(k + j) % num_tasks].append(k)
    shares: list[list[int]] = [[] for _ in range(num_clients)]
    for t, ks in holders.items():
        if not ks:
            continue
        idx = rng.permutation(np.flatnonzero(labels == t))
        for k, part in zip(ks, np.array_split(idx, len(ks))):
            shares[k].extend(part.tolist())
    return [np.sort(np.array(s, dtype=np.int64)) for s in shares]


def partition(records: list[Record], scheme: str, num_clients: int, *, seed: int, beta: float = 0.5,
              tasks_per_client: int = 2, min_examples: int = 1) -> list[np.ndarray]:
    """Indices of ``records`` held by each client."""
    rng = np.random.default_rng([seed, salts.PARTITION])
    _, labels = task_labels(records)
    if scheme == "iid":
        shares = iid(len(records), num_clients, rng)
    elif scheme == "dirichlet":
        shares = dirichlet(labels, num_clients, beta, rng, min_examples)
    elif scheme == "task":
        shares = by_task(labels, num_clients, 1, rng)
    elif scheme == "mixed_task":
        shares = by_task(labels, num_clients, tasks_per_client, rng)
    else:
        raise DataError(f"partition.scheme = {scheme!r}: allowed iid, dirichlet, task, mixed_task")
    small = [k for k, s in enumerate(shares) if len(s) < min_examples]
    if small:
        raise DataError(f"clients {small} got fewer than {min_examples} records; use fewer clients or more data")
    return shares


def make_clients(records: list[Record], scheme: str, num_clients: int, *, seed: int, test_fraction: float,
                 beta: float = 0.5, tasks_per_client: int = 2, min_examples: int = 2,
                 val_fraction: float = 0.0) -> list[ClientData]:
    """Partition, then split each client's share into train and test (at least one of each), and
    ``val_fraction`` of the training part into a local validation split (at least one record
    when ``val_fraction`` > 0 and the training part has two)."""
    shares = partition(records, scheme, num_clients, seed=seed, beta=beta,
                       tasks_per_client=tasks_per_client, min_examples=min_examples)
    out = []
    for k, idx in enumerate(shares):
        rng = np.random.default_rng([seed, salts.TRAIN_TEST_SPLIT, k])
        idx = rng.permutation(idx)
        n_test = min(max(1, int(round(test_fraction * len(idx)))), len(idx) - 1)
        recs = [records[i] for i in idx]
        train = recs[n_test:]
        n_val = min(max(1, int(round(val_fraction * len(train)))), len(train) - 1) if val_fraction else 0
        out.append(ClientData(cid=k, train=train[n_val:], test=recs[:n_test], val=train[:n_val],
                              tasks=sorted({r.get("task", "default") for r in recs})))
    return out


def return_holdout(clients: list[ClientData], holdout: list[Record], seed: int) -> None:
    """Give the held-out pool back to training (methods that do not use it train on the original data,
    as pFedGPT's comparison protocol has it): each task's held-out records go to the clients' training
    splits in proportion to how many training records of that task each client holds (largest
    remainders, ties to the smaller client index), so every client keeps its task mixture; test and
    validation splits are untouched, so the test sets are the same for every method."""
    if not holdout:
        return
    rng = np.random.default_rng([seed, salts.VALIDATION_SPLIT])
    by_task: dict[str, list[Record]] = {}
    for r in holdout:
        by_task.setdefault(r.get("task", "default"), []).append(r)
    for task, recs in sorted(by_task.items()):
        counts = np.array([sum(r.get("task", "default") == task for r in c.train) for c in clients], dtype=float)
        if counts.sum() == 0:
            counts = np.array([len(c.train) for c in clients], dtype=float)
        quota = counts / counts.sum() * len(recs)
        take = np.floor(quota).astype(int)
        order = sorted(range(len(clients)), key=lambda k: (-(quota[k] - take[k]), k))
        for k in order[: len(recs) - int(take.sum())]:
            take[k] += 1
        recs = [recs[i] for i in rng.permutation(len(recs))]
        start = 0
        for k, c in enumerate(clients):
            c.train = c.train + recs[start:start + take[k]]
            start += take[k]
