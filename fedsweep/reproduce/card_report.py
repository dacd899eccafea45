"""A card's report: per hypothesis its role, the test, the unit, n, the deciding p, the decision interval,
the verdict and the effect of interest it was judged against; its provenance (the commit, digests of the card and the study's configs, package versions);
and :func:`verify`, which recomputes every verdict from the CSV of tested values beside the report.

A report ``BUDGET-vN.md`` has its values in ``BUDGET-vN.csv`` (``reports.card_units``); its last
section holds a JSON block with the provenance and each outcome as printed, which ``verify`` compares
with the outcomes recomputed from the CSV.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import yaml

from fedsweep.config.card import OUTSIDE_SEEDS_FROM
from fedsweep.errors import ConfigError
from fedsweep.provenance import git_commit
from fedsweep.reports import verdicts as vd

PACKAGES = ("torch", "transformers", "peft", "ray", "mlflow", "numpy", "scipy", "fedsweep")
JSON_HEAD = "## Provenance and outcomes (machine-readable)"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def provenance(card_path: Path | None, configs: list[Path]) -> dict:
    """What a reader needs to know the report's origin: commit, digests, versions, the machine."""
    from fedsweep.machine import machine

    known = card_path is not None and Path(card_path).is_file()
    return {"commit": git_commit(), "card": str(card_path), "card_sha256": sha256(card_path) if known else "unknown",
            "configs": {str(p): sha256(p) for p in configs if Path(p).is_file()}, "packages": package_versions(),
            "machine": machine()}


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.4g}"


def outcome_record(o: vd.Outcome) -> dict:
    """An outcome as the report keeps it (and ``verify`` compares)."""
    return {"id": o.id, "kind": o.kind, "test": o.test, "unit": o.unit, "n": o.n, "estimate": o.estimate,
            "p": o.p, "p_holm": o.p_holm, "verdict": o.verdict, "mde": o.mde,
            "decision_interval": [o.decision_low, o.decision_high]}


