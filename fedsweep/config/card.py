"""A reproduction card: one paper's headline claims as pre-registered hypotheses, and the studies that
test them at up to three budgets.

A card file (``configs/reproductions/NAME.yaml``) states, before it is run, the paper and its
figures, each claim as a hypothesis (metric, direction, rows compared, the effect it aims to detect),
the test (t over runs, the run as the unit, Holm within the card, α: ``reports.verdicts``), and per
budget the study (a sweep: base experiment, overrides, variants, seeds — fixed from a pilot,
``reports.pilot``) with how its data and model differ from the paper's::

    card: premise
    version: 1
    paper: "…"
    alpha: 0.05
    hypotheses:
      - id: local_beats_fedavg_disjoint
        paper: "FedLLM-Bench, …"
        claim: "on disjoint tasks, local training reaches a lower test loss than FedAvg"
        metric: test_loss
        kind: less                  # greater | less | not_worse | at_least | at_most
        treatment: local_disjoint
        baseline: fedavg_disjoint
        role: claim                 # claim | property | calibration | arithmetic
        effect: 0.2                 # the smallest effect of interest (metric units), stated before the budget
        effect_basis: "…"           # why: the paper's gap, or a stated reason
    budgets:
      cpu: {minutes: 20, differs: "…", study: {experiment: …, set: […], variants: {…}, seeds: [0, 1, 2]},
            replication_seeds: [200, 201, 202]}
      gpu-small: {minutes: 8, differs: "…", study: {…}}   # the bundled model on one GPU
      gpu: {differs: "…", study: {…}}                     # the paper's scale

A card is never re-tuned after it has run: a changed setting is a new ``version`` (the file keeps
the old one under ``history``), and the ledger keeps every version's result.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from fedsweep.config.loading import read_yaml
from fedsweep.config.schema import Strict
from fedsweep.errors import ConfigError

KINDS = ("greater", "less", "not_worse", "at_least", "at_most")
PILOT_SEEDS = (100, 101, 102)
"""Seeds a card's pilot runs on (``reproduce.pilot``); no card's test or replication uses them."""
OUTSIDE_SEEDS_FROM = 1000
"""Seeds from here up are left to replications run outside the project (``fedsweep reproduce NAME
--replicate --seeds … --label …``): no card version, pilot or declared replication block may use them, so
a replication someone else runs there is on seeds the project never looked at."""
LABEL = r"^[a-z0-9][a-z0-9-]{0,39}$"
"""An outside replication's label (who ran it, e.g. ``lab-x``): its report is ``BUDGET-vN-replication-LABEL.md``."""
CARD_DIR = Path("configs/reproductions")


