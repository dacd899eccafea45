"""A card's hypotheses judged with the run as the unit, from the values of each (run, client).

A card's CSV (``BUDGET-vN.csv``) holds **one row per (hypothesis, run, client)** a test used: the
client's final value in the treatment row and the baseline row, and what the test takes from them
(``value``: the difference, the ratio, or the value). A run-level metric (one value per trial) has a
row per run with an empty ``client``. The per-run values the tests take are *derived* from these
rows by one rule, :func:`run_level`, both when a card is judged and when ``fedsweep reproduce
--verify`` recomputes a committed report, so the verdicts are traced to the clients' values:

* paired (``greater`` / ``less`` / ``not_worse``): for each seed, over the clients both rows
  evaluated (in client order), mean(treatment) − mean(baseline);
* a ratio threshold per client: the mean of the clients' own ratios baseline / treatment; a
  threshold per client: the mean of the clients' values; a run-level threshold: the run's value;
* unpaired (Welch's, rows on different data): each row's run means over its clients.

The per-run values then go to ``reports.verdicts`` (paired t, Welch's t, one-sample t; Holm over the
card; each hypothesis's stated smallest effect of interest decides *not detected* against *undecided
at this budget*). The client-level pairs are described in ``Outcome.notes``, never tested.

CSVs written before 2026-11-28 hold one row per run (no ``client`` column): :func:`from_csv` reads
them as they were and recomputes them with the rules they were written with (``verdicts.decide``'s
``legacy``).
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict

import numpy as np

from fedsweep.reports import verdicts as vd
from fedsweep.reports.run_values import row_values, same_data

CSV_FIELDS = ("hypothesis", "kind", "test", "seed", "client", "treatment", "baseline", "value", "value_is",
              "parameter", "higher_is_better", "alpha", "effect")
"""One row per (hypothesis, run, client) a test used (module docstring); ``parameter``: the margin or
bound; ``effect``: the hypothesis's smallest effect of interest, stated before the run."""
LEGACY_FIELDS = ("hypothesis", "kind", "test", "seed", "treatment", "baseline", "value", "parameter",
                 "higher_is_better", "alpha")
"""The columns of a CSV written before 2026-11-28: one row per run."""

DIFFERENCE, RATIO, VALUE = "treatment - baseline", "baseline / treatment", "treatment"
LOG_RATIO = "log(baseline / treatment)"
"""A ratio tested on the log scale (``Hypothesis.log``): the CSV's ``parameter`` is then log(bound)."""


def ratio_value(baseline: float, treatment: float, log: bool) -> float:
    """baseline / treatment, or its natural log (one rule for the CSV and its check)."""
    return math.log(baseline / treatment) if log else baseline / treatment
PAIRED_T, THRESHOLD_T, WELCH_T = "paired t over runs", "one-sample t over runs", "Welch t over runs"


def _test_name(h) -> str:
    if h.kind in ("at_least", "at_most"):
        return THRESHOLD_T
    if not h.paired:
        return WELCH_T
    return PAIRED_T + (", against the margin" if h.kind == "not_worse" else "")


