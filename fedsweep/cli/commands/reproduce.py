"""``fedsweep reproduce NAME [--budget cpu|gpu-small|gpu] [--pilot]``: run a reproduction card and judge its hypotheses."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console

HELP = """Run a reproduction card (configs/reproductions/NAME.yaml): the study of the chosen budget,
then one verdict per pre-registered hypothesis, the run (seed) as the unit — reproduced (the claimed
direction, significant after Holm), contradicted (significant, the other direction), not detected
(the runs could have detected the card's smallest effect of interest at 80 % power) or undecided
(they could not; or fewer than 3 runs, or no spread) — written to results/reproductions/NAME/BUDGET-vN.md
with every (run, client) value in BUDGET-vN.csv, and logged to the study's MLflow parent run.

--replicate runs the newest version's design unchanged on the card's replication_seeds (a block no
version or pilot has run) and writes BUDGET-vN-replication.{md,csv,png} beside the original. Outside
the project, --replicate --seeds 1000-1003 --label NAME runs it on seeds you choose (from 1000 up, where
the project never draws; at least the design's number of runs) and writes
BUDGET-vN-replication-NAME.{md,csv,png}: send it back to be committed beside the others.

Budgets: cpu — SmolLM2-135M (bundled) on the bundled reasoning-gym data, sized for 2 CPU cores
(each card states its minutes); gpu-small — the same bundled model with its real weights on one
GPU, 16-20 clients and 20+ rounds, sized for 8 minutes on one H100; gpu — the paper's scale where
it can be had (its model, more clients and rounds; a GPU cluster: submit it as a Ray job).

Before a card version runs, --pilot runs its study on seeds no card tests (100-102) and says, per
hypothesis, the run-level spread and how many seeds detect the effect the card names
(results/reproductions/NAME/BUDGET-vN-pilot.json): the card's seeds are fixed from it.
Cards: fedsweep reproduce --list."""


def add(sub) -> None:
    p = sub.add_parser("reproduce", help="run a paper's reproduction card and judge its pre-registered hypotheses",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("card", nargs="?", help="a card's name (configs/reproductions/NAME.yaml) or path; 'all': every card")
    p.add_argument("--budget", choices=["cpu", "gpu-small", "gpu"], default="cpu",
                   help="cpu: SmolLM2-135M on 2 cores (default); gpu-small: the bundled model on one GPU "
                        "(8 minutes on an H100); gpu: the paper's scale")
    p.add_argument("--pilot", action="store_true",
                   help="run the card's study on the pilot seeds (100-102) and size its seeds: each "
                        "hypothesis's run-level spread and the runs its named effect needs; judges nothing")
    p.add_argument("--replicate", action="store_true",
                   help="run the newest version's registered design unchanged on the card's replication_seeds "
                        "(fresh seeds, no pilot, no look): BUDGET-vN-replication.{md,csv,png}")
    p.add_argument("--seeds", default=None, metavar="SEEDS",
                   help="with --replicate and --label: a replication outside the project on these seeds "
                        "(1000,1001,1002 or 1000-1003; from 1000 up, at least the design's runs) instead of "
                        "the card's: BUDGET-vN-replication-LABEL.{md,csv,png}")
    p.add_argument("--label", default=None, metavar="NAME",
                   help="with --replicate --seeds: who ran the replication (lower-case letters, digits, '-'), "
                        "the report's name")
    p.add_argument("--ledger", action="store_true",
                   help="print the ledger's tables from the committed reports under reproductions/ (with "
                        "--write: rewrite the generated section of docs/reproductions.md); runs nothing")
    p.add_argument("--write", action="store_true", help="with --ledger: rewrite docs/reproductions.md's section")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the study's base experiment (a changed card is a new version: "
                        "use this to try, not to report)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted card; finished trials are kept")
    p.add_argument("--list", action="store_true",
                   help="list the cards, their hypotheses and their reports, each report saying whether it is "
                        "current: where its methods' code changed since the commit it ran at, the card's "
                        "numerics fingerprint (a short trial per arm, run at HEAD and cached) against the one "
                        "recorded at that commit decides")
    p.add_argument("--fail-stale", action="store_true",
                   help="with --list: exit 1 where a report the ledger counts (each card's newest version and "
                        "its replication, their latest re-runs) is stale and not listed as owed in "
                        "reproductions/reruns_owed.yaml, or is listed there and current")
    p.add_argument("--fingerprint", action="store_true",
                   help="record the card's (or every card's) numerics fingerprint at HEAD, or at --at COMMIT, in "
                        "reproductions/NAME/fingerprints.json.gz (a card run records it with its report)")
    p.add_argument("--at", default=None, metavar="COMMIT",
                   help="with --fingerprint: at this commit (a temporary worktree, today's cards)")
    p.add_argument("--check", action="store_true",
                   help="validate the card and every trial of its study (data, partitions), run nothing")
    p.add_argument("--verify", metavar="REPORT", default=None,
                   help="recompute every verdict of a card report (BUDGET-vN.md) from the values in its CSV "
                        "beside it, and say whether each matches; runs nothing")
    p.add_argument("--figure", metavar="REPORT", default=None,
                   help="draw a card report's figure (BUDGET-vN.png beside it: each hypothesis's runs, mean, "
                        "intervals, reference and named effect) from the CSV beside it; runs nothing")
    p.add_argument("--bitwise", action="store_true",
                   help="run one trial of each variant of the card's (or every card's) cpu study to its end and "
                        "write the digest of every tensor and JSON file of its final checkpoint to --out; with "
                        "--compare BEFORE AFTER, say which trials are bitwise equal (exit 1 where any is not)")
    p.add_argument("--variants", nargs="*", default=None, metavar="NAME", help="with --bitwise: only these variants")
    p.add_argument("--seed", type=int, default=None, help="with --bitwise: this seed instead of the study's first")
    p.add_argument("--out", default=None, metavar="FILE", help="with --bitwise: the JSON the digests go to")
    p.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE", "AFTER"),
                   help="with --bitwise: compare two digest files, run nothing")
    p.set_defaults(handler=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    from fedsweep.config.card import all_cards, load_card
    from fedsweep.errors import ConfigError

    if args.bitwise:
        return _bitwise(args)
    if args.fingerprint:
        return _fingerprint(args)
    if args.verify:
        return _verify(args.verify)
    if args.ledger:
        return _ledger(args.write)
    if args.figure:
        return _figure(args.figure)
    if args.list or not args.card:
        return _list(args, all_cards, load_card)
    from fedsweep.reproduce.card_run import check_card, run_card

    names = all_cards() if args.card == "all" else [args.card]
    if args.card == "all":  # 'all' runs the cards that have this budget, and says which it left
        lacking = [n for n in names if args.budget not in load_card(n)[0].budgets]
        for name in lacking:
            console.print(f"[dim]{name}: no {args.budget} budget, left out[/]", highlight=False)
        names = [n for n in names if n not in lacking]
    if args.check:
        for name in names:
            console.print(check_card(name, args.budget, args.overrides), highlight=False)
        return 0
    if not names:
        raise ConfigError("no reproduction cards found under configs/reproductions/")
    outside = _outside(args)
    if args.pilot:
        return _pilots(names, args)
    for name in names:
        card, outcomes, path = run_card(name, args.budget, args.overrides,
                                        lambda line: console.print(f"[dim]{line}[/]", highlight=False),
                                        resume=args.resume, replication=args.replicate, outside=outside)
        which = f", replication outside the project: {outside.label}" if outside else ", replication" if args.replicate else ""
        console.print(f"[bold]{card.card}[/] v{card.version} ({args.budget}{which}):")
        for o in outcomes:
            extra = f"; detectable effect {o.mde:.3g}" if o.mde is not None and o.mde == o.mde else ""
            console.print(f"  {o.id}: [bold]{o.verdict}[/] (estimate {o.estimate:+.4g} [{o.low:.4g}, {o.high:.4g}], "
                          f"p {o.p:.3g}, Holm {o.p_holm:.3g}{extra})", highlight=False)
        console.print(f"  report: {path}", highlight=False)
    return 0


def _outside(args: argparse.Namespace):
    """``--seeds`` and ``--label`` as a replication outside the project (None without them)."""
    from fedsweep.errors import ConfigError
    from fedsweep.reproduce.card_run import Outside

    if args.seeds is None and args.label is None:
        return None
    if args.seeds is None or args.label is None or not args.replicate:
        raise ConfigError("a replication outside the project takes all three: --replicate --seeds SEEDS --label NAME")
    return Outside(tuple(parse_seeds(args.seeds)), args.label)


def parse_seeds(text: str) -> list[int]:
    """``1000,1001,1002`` or ``1000-1003`` (both ends included), or both mixed, as a list of seeds."""
    from fedsweep.errors import ConfigError

    seeds = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ConfigError(f"--seeds {text!r}: comma-separated seeds or ranges such as 1000-1003")
        seeds += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    return seeds


def _ledger(write: bool) -> int:
    from pathlib import Path

    from fedsweep.reproduce import ledger

    if write:
        doc = Path("docs/reproductions.md")
        changed = ledger.write(doc)
        console.print(f"{doc}: ledger section {'rewritten' if changed else 'already current'}", highlight=False)
    else:
        console.print(ledger.table(), highlight=False, markup=False)
    return 0


def _pilots(names: list[str], args: argparse.Namespace) -> int:
    from fedsweep.reproduce.pilot import lines
    from fedsweep.reproduce.card_run import run_pilot

    for name in names:
        card, result, path = run_pilot(name, args.budget, args.overrides,
                                       lambda line: console.print(f"[dim]{line}[/]", highlight=False),
                                       resume=args.resume)
        console.print(f"[bold]{card.card}[/] v{card.version} ({args.budget}) pilot, seeds "
                      f"{', '.join(map(str, result['seeds']))}, {result['minutes']} min:")
        for line in lines(result):
            console.print(f"  {line}", highlight=False)
        console.print(f"  pilot: {path}", highlight=False)
    return 0


def _verify(path: str) -> int:
    """``--verify REPORT``: 0 where every outcome recomputes from the CSV, 1 with the differences."""
    from pathlib import Path

    from fedsweep.errors import ConfigError
    from fedsweep.reproduce.card_report import read_block, verify

    report = Path(path)
    if not report.is_file():
        raise ConfigError(f"--verify {path}: no such report")
    problems = verify(report)
    block = read_block(report.read_text())
    prov = block["provenance"]
    if problems:
        console.print(f"[red]{report}: {len(problems)} difference(s) from its values[/]", highlight=False)
        for p in problems:
            console.print(f"  {p}", highlight=False)
        return 1
    from fedsweep.reproduce.card_units import is_legacy

    form = ("its per-run values (written before 2026-11-28, under those rules)"
            if is_legacy(report.with_suffix(".csv").read_text()) else "its (run, client) values")
    console.print(f"{report}: every one of {len(block['outcomes'])} verdicts recomputes from "
                  f"{report.with_suffix('.csv').name}, {form} (commit {prov['commit']})", highlight=False)
    return 0


def _figure(path: str) -> int:
    """``--figure REPORT``: the report's figure beside it, with the named effects of its card where the
    card's current version is the report's."""
    from pathlib import Path

    from fedsweep.config.card import load_card
    from fedsweep.errors import ConfigError
    from fedsweep.reproduce.card_figure import draw_report

    report = Path(path)
    if not report.is_file():
        raise ConfigError(f"--figure {path}: no such report")
    try:
        card, _ = load_card(report.parent.name)
    except ConfigError:
        card = None  # a report outside a card's folder: drawn without named effects
    console.print(f"figure: {draw_report(report, card)}", highlight=False)
    return 0


def _list(args: argparse.Namespace, all_cards, load_card) -> int:
    """``--list``: every card, its hypotheses and its reports, each report current or stale (counted: the
    reports the ledger counts); with ``--fail-stale`` 1 where a counted report is stale."""
    from pathlib import Path

    from fedsweep.reproduce import ledger
    from fedsweep.reproduce.card_report import staleness
    from fedsweep.reproduce.fingerprint import Judge

    judge = Judge(Path.cwd(), say=lambda line: console.print(f"    {line}", style="dim", highlight=False, markup=False))
    counted = {r.path.resolve() for pair in ledger.newest(ledger.reports(Path("reproductions"))) for r in pair if r}
    stale_counted: list[Path] = []
    for name in all_cards():
        card, _ = load_card(name)
        console.print(f"[bold]{card.card}[/] v{card.version} — {card.paper} ({', '.join(card.budgets)})")
        for h in card.hypotheses:
            console.print(f"  {h.id}: {h.claim}", highlight=False)
        for folder in (Path("results/reproductions") / name, Path("reproductions") / name):
            for report in sorted(folder.glob("*.md")) if folder.is_dir() else []:
                mark = report.resolve() in counted
                line = staleness(card, report, judge if mark or not args.fail_stale else None)
                if mark and "stale" in line:
                    stale_counted.append(report)
                console.print(f"  [dim]report{' (counted)' if mark else ''} {line}[/]", highlight=False)
    console.print(f"{len(counted) - len(stale_counted)} of {len(counted)} counted reports current"
                  + (f"; stale: {', '.join(map(str, stale_counted))}" if stale_counted else "")
                  + (f" (fingerprints run at HEAD: {', '.join(judge.computed)})" if judge.computed else ""),
                  highlight=False)
    if not args.list:
        return 2
    if not args.fail_stale:
        return 0
    here = Path.cwd().resolve()
    as_committed = lambda p: p.resolve().relative_to(here).as_posix()  # noqa: E731
    problems = ledger.owed_problems([as_committed(p) for p in stale_counted], [as_committed(p) for p in counted],
                                    ledger.owed(Path("reproductions")))
    for line in problems:
        console.print(f"[red]{line}[/]", highlight=False)
    owed_runs = ledger.owed(Path("reproductions"))
    if owed_runs:
        console.print(f"{len(owed_runs)} re-run(s) owed (reproductions/{ledger.OWED}): "
                      + ", ".join(owed_runs), highlight=False)
    return 1 if problems else 0


def _fingerprint(args: argparse.Namespace) -> int:
    """``--fingerprint [--at COMMIT]``: record the card's (every card's) fingerprint at HEAD or ``COMMIT``."""
    from fedsweep.config.card import all_cards
    from fedsweep.provenance import git_commit
    from fedsweep.reproduce import fingerprint

    def say(line: str) -> None:
        console.print(line, style="dim", highlight=False, markup=False)

    cards = all_cards() if args.card in (None, "all") else [args.card]
    if args.at:
        found = fingerprint.at_commit(args.at, cards, say=say)
    else:
        if git_commit().endswith("+dirty"):
            from fedsweep.errors import ConfigError

            raise ConfigError("--fingerprint records HEAD's numbers: commit or stash the changes first (or --at COMMIT)")
        found = fingerprint.collect(cards, say=say)
    failed = [f"{c}/{a}" for c, entry in found.items() for a, one in entry["arms"].items() if "error" in one]
    for card, entry in found.items():
        console.print(f"{card}: {len(entry['arms'])} arms at {entry['commit'][:12]} → {fingerprint.store(card, entry)}",
                      highlight=False)
    if failed:
        console.print(f"[red]failed arms (recorded as failed): {', '.join(failed)}[/]", highlight=False)
    return 1 if failed else 0


def _bitwise(args: argparse.Namespace) -> int:
    """``--bitwise``: the trials' digests to ``--out``, or two digest files compared."""
    import json
    from pathlib import Path

    from fedsweep.errors import ConfigError
    from fedsweep.reproduce import bitwise

    def say(line: str) -> None:
        console.print(line, highlight=False, markup=False)

    if args.compare:
        return bitwise.compare(*(json.loads(Path(f).read_text()) for f in args.compare), say=say)
    if not args.out:
        raise ConfigError("--bitwise needs --out FILE (the digests) or --compare BEFORE AFTER")
    cards = None if args.card in (None, "all") else [args.card]
    bitwise.collect(cards, args.variants, args.seed, args.out, say=say)
    return 0
