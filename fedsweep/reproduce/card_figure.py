"""A card report's figure: one panel per hypothesis, on the scale its test ran on.

Each panel shows what the verdict was decided from (``reports.verdicts``): every run's value x_s (a
dot per seed: treatment − baseline for a paired row, the run's value for a threshold; an unpaired
row's two groups as each run minus the other row's mean), their mean with its 95 % interval, the
decision interval at level 1 − α/m (Holm's strictest step), the reference the claim is tested
against (0, the margin line or the bound), the side the claim says the mean lies on (shaded), and
the effect the card named for its seeds (reference + claim sign × effect). Panels are coloured by
verdict and each has its own axis, so a bytes ratio and a loss difference sit in one figure.

It is drawn from the report's CSV alone (the values ``--verify`` recomputes from), so any committed
report can be drawn again: ``fedsweep reproduce --figure REPORT`` writes ``BUDGET-vN.png`` beside it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from fedsweep.reports import verdicts as vd
from fedsweep.reproduce.card_units import from_csv, number, run_rows_of, seeded
from fedsweep.reports.figures import figure

COLOURS = {vd.REPRODUCED: "#1a7f37", vd.CONTRADICTED: "#cf222e", vd.NOT_DETECTED: "#6e7781", vd.UNDECIDED: "#bf8700"}


@dataclass
class Panel:
    """One hypothesis as drawn."""

    outcome: vd.Outcome
    runs: list[tuple[str, float]] = field(default_factory=list)
    """(label, value on the test's scale) per run; an unpaired row's labels say which row."""
    named: float | None = None
    """Where the card's named effect lies on this scale (reference + claim sign × effect)."""
    scale: str = ""
    """What the axis measures (from the card: the rows compared and the metric)."""


def run_points(rows: list[dict], outcome: vd.Outcome) -> list[tuple[str, float]]:
    """The per-run values a hypothesis's test took, from its CSV rows: ``value`` (paired: treatment −
    baseline; threshold: the run's value), or for Welch's test each run against the other row's mean."""
    if not outcome.test.startswith("Welch"):
        return [(f"seed {s}", v) for s, v in seeded(rows, "value")]
    a, b = seeded(rows, "treatment"), seeded(rows, "baseline")
    if not a or not b:
        return []
    mean_a, mean_b = sum(v for _, v in a) / len(a), sum(v for _, v in b) / len(b)
    return ([(f"treatment seed {s}", v - mean_b) for s, v in a] +
            [(f"baseline seed {s}", mean_a - v) for s, v in b])


def scale_of(h) -> str:
    """The axis of hypothesis ``h``: the rows compared and the metric."""
    if not h.baseline:
        return f"{h.treatment}: {h.metric}"
    if h.ratio:
        return f"{'log ' if h.log else ''}{h.baseline} / {h.treatment}: {h.metric}"
    return f"{h.treatment} − {h.baseline}: {h.metric}"


def panels(csv_text: str, hypotheses: dict | None = None) -> list[Panel]:
    """The figure's panels from a card's CSV (outcomes recomputed as ``--verify`` does, one dot per run
    derived from the clients' values) and, where known, the card's hypotheses by id (their axes; the
    named effect from the CSV where it keeps one, else from the card)."""
    by_id = run_rows_of(csv_text)
    out = []
    for o in from_csv(csv_text):
        h = (hypotheses or {}).get(o.id)
        effect = number(by_id[o.id][0].get("effect")) if by_id[o.id] else None
        if effect is None and h is not None:
            effect = h.effect
        named = o.reference + o.claim_sign * effect if effect is not None else None
        out.append(Panel(o, run_points(by_id[o.id], o), named, scale_of(h) if h is not None else ""))
    return out


def _draw_panel(ax, p: Panel) -> None:
    o, colour = p.outcome, COLOURS.get(p.outcome.verdict, "black")
    xs = [v for _, v in p.runs] + [o.reference] + ([p.named] if p.named is not None else []) + \
        [x for x in (o.low, o.high, o.decision_low, o.decision_high) if math.isfinite(x)]
    lo, hi = min(xs), max(xs)
    pad = 0.08 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.1
    lo, hi = lo - pad, hi + pad
    claim_side = (o.reference, hi) if o.claim_sign > 0 else (lo, o.reference)
    ax.axvspan(*claim_side, color="#dafbe1", alpha=0.6, lw=0)
    ax.axvline(o.reference, color="black", lw=1, ls="--")
    if p.named is not None:
        ax.axvline(p.named, color="#8250df", lw=1, ls=":")
    for i, (_, v) in enumerate(p.runs):
        ax.plot([v], [0.35 + 0.1 * ((i % 3) - 1)], "o", ms=3.5, color=colour, alpha=0.7)
    if math.isfinite(o.decision_low) and math.isfinite(o.decision_high):
        ax.plot([o.decision_low, o.decision_high], [-0.25, -0.25], color=colour, lw=1.2, alpha=0.5)
    if math.isfinite(o.low) and math.isfinite(o.high):
        ax.plot([o.low, o.high], [-0.25, -0.25], color=colour, lw=4, solid_capstyle="butt")
    if math.isfinite(o.estimate):
        ax.plot([o.estimate], [-0.25], "D", ms=6, color=colour)
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.7, 0.7)
    ax.set_yticks([])
    holm = f"Holm p {o.p_holm:.2g}" if math.isfinite(o.p_holm) else ""
    ax.set_title(f"{o.id}: {o.verdict} ({o.test}, n {o.n}; {holm})", fontsize=8, loc="left", color=colour)
    ax.tick_params(axis="x", labelsize=7)
    if p.scale:
        ax.set_xlabel(p.scale, fontsize=7, labelpad=1)
    ax.grid(axis="x", alpha=0.3)


def draw(ps: list[Panel], title: str, path: Path) -> Path:
    """The panels, one under another, written to ``path`` (PNG)."""
    height = 1.1 * len(ps) + 1.2
    fig = figure(7.5, height)
    axes = fig.subplots(len(ps), 1, squeeze=False)[:, 0]
    for ax, p in zip(axes, ps):
        _draw_panel(ax, p)
    fig.suptitle(f"{title}\ndots: runs · diamond and thick bar: mean, 95 % interval · thin bar: decision "
                 f"interval · dashed: reference · dotted: named effect · shaded: the claimed side", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height))  # room for the two-line title
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path


def card_hypotheses(card, version: int) -> dict | None:
    """The card's hypotheses by id, where ``card`` is the version the report ran (an older report's
    version is in the card's history, which keeps no effects: none then)."""
    if card is None or card.version != version:
        return None
    return {h.id: h for h in card.hypotheses}


def draw_report(report: Path, card=None) -> Path:
    """``BUDGET-vN.png`` beside the report at ``report``, from the CSV beside it (``card``: the card, for
    its named effects, used only where its version is the report's)."""
    from fedsweep.errors import ConfigError

    report = Path(report)
    csv_path = report.with_suffix(".csv")
    if not csv_path.is_file():
        raise ConfigError(f"{csv_path} not found: a report's figure is drawn from the CSV beside it")
    found = re.search(r"-v(\d+)", report.stem)
    version = int(found.group(1)) if found else -1
    title = f"{report.parent.name} {report.stem}"
    return draw(panels(csv_path.read_text(), card_hypotheses(card, version)), title, report.with_suffix(".png"))
