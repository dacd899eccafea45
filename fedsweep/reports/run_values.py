"""A study row's values with the run as the unit: each (seed, client)'s final value of a metric, each
seed's data signature, and the run means derived from them; two rows paired by seed only where their
clients hold the same data (``pairing``). Used by the comparison report (``compare``), the demo's
question and the reproduction cards alike."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedsweep.errors import ConfigError
from fedsweep.reports.pairing import data_signature


@dataclass
class RowValues:
    """A study row's final per-client values of one metric: {(seed, client): value}, with each seed's
    data signature, and the run-level values (one per trial)."""

    per_client: dict[tuple[str, int], float]
    signatures: dict[str, tuple]
    per_run: dict[str, float]
    """Each trial's own (run-level) value, by seed."""

    def run_means(self) -> dict[str, float]:
        """Each run's mean over its clients."""
        by_seed: dict[str, list[float]] = {}
        for (seed, _), value in self.per_client.items():
            by_seed.setdefault(seed, []).append(value)
        return {seed: float(np.mean(v)) for seed, v in sorted(by_seed.items())}


def row_values(rows, label: str, metric: str) -> RowValues:
    per_client: dict[tuple[str, int], float] = {}
    signatures: dict[str, tuple] = {}
    per_run: dict[str, float] = {}
    for r in rows:
        if r.label != label:
            continue
        signatures[r.seed] = data_signature(r.params)
        for cid, value in r.per_client.get(metric, {}).items():
            if not math.isnan(value):
                per_client[(r.seed, cid)] = value
        run_value = r.final.get(metric)
        if run_value is None:
            run_value = r.run_metrics.get(metric) if hasattr(r, "run_metrics") else None
        if run_value is not None and not math.isnan(run_value):
            per_run[r.seed] = run_value
    return RowValues(per_client, signatures, per_run)


def same_data(treatment: RowValues, baseline: RowValues, what: str) -> None:
    for seed, sig in treatment.signatures.items():
        other = baseline.signatures.get(seed)
        if other is not None and other != sig:
            diff = sorted(set(sig) ^ set(other))
            raise ConfigError(f"{what}: the two rows' clients hold different data at seed {seed} "
                              f"({', '.join(f'{k}={v}' for k, v in diff[:4])}): a paired test would pair "
                              f"clients that do not share a test set; compare them with paired: false")


def paired_values(treatment: RowValues, baseline: RowValues, what: str) -> tuple[list[float], list[float]]:
    """Values of the (seed, client) pairs both rows evaluated, refused where a seed's data differ."""
    same_data(treatment, baseline, what)
    keys = sorted(set(treatment.per_client) & set(baseline.per_client))
    return [treatment.per_client[k] for k in keys], [baseline.per_client[k] for k in keys]


def paired_runs(treatment: RowValues, baseline: RowValues, what: str) -> tuple[list[str], list[float], list[float]]:
    """(seeds, treatment run means, baseline run means) over the clients both rows evaluated in each
    seed's runs, refused where a seed's data differ."""
    same_data(treatment, baseline, what)
    keys = sorted(set(treatment.per_client) & set(baseline.per_client))
    seeds = sorted({s for s, _ in keys})
    t = [float(np.mean([treatment.per_client[k] for k in keys if k[0] == s])) for s in seeds]
    b = [float(np.mean([baseline.per_client[k] for k in keys if k[0] == s])) for s in seeds]
    return seeds, t, b
