"""A card's hypotheses judged with the run as the unit: a study's per-client values become one value
per run (seed), tested by ``reports.verdicts``; every value a test used is kept as a row of the
card's CSV, from which ``fedsweep reproduce --verify`` recomputes each verdict.

Per-run values of a per-client metric: the mean over the run's clients. A paired hypothesis pairs the
two rows' runs of one seed (whose clients hold the same data, or it is refused) and averages the
difference over the clients both evaluated; a ratio threshold per client averages each client's own
ratio within the run. The client-level pairs are kept as description (``Outcome.notes``), never tested.
"""

from __future__ import annotations

import csv
import io
import numpy as np

from fedsweep.errors import ConfigError
from fedsweep.reports import verdicts as vd
from fedsweep.reports.run_values import RowValues, paired_runs, paired_values, row_values, same_data

CSV_FIELDS = ("hypothesis", "kind", "test", "seed", "treatment", "baseline", "value", "parameter",
              "higher_is_better", "alpha")
"""One row per unit a test used: ``value`` is what was tested (a paired difference, a threshold's
value); ``treatment``/``baseline`` the run means it came from; ``parameter`` the margin or bound."""


def _threshold_runs(h, rows, t: RowValues) -> tuple[list[str], list[float]]:
    """The per-run values a threshold hypothesis tests (module docstring)."""
    if h.ratio and h.unit == "client":  # each client's own ratio, averaged within its run
        b = row_values(rows, h.baseline, h.metric)
        same_data(b, t, f"hypothesis {h.id} ({h.baseline} over {h.treatment})")
        keys = sorted(k for k in set(t.per_client) & set(b.per_client) if t.per_client[k])
        seeds = sorted({s for s, _ in keys})
        return seeds, [float(np.mean([b.per_client[k] / t.per_client[k] for k in keys if k[0] == s])) for s in seeds]
    if h.ratio:
        b = row_values(rows, h.baseline, h.metric)
        seeds = sorted(s for s in set(t.per_run) & set(b.per_run) if t.per_run[s])
        return seeds, [b.per_run[s] / t.per_run[s] for s in seeds]
    if h.unit == "client":
        means = t.run_means()
        return list(means), list(means.values())
    return sorted(t.per_run), [t.per_run[s] for s in sorted(t.per_run)]


def judge(card, rows) -> tuple[list[vd.Outcome], list[dict]]:
    """Every hypothesis of ``card`` judged on the study's ``rows`` (``reports.compare.RunRow``) with
    the run as the unit; (outcomes, the CSV rows of the values tested)."""
    outcomes, units = [], []
    for h in card.hypotheses:
        t = row_values(rows, h.treatment, h.metric)
        common = {"hypothesis": h.id, "kind": h.kind, "alpha": card.alpha}
        if h.kind in ("at_least", "at_most"):
            seeds, x = _threshold_runs(h, rows, t)
            try:
                out = vd.threshold(h.id, h.kind, x, h.bound)
            except ValueError as exc:
                raise ConfigError(f"card {card.card}: {exc} (a card with a threshold runs at least "
                                  f"{vd.MIN_UNITS} seeds)") from None
            units += [{**common, "test": out.test, "seed": s, "value": v, "parameter": h.bound} for s, v in zip(seeds, x)]
        elif h.paired:
            b = row_values(rows, h.baseline, h.metric)
            seeds, a, c = paired_runs(t, b, f"hypothesis {h.id} ({h.treatment} vs {h.baseline})")
            out = vd.paired(h.id, h.kind, a, c, h.margin, h.better_high())
            units += [{**common, "test": out.test, "seed": s, "treatment": av, "baseline": cv, "value": av - cv,
                       "parameter": h.margin, "higher_is_better": h.better_high()} for s, av, cv in zip(seeds, a, c)]
            ta, tc = paired_values(t, b, h.id)
            if ta:
                out.notes.append(f"description: {len(ta)} (seed, client) pairs, mean difference "
                                 f"{float(np.mean(np.subtract(ta, tc))):+.4g} (not a test: clients of a run are not independent)")
        else:
            b = row_values(rows, h.baseline, h.metric)
            ta, tb = t.run_means(), b.run_means()
            out = vd.unpaired(h.id, h.kind, list(ta.values()), list(tb.values()))
            units += [{**common, "test": out.test, "seed": s, "treatment": v} for s, v in ta.items()]
            units += [{**common, "test": out.test, "seed": s, "baseline": v} for s, v in tb.items()]
        outcomes.append(out)
    return vd.decide(outcomes, card.alpha), units


def to_csv(units: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for row in units:
        w.writerow({k: ("" if row.get(k) is None else repr(row[k]) if isinstance(row.get(k), float) else row[k])
                    for k in CSV_FIELDS})
    return buf.getvalue()


def inconsistent(text: str) -> list[str]:
    """Rows of a card's CSV whose tested difference is not their treatment − baseline."""
    out = []
    for i, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        if row["treatment"] and row["baseline"] and row["value"]:
            if float(row["value"]) != float(row["treatment"]) - float(row["baseline"]):
                out.append(f"{row['hypothesis']}: line {i}: value {row['value']} is not treatment − baseline")
    return out


def number(v: str | None) -> float | None:
    """A CSV cell as a float; None where it is empty."""
    return float(v) if v not in ("", None) else None


def seeded(rows: list[dict], column: str) -> list[tuple[str, float]]:
    """(seed, value) of the rows whose ``column`` holds a value, in the rows' order."""
    return [(r["seed"], v) for r in rows if (v := number(r[column])) is not None]


def rows_by_hypothesis(text: str) -> dict[str, list[dict]]:
    """A card's CSV of tested values, its rows grouped by hypothesis id (in the file's order)."""
    by_id: dict[str, list[dict]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        by_id.setdefault(row["hypothesis"], []).append(row)
    return by_id


def from_csv(text: str) -> list[vd.Outcome]:
    """The outcomes recomputed from a card's CSV of tested values (what ``--verify`` checks)."""
    return from_rows(rows_by_hypothesis(text))


def from_rows(by_id: dict[str, list[dict]]) -> list[vd.Outcome]:
    """The outcomes recomputed from a card's CSV rows grouped by hypothesis (:func:`rows_by_hypothesis`)."""
    outcomes, alpha = [], 0.05
    for hid, rows in by_id.items():
        kind, alpha = rows[0]["kind"], float(rows[0]["alpha"])
        if kind in ("at_least", "at_most"):
            outcomes.append(vd.threshold(hid, kind, [number(r["value"]) for r in rows], number(rows[0]["parameter"])))
        elif rows[0]["test"].startswith("Welch"):
            a, b = ([v for _, v in seeded(rows, col)] for col in ("treatment", "baseline"))
            outcomes.append(vd.unpaired(hid, kind, a, b))
        else:
            outcomes.append(vd.paired(hid, kind, [number(r["treatment"]) for r in rows], [number(r["baseline"]) for r in rows],
                                      number(rows[0]["parameter"]) or 0.0, rows[0]["higher_is_better"] == "True"))
    return vd.decide(outcomes, alpha)