def report(card, budget: str, outcomes: list[vd.Outcome], minutes: float | None, command: str,
           prov: dict | None = None, replication: bool = False, seeds: list | None = None,
           outside: str | None = None) -> str:
    """The card report in Markdown: one row per hypothesis, the pre-registration it tested, provenance;
    ``outside``: the label of a replication run outside the project, on seeds its runner chose."""
    b = card.budgets[budget]
    m = sum(1 for o in outcomes if o.undecided is None)
    title = f"# Reproduction card: {card.card} (version {card.version}, {budget} budget" + \
        (f", replication outside the project: {outside})" if outside else
         ", replication on fresh seeds)" if replication else ")")
    lines = [title, "",
             f"Paper: *{card.paper}*. Hypotheses registered {card.registered}. The unit is the run (seed): each "
             f"test takes one value per run, derived from the (run, client) values in the CSV beside this report "
             f"(a per-client metric's mean over the run's clients); Student's t (paired by seed, Welch's for rows "
             f"on different data, one-sample for thresholds), two-sided, Holm over the {m} hypotheses with a "
             f"p-value, α = {card.alpha}; the decision interval is at level 1 − α/{max(m, 1)}. Without a "
             f"significant result a hypothesis is *not detected* where these runs could have detected its "
             f"smallest effect of interest (stated in the card before the run) at 80 % power, and *undecided* "
             f"where they could not, or where fewer than {vd.MIN_UNITS} runs or no spread give no p-value.", ""]
    if outside:
        lines += [f"A replication outside the project ({outside}): the design of version {card.version} unchanged, "
                  f"on seeds {', '.join(map(str, seeds or []))}, chosen by whoever ran it from "
                  f"{OUTSIDE_SEEDS_FROM} up, where no card version, pilot or declared replication of the project "
                  f"draws its seeds. The original's report is `{budget}-v{card.version}.md`.", ""]
    elif replication:
        lines += [f"A replication: the design of version {card.version} unchanged, on seeds "
                  f"{', '.join(map(str, b.replication_seeds))} (declared in the card with the version, never run "
                  f"before it: no pilot, no look). The original's report is `{budget}-v{card.version}.md`.", ""]
    lines += [f"Command: `{command}`" + (f" — {minutes:.1f} min on this machine." if minutes else ""), ""]
    if prov:
        lines += [f"Commit `{prov['commit']}`; card sha256 `{prov['card_sha256'][:16]}…`; values tested: the CSV "
                  f"beside this report (`fedsweep reproduce --verify` recomputes every verdict from it).", ""]
    lines += ["| hypothesis | paper | ours: estimate [95 % CI] | test | unit | n | p | p (Holm) | decision interval | "
              "verdict | effect of interest | detectable effect (80 % power) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_id = {h.id: h for h in card.hypotheses}
    for o in outcomes:
        h = by_id[o.id]
        what = (("log(baseline / treatment)" if h.log else "baseline / treatment") if h.ratio
                else "treatment − baseline") if h.baseline else "value"
        est = f"{_fmt(o.estimate)} [{_fmt(o.low)}, {_fmt(o.high)}] ({what}, {h.metric})"
        side = ">" if o.claim_sign > 0 else "<"
        role = f" *({h.role})*"
        lines.append(f"| {h.id}{role}: {h.claim} | {h.paper} | {est} | {o.test} (claim: {side} {_fmt(o.reference)}) | "
                     f"{o.unit} | {o.n} | {_fmt(o.p)} | {_fmt(o.p_holm)} | [{_fmt(o.decision_low)}, "
                     f"{_fmt(o.decision_high)}] | **{o.verdict}** | {_fmt(h.effect)} | "
                     f"{_fmt(o.mde) if o.mde is not None else ''} |")
    lines += ["", "Verdicts by role: " + role_counts(card, outcomes) + ".", "", "Effects of interest, and why:", ""]
    lines += [f"- {h.id}: {_fmt(h.effect)} — {h.effect_basis}" for h in card.hypotheses]
    notes = [f"- {o.id}: {n}" for o in outcomes for n in o.notes]
    if notes:
        lines += ["", "Notes:", ""] + notes
    lines += ["", "## How this budget differs from the paper", "", b.differs, "", "## The study", ""] + \
        ([f"The sweep file `{b.sweep}` (relative to the card), as run:", ""] if b.sweep else []) + \
        ["```yaml", yaml.safe_dump(b.study, sort_keys=False).rstrip(), "```", ""]
    if prov is not None:
        block = {"provenance": prov, "rules": vd.RULES, "roles": {h.id: h.role for h in card.hypotheses},
                 "effects": {h.id: h.effect for h in card.hypotheses},
                 "replication": replication, "seeds": seeds, **({"outside": outside} if outside else {}),
                 "outcomes": [outcome_record(o) for o in outcomes]}
        lines += [JSON_HEAD, "", "```json", json.dumps(block, indent=1), "```", ""]
    return "\n".join(lines)


ROLE_NAMES = (("claim", "quality claims"), ("property", "properties"), ("calibration", "calibration checks"),
              ("arithmetic", "arithmetic checks"))
"""The roles, in the order reports and the ledger count them (``config.card.Hypothesis.role``)."""


def role_counts(card, outcomes, roles: dict | None = None) -> str:
    """Each role's verdicts counted apart (the methods' quality claims first); ``roles`` by id, or the
    card's."""
    roles = roles or {h.id: h.role for h in card.hypotheses}
    parts = []
    for role, name in ROLE_NAMES:
        mine = [o.verdict if isinstance(o, vd.Outcome) else o["verdict"] for o in outcomes
                if roles.get(o.id if isinstance(o, vd.Outcome) else o["id"]) == role]
        if mine:
            counts = ", ".join(f"{mine.count(v)} {v}" for v in vd.VERDICTS if v in mine)
            parts.append(f"{name} {len(mine)} ({counts})")
    return "; ".join(parts)


def read_block(text: str) -> dict:
    """The report's machine-readable block."""
    if JSON_HEAD not in text:
        raise ConfigError("this report has no provenance block (written before reports carried their values): "
                          "it cannot be verified; re-run the card")
    body = text.split(JSON_HEAD, 1)[1]
    return json.loads(body.split("```json", 1)[1].split("```", 1)[0])


def _close(a, b) -> bool:
    """Equal as the report keeps them: numbers within 1e-9 relative (NaN equal to NaN), others exactly."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


def verify(report_path: Path) -> list[str]:
    """Recompute every outcome of the report at ``report_path`` from its CSV; the differences found
    (empty: it verifies)."""
    from fedsweep.reproduce.card_units import from_csv, inconsistent, is_legacy

    report_path = Path(report_path)
    csv_path = report_path.with_suffix(".csv")
    if not csv_path.is_file():
        raise ConfigError(f"{csv_path} not found: a report's values lie beside it as BUDGET-vN.csv")
    block = read_block(report_path.read_text())
    kept = {o["id"]: o for o in block["outcomes"]}
    text = csv_path.read_text()
    again = {o.id: outcome_record(o) for o in from_csv(text)}
    problems = inconsistent(text)
    rules = block.get("rules", 1)
    if (rules == 1) != is_legacy(text):
        problems.append(f"the report says rules {rules}, its CSV is of the "
                        f"{'per-run (rules 1)' if is_legacy(text) else 'per-client (rules 2)'} form")
    if set(kept) != set(again):
        problems.append(f"hypotheses differ: report {sorted(kept)}, CSV {sorted(again)}")
    for hid in sorted(set(kept) & set(again)):
        for key, value in kept[hid].items():
            other = again[hid][key]
            pair = zip(value, other) if isinstance(value, list) else [(value, other)]
            if not all(_close(a, b) for a, b in pair):
                problems.append(f"{hid}.{key}: report {value}, recomputed {other}")
    return problems


def method_paths(card, root: Path | None = None) -> list[str]:
    """The code a card's verdicts depend on (:mod:`.numerics_paths`): the files its trials reach,
    with the modules of the methods its studies run and what they import."""
    from fedsweep.reproduce.numerics_paths import watched_files

    names = {card_variant_algorithm(v, b.study) for b in card.budgets.values()
             for v in (b.study.get("variants") or {}).values()}
    return watched_files([n for n in names if n], root)


def card_variant_algorithm(variant: dict, study: dict) -> str | None:
    """The method a study row runs: the variant's ``algorithm``, else the study's ``set``'s."""
    if isinstance(variant, dict) and variant.get("algorithm"):
        return variant["algorithm"]
    for item in study.get("set") or []:
        if isinstance(item, str) and item.startswith("algorithm="):
            return item.split("=", 1)[1]
    return None


def changed_since(commit: str, paths: list[str], root: Path | None = None) -> list[str] | None:
    """Files under ``paths`` whose code differs from ``commit``'s, a file followed by its content where it
    moved (``numerics_paths.changed_code``); None where the commit is unknown to this checkout."""
    from fedsweep.reproduce.numerics_paths import changed_code

    base = commit.split("+")[0]
    if not base or base == "unknown":
        return None
    return changed_code(base, paths, root)


def _repo_relative(path: str) -> str | None:
    """A config path as the report recorded it (absolute on the machine that ran) → its path in the
    repository (from its ``configs/`` folder on), or None."""
    parts = Path(path).parts
    return Path(*parts[parts.index("configs"):]).as_posix() if "configs" in parts else None


def _yaml_at(commit: str, rel: str, root: Path | None = None):
    """The parsed YAML of ``rel`` at ``commit`` (None where it was not there)."""
    from fedsweep.reproduce.numerics_paths import _git

    raw = _git(["show", f"{commit}:{rel}"], Path(root or Path.cwd()))
    return None if raw is None else yaml.safe_load(raw)


def _card_design(raw: dict | None, version: int, budget: str | None = None) -> dict | None:
    """What a card version's verdicts at ``budget`` depend on: its hypotheses, α and that budget (every
    budget where none is named; not its comments or history: a budget that never ran can change without
    touching another budget's report)."""
    if not isinstance(raw, dict) or raw.get("version") != version:
        return None
    budgets = raw.get("budgets")
    if budget is not None and isinstance(budgets, dict):
        budgets = budgets.get(budget)
    return {"hypotheses": raw.get("hypotheses"), "budgets": budgets, "alpha": raw.get("alpha", 0.05)}


def config_changes(card, block: dict, root: Path | None = None, budget: str | None = None) -> list[str]:
    """The card's design for the report's version and each config the report ran on, where what they say
    (parsed, comments aside) differs from the report's commit: the card's hypotheses, α and the report's
    ``budget`` (every budget where None), and every experiment file its provenance names."""
    base = Path(root or Path.cwd())
    prov = block["provenance"]
    commit = prov["commit"].split("+")[0]
    changed = []
    card_rel = _repo_relative(prov.get("card", "")) or (f"configs/reproductions/{card.card}.yaml")
    then = _card_design(_yaml_at(commit, card_rel, base), card.version, budget)
    now = _card_design(yaml.safe_load((base / card_rel).read_text()) if (base / card_rel).is_file() else None,
                       card.version, budget)
    if then is not None and then != now:
        changed.append(card_rel)
    for path in prov.get("configs", {}):
        rel = _repo_relative(path)
        if rel is None:
            continue
        now_file = base / rel
        if _yaml_at(commit, rel, base) != (yaml.safe_load(now_file.read_text()) if now_file.is_file() else None):
            changed.append(rel)
    return changed


def staleness(card, report: Path, fingerprints=None) -> str:
    """One line: the report's commit and whether its methods' code, its card's design or its configs
    changed since (or why unknown); a report of an older version than the card's says it is superseded.
    ``fingerprints`` (``fingerprint.Judge``): where only code changed, the card's fingerprint at the
    report's commit against HEAD's decides — the code changed but its numbers did not, or which did; a
    line with "stale" in it is a stale report, any other a current one."""
    found = re.search(r"-v(\d+)", report.stem)
    try:
        block = read_block(report.read_text())
        commit = block["provenance"]["commit"]
    except (ConfigError, KeyError, ValueError):
        if found and int(found.group(1)) != card.version:
            return f"{report}: superseded by the card's version {card.version}"
        return f"{report}: written before reports carried their commit; stale until re-run"
    if found and int(found.group(1)) != card.version:
        return f"{report}: at {commit[:12]}; superseded by the card's version {card.version}"
    changed = changed_since(commit, method_paths(card))
    if changed is None:
        return f"{report}: commit {commit} is not in this checkout; stale until re-run"
    budget = re.match(r"^(cpu|gpu-small|gpu)-v", report.name)
    configs = config_changes(card, block, budget=budget.group(1) if budget else None)
    if not changed and not configs:
        return f"{report}: at {commit[:12]}, its methods' code, card and configs unchanged since"
    files = (f"changed since in {len(changed + configs)} file(s) "
             f"({', '.join((configs + changed)[:3])}{', …' if len(changed + configs) > 3 else ''})")
    if configs or fingerprints is None:
        return f"{report}: at {commit[:12]}; {files}: stale until re-run"
    differ = fingerprints(card.card, commit.split("+")[0])
    if differ is None:
        return (f"{report}: at {commit[:12]}; {files}, no fingerprint at its commit (`fedsweep reproduce "
                f"{card.card} --fingerprint --at {commit[:12]}`): stale until re-run")
    if differ:
        return (f"{report}: at {commit[:12]}; its numbers changed since ({len(differ)} arm(s): "
                f"{' | '.join(differ[:2])}{' | …' if len(differ) > 2 else ''}): stale until re-run")
    return (f"{report}: at {commit[:12]}; code changed in {len(changed)} file(s) ({', '.join(changed[:3])}"
            f"{', …' if len(changed) > 3 else ''}), its fingerprint unchanged: current")