def units_of(card, rows) -> list[dict]:
    """The CSV rows of every hypothesis of ``card`` on the study's ``rows`` (``reports.compare.RunRow``):
    each (run, client) value the test uses; paired rows refused where a seed's data differ."""
    units = []
    for h in card.hypotheses:
        bound = math.log(h.bound) if h.log else h.bound
        common = {"hypothesis": h.id, "kind": h.kind, "test": _test_name(h), "alpha": card.alpha,
                  "effect": h.effect, "parameter": bound if h.kind in ("at_least", "at_most") else h.margin}
        is_ratio = LOG_RATIO if h.log else RATIO
        t = row_values(rows, h.treatment, h.metric)
        b = row_values(rows, h.baseline, h.metric) if h.baseline else None
        if h.kind in ("at_least", "at_most"):
            if h.ratio and h.unit == "client":
                same_data(b, t, f"hypothesis {h.id} ({h.baseline} over {h.treatment})")
                keys = sorted(k for k in set(t.per_client) & set(b.per_client) if t.per_client[k])
                units += [{**common, "seed": s, "client": c, "treatment": t.per_client[(s, c)],
                           "baseline": b.per_client[(s, c)],
                           "value": ratio_value(b.per_client[(s, c)], t.per_client[(s, c)], h.log),
                           "value_is": is_ratio} for s, c in keys]
            elif h.ratio:
                seeds = sorted(s for s in set(t.per_run) & set(b.per_run) if t.per_run[s])
                units += [{**common, "seed": s, "client": None, "treatment": t.per_run[s], "baseline": b.per_run[s],
                           "value": ratio_value(b.per_run[s], t.per_run[s], h.log), "value_is": is_ratio}
                          for s in seeds]
            elif h.unit == "client":
                units += [{**common, "seed": s, "client": c, "value": t.per_client[(s, c)], "value_is": VALUE}
                          for s, c in sorted(t.per_client)]
            else:
                units += [{**common, "seed": s, "client": None, "value": t.per_run[s], "value_is": VALUE}
                          for s in sorted(t.per_run)]
        elif h.paired:
            same_data(t, b, f"hypothesis {h.id} ({h.treatment} vs {h.baseline})")
            keys = sorted(set(t.per_client) & set(b.per_client))
            units += [{**common, "seed": s, "client": c, "treatment": t.per_client[(s, c)],
                       "baseline": b.per_client[(s, c)], "value": t.per_client[(s, c)] - b.per_client[(s, c)],
                       "value_is": DIFFERENCE, "higher_is_better": h.better_high()} for s, c in keys]
        else:
            units += [{**common, "seed": s, "client": c, "treatment": v} for (s, c), v in sorted(t.per_client.items())]
            units += [{**common, "seed": s, "client": c, "baseline": v} for (s, c), v in sorted(b.per_client.items())]
    return units


def _by_seed(rows: list[dict], column: str) -> dict[str, list[float]]:
    """{seed: the column's values in the rows' (client) order}, seeds in first-seen order."""
    out: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        v = number(r.get(column))
        if v is not None:
            out[str(r["seed"])].append(v)
    return out


def _mean(values: list[float]) -> float:
    return float(np.mean(values))


def run_level(rows: list[dict]) -> list[dict]:
    """One hypothesis's (run, client) rows → one row per run, the values its test takes (module
    docstring): the single rule from clients to runs, for judging and for ``--verify`` alike."""
    first = rows[0]
    common = {k: first.get(k) for k in ("hypothesis", "kind", "test", "parameter", "higher_is_better", "alpha", "effect")}
    if str(first["test"]).startswith("Welch"):
        return ([{**common, "seed": s, "treatment": _mean(v)} for s, v in _by_seed(rows, "treatment").items()] +
                [{**common, "seed": s, "baseline": _mean(v)} for s, v in _by_seed(rows, "baseline").items()])
    if first.get("value_is") == DIFFERENCE:
        t, b = _by_seed(rows, "treatment"), _by_seed(rows, "baseline")
        out = []
        for s in t:
            a, c = _mean(t[s]), _mean(b[s])
            out.append({**common, "seed": s, "treatment": a, "baseline": c, "value": a - c})
        return out
    return [{**common, "seed": s, "value": _mean(v)} for s, v in _by_seed(rows, "value").items()]


def _client_description(rows: list[dict]) -> str | None:
    """A paired hypothesis's (seed, client) pairs, described (never tested)."""
    diffs = [number(r.get("value")) for r in rows if r.get("value_is") == DIFFERENCE and r.get("client") not in ("", None)]
    if not diffs:
        return None
    return (f"description: {len(diffs)} (seed, client) pairs, mean difference {float(np.mean(diffs)):+.4g} "
            f"(not a test: clients of a run are not independent)")


def judge(card, rows) -> tuple[list[vd.Outcome], list[dict]]:
    """Every hypothesis of ``card`` judged on the study's ``rows`` with the run as the unit; (outcomes,
    the CSV rows: every (run, client) value the tests used)."""
    units = units_of(card, rows)
    missing = [h.id for h in card.hypotheses if not any(u["hypothesis"] == h.id for u in units)]
    if missing:
        from fedsweep.errors import ConfigError

        raise ConfigError(f"card {card.card}: no values for {', '.join(missing)} (did its rows run and report "
                          f"the metric?)")
    return from_units(group(units)), units