class Hypothesis(Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    paper: str
    """The paper's table or figure and its numbers."""
    claim: str
    """The claim as a directional hypothesis, in words."""
    metric: str
    kind: Literal["greater", "less", "not_worse", "at_least", "at_most"]
    treatment: str
    """The study row (variant) whose values are tested."""
    baseline: str | None = None
    """The row compared with (paired kinds)."""
    margin: float = Field(0.0, ge=0)
    """``not_worse``: how much worse still counts as not worse (the metric's units)."""
    bound: float | None = None
    """``at_least`` / ``at_most``: the threshold."""
    ratio: bool = False
    """``at_least`` / ``at_most``: test the baseline's value over the treatment's, seed by seed (e.g.
    how many times fewer bytes), instead of the treatment's value."""
    log: bool = False
    """With ``ratio``: test the natural log of each ratio against log(``bound``) (a ratio's spread is
    multiplicative: on the log scale a run's value is the mean of its clients' log ratios, and
    ``effect`` is in log units, e.g. ln(129 / 100) = 0.255 for a ratio of 129 against a bound of 100)."""
    unit: Literal["run", "client"] = "run"
    """``at_least`` / ``at_most``: the values tested — one per trial (``run``), or one per client of each
    trial (``client``: a ratio is then taken client by client, the clients' own values of the metric;
    with two seeds a run-level interval has one degree of freedom and can almost never clear a bound)."""
    higher_is_better: bool | None = None
    """``not_worse``: the metric's good direction (default: lower for losses, seconds and bytes)."""
    effect: float = Field(gt=0)
    """The smallest effect of interest (the metric's units; for a threshold, the distance from the
    bound; for ``not_worse``, below the margin line): the difference that would matter, stated before
    the budget is chosen — never solved back from the seeds that fit. Where the runs could not have
    detected it (80 % power at Holm's first level), nothing detected is *undecided at this budget*,
    not *not detected* (``reports.verdicts``); the pilot says which, before the run."""
    effect_basis: str = Field(min_length=10)
    """Why that effect: the paper's reported gap (its table and numbers, and how they translate to this
    metric), or a stated reason (what a user would notice)."""
    role: Literal["claim", "calibration", "arithmetic", "property"]
    """What the hypothesis checks: a paper's ``claim`` that a method beats a baseline on a quality
    metric (what the ledger's headline counts); a ``property`` of a method that is not a quality win
    (fewer bytes, a share of clients, a mechanism on data built for it, an ablation); a ``calibration``
    of the study itself (the attack hurts, so the rules have something to recover); or ``arithmetic``
    that holds by construction at the budget's size (16-bit uploads after a few steps)."""
    paired: bool = True
    """Pair the rows' runs seed by seed (their clients hold the same data); False compares rows on
    different data (another partition) with Welch's test over their run means."""

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "Hypothesis":
        if self.kind in ("greater", "less", "not_worse") and not self.baseline:
            raise ValueError(f"hypothesis {self.id}: kind {self.kind} compares two rows: give a baseline")
        if self.kind in ("at_least", "at_most") and self.bound is None:
            raise ValueError(f"hypothesis {self.id}: kind {self.kind} needs a bound")
        if self.ratio and not self.baseline:
            raise ValueError(f"hypothesis {self.id}: a ratio is the baseline's value over the treatment's: give a baseline")
        if self.log and not (self.ratio and self.kind in ("at_least", "at_most") and self.bound and self.bound > 0):
            raise ValueError(f"hypothesis {self.id}: log tests a ratio's log against a positive bound's: "
                             "give ratio: true, kind at_least or at_most and a bound above 0")
        return self

    def better_high(self) -> bool:
        if self.higher_is_better is not None:
            return self.higher_is_better
        return not any(w in self.metric for w in ("loss", "seconds", "bytes", "share"))


class Budget(Strict):
    minutes: float | None = Field(None, gt=0)
    replication_seeds: list[int] = Field(default_factory=list)
    """A block of seeds declared with the version and never run by it, its pilot or an earlier version:
    ``fedsweep reproduce NAME --replicate`` runs the registered design unchanged on them (no pilot, no
    look) and writes ``BUDGET-vN-replication.{md,csv,png}`` beside the original."""
    """The budget's stated wall time on its machine (cpu: 2 cores; gpu-small: one H100)."""
    differs: str
    """How the data, model and training differ from the paper's."""
    study: dict[str, Any] | None = None
    """A sweep (``fedsweep tune``'s file format, less ``name``, ``metric`` and ``mode``)."""
    sweep: str | None = None
    """Or a sweep file (relative to the card) that is the study, so a study that also runs on its own
    (``fedsweep tune``) is written once; :func:`load_card` reads it into ``study``."""

    @model_validator(mode="after")
    def _one_study(self) -> "Budget":
        if self.study is None:
            raise ValueError("give the budget's study inline (study:) or as a sweep file (sweep:)")
        used = set(self.study.get("seeds") or []) & set(self.replication_seeds)
        if used:
            raise ValueError(f"replication_seeds {sorted(used)} are the study's own seeds: a replication runs fresh ones")
        if len(set(self.replication_seeds)) != len(self.replication_seeds):
            raise ValueError("replication_seeds must be distinct")
        mine = [s for s in [*(self.study.get("seeds") or []), *self.replication_seeds] if s >= OUTSIDE_SEEDS_FROM]
        if mine:
            raise ValueError(f"seeds {sorted(mine)}: seeds from {OUTSIDE_SEEDS_FROM} up are left to replications run "
                             f"outside the project")
        return self


class Card(Strict):
    card: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    version: int = Field(ge=1)
    paper: str
    registered: str
    """The date the hypotheses were written down, before the card first ran."""
    alpha: float = Field(0.05, gt=0, lt=1)
    hypotheses: list[Hypothesis] = Field(min_length=1)
    budgets: dict[Literal["cpu", "gpu-small", "gpu"], Budget]
    history: list[dict[str, Any]] = Field(default_factory=list)
    """Earlier versions' settings and results (never deleted)."""
    _source: Path | None = PrivateAttr(default=None)
    """The file it was read from (:func:`load_card`): its digest goes into every report."""

    @model_validator(mode="after")
    def _rows_exist(self) -> "Card":
        ids = [h.id for h in self.hypotheses]
        if len(set(ids)) != len(ids):
            raise ValueError("hypothesis ids must be distinct")
        for name, budget in self.budgets.items():
            variants = set((budget.study.get("variants") or {}))
            for h in self.hypotheses:
                for row in (h.treatment, h.baseline):
                    if row is not None and row not in variants:
                        raise ValueError(f"budget {name}: hypothesis {h.id} names row {row!r}, which is not a "
                                         f"variant of its study ({', '.join(sorted(variants))})")
            seen = set(PILOT_SEEDS) | {s for old in self.history for s in (old.get("seeds") or [])}
            if seen & set(budget.replication_seeds):
                raise ValueError(f"budget {name}: replication_seeds {sorted(seen & set(budget.replication_seeds))} were "
                                 f"run before (a pilot's or an earlier version's): a replication runs fresh seeds")
        return self

    def study_name(self, budget: str) -> str:
        return f"reproduce-{self.card}-{budget}-v{self.version}"

    def outside_seeds_problem(self, budget: str, seeds: list[int], label: str) -> str | None:
        """Why ``seeds`` and ``label`` cannot make a replication outside the project of this version's
        ``budget`` (None where they can): the seeds distinct, from :data:`OUTSIDE_SEEDS_FROM` up (never
        a seed the project runs), and at least as many as the registered design's runs (fewer could not
        detect its effects of interest at the power the card states); the label a short name
        (:data:`LABEL`)."""
        if not re.match(LABEL, label or ""):
            return f"--label {label!r}: a short lower-case name of who ran it (letters, digits, '-'; e.g. lab-x)"
        if len(set(seeds)) != len(seeds):
            return f"--seeds {seeds}: the seeds must be distinct"
        low = sorted(s for s in seeds if s < OUTSIDE_SEEDS_FROM)
        if low:
            return (f"--seeds {low}: below {OUTSIDE_SEEDS_FROM}, where the project's own cards, pilots and "
                    f"replications draw theirs: a replication outside the project takes seeds from "
                    f"{OUTSIDE_SEEDS_FROM} up")
        design = len(self.budgets[budget].study.get("seeds") or [])
        if len(seeds) < design:
            return (f"--seeds: {len(seeds)} seeds, fewer than the {design} runs of version {self.version}'s "
                    f"design (its power to detect each effect of interest rests on them)")
        return None


def card_path(name: str) -> Path:
    """A card by name (``configs/reproductions/NAME.yaml``) or by path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = CARD_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CARD_DIR.glob("*.yaml")) if CARD_DIR.is_dir() else []
    raise ConfigError(f"reproduction card {name!r} not found (cards: {', '.join(known) or 'none'})")


def load_card(name: str) -> tuple[Card, Path]:
    path = card_path(name)
    raw = read_yaml(path, "reproduction card", "a reproduction card")
    for budget in (raw.get("budgets") or {}).values() if isinstance(raw, dict) else ():
        if isinstance(budget, dict) and isinstance(budget.get("sweep"), str):
            if "study" in budget:
                raise ConfigError(f"{path}: a budget gives its study inline (study:) or as a sweep file (sweep:), "
                                  f"not both")
            budget["study"] = _sweep_as_study(path.parent / budget["sweep"])
    try:
        card = Card.model_validate(raw)
        card._source = path
        return card, path
    except ValidationError as exc:
        raise ConfigError(problems=[f"{path}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                    for e in exc.errors()]) from None


def _sweep_as_study(sweep_path: Path) -> dict[str, Any]:
    """A sweep file as a card's study: its experiment made absolute, less what the card decides."""
    if not sweep_path.is_file():
        raise ConfigError(f"reproduction card: sweep file {sweep_path} not found")
    sweep = read_yaml(sweep_path, "sweep", "a sweep")
    study = {k: v for k, v in sweep.items() if k not in ("name", "metric", "mode")}
    if "experiment" in study and not Path(study["experiment"]).is_absolute():
        study["experiment"] = str((sweep_path.parent / study["experiment"]).resolve())
    return study


def all_cards() -> list[str]:
    return sorted(p.stem for p in CARD_DIR.glob("*.yaml")) if CARD_DIR.is_dir() else []
