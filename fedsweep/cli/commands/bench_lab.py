"""``fedsweep bench archive``: the lab's own subcommands of ``fedsweep bench`` (what the measurements
leave behind), beside the benchmarks in ``cli/commands/bench.py``."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console


def add(bench) -> None:
    a = bench.add_parser("archive", help="list a measurement folder's files in benchmarks/manifest.json (path, "
                                         "commit, SHA-256) and remove it from the tree: git's history keeps it")
    a.add_argument("folders", nargs="*", metavar="FOLDER", help="folders under benchmarks/raw/, committed unchanged")
    a.add_argument("--check", action="store_true",
                   help="archive nothing: check that every listed file reads back from git with its digest and "
                        "that every benchmarks/raw/ path the documents cite is in the tree or the manifest")
    a.set_defaults(handler=cmd_bench_archive)


def cmd_bench_archive(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedsweep.bench import evidence
    from fedsweep.errors import ConfigError

    root = Path.cwd()
    if args.check:
        wrong = evidence.verify(root) + [f"cited, not kept: {c}" for c in evidence.uncited(root)]
        for line in wrong:
            console.print(f"[red]{line}[/]")
        console.print(f"{len(evidence.load(root)['files'])} files listed; "
                      f"{'all read back' if not wrong else f'{len(wrong)} problem(s)'}")
        return 1 if wrong else 0
    if not args.folders:
        raise ConfigError("fedsweep bench archive: name the folders under benchmarks/raw/ to archive (or --check)")
    try:
        added = evidence.archive(root, args.folders)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console.print(f"{len(added)} file(s) listed in {evidence.MANIFEST} and removed from the tree; "
                  f"commit the manifest and the removal together")
    return 0