def group(units: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by hypothesis id, in their order."""
    by_id: dict[str, list[dict]] = {}
    for row in units:
        by_id.setdefault(row["hypothesis"], []).append(row)
    return by_id


def from_units(by_id: dict[str, list[dict]]) -> list[vd.Outcome]:
    """The outcomes of (run, client) rows grouped by hypothesis: runs derived by :func:`run_level`,
    tested and decided under today's rules (each hypothesis's stated effect from its rows)."""
    runs = {hid: run_level(rows) for hid, rows in by_id.items()}
    outcomes = _tested(runs)
    for o in outcomes:
        said = _client_description(by_id[o.id])
        if said:
            o.notes.append(said)
    effects = {hid: number(rows[0].get("effect")) for hid, rows in by_id.items()}
    alpha = float(next(iter(by_id.values()))[0]["alpha"]) if by_id else 0.05
    return vd.decide(outcomes, alpha, effects)


def to_csv(units: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for row in units:
        w.writerow({k: ("" if row.get(k) is None else repr(row[k]) if isinstance(row.get(k), float) else row[k])
                    for k in CSV_FIELDS})
    return buf.getvalue()


def is_legacy(text: str) -> bool:
    """A CSV written before 2026-11-28 (one row per run, no ``client`` column)."""
    header = text.split("\n", 1)[0].split(",")
    return "client" not in header


def inconsistent(text: str) -> list[str]:
    """Rows of a card's CSV whose ``value`` is not what it says it is (treatment − baseline, or
    baseline / treatment), exactly as a float computes it."""
    out = []
    for i, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        t, b, v = number(row.get("treatment")), number(row.get("baseline")), number(row.get("value"))
        if t is None or b is None or v is None:
            continue
        kind = row.get("value_is")
        if v != (ratio_value(b, t, kind == LOG_RATIO) if kind in (RATIO, LOG_RATIO) else t - b):
            out.append(f"{row['hypothesis']}: line {i}: value {row['value']} is not "
                       f"{kind if kind in (RATIO, LOG_RATIO) else 'treatment − baseline'}")
    return out


def number(v) -> float | None:
    """A CSV cell (or a value) as a float; None where it is empty."""
    return float(v) if v not in ("", None) else None


def seeded(rows: list[dict], column: str) -> list[tuple[str, float]]:
    """(seed, value) of the rows whose ``column`` holds a value, in the rows' order."""
    return [(str(r["seed"]), v) for r in rows if (v := number(r.get(column))) is not None]


def rows_by_hypothesis(text: str) -> dict[str, list[dict]]:
    """A card's CSV, its rows grouped by hypothesis id (in the file's order)."""
    return group(list(csv.DictReader(io.StringIO(text))))


def run_rows_of(text: str) -> dict[str, list[dict]]:
    """A card's CSV as one row per run per hypothesis (a legacy CSV as it is; today's derived by
    :func:`run_level`): what the figure draws and the pilot measures."""
    by_id = rows_by_hypothesis(text)
    return by_id if is_legacy(text) else {hid: run_level(rows) for hid, rows in by_id.items()}


def from_csv(text: str) -> list[vd.Outcome]:
    """The outcomes recomputed from a card's CSV (what ``--verify`` checks): today's from the (run,
    client) values, a legacy CSV's from its run values under the rules it was written with."""
    by_id = rows_by_hypothesis(text)
    if not is_legacy(text):
        return from_units(by_id)
    outcomes = _tested(by_id)
    alpha = float(next(iter(by_id.values()))[0]["alpha"]) if by_id else 0.05
    return vd.decide(outcomes, alpha, legacy=True)


def _tested(runs: dict[str, list[dict]]) -> list[vd.Outcome]:
    """Each hypothesis's test on its per-run rows (undecided, not refused, where too few runs)."""
    outcomes = []
    for hid, rows in runs.items():
        kind = rows[0]["kind"]
        if kind in ("at_least", "at_most"):
            outcomes.append(vd.threshold(hid, kind, [number(r["value"]) for r in rows], number(rows[0]["parameter"])))
        elif str(rows[0]["test"]).startswith("Welch"):
            a, b = ([v for _, v in seeded(rows, col)] for col in ("treatment", "baseline"))
            outcomes.append(vd.unpaired(hid, kind, a, b))
        else:
            outcomes.append(vd.paired(hid, kind, [number(r["treatment"]) for r in rows],
                                      [number(r["baseline"]) for r in rows], number(rows[0]["parameter"]) or 0.0,
                                      str(rows[0]["higher_is_better"]) == "True"))
    return outcomes
