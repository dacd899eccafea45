"""``fedsweep validate CONFIG``: check an experiment or sweep file and its data; starts nothing."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import add_config_args, console


def add(sub) -> None:
    p = sub.add_parser("validate", help="validate a config (or sweep) and its data; starts nothing")
    add_config_args(p)
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.runner import validate_file
    from fedsweep.orchestrator.jobs import kind_of

    if kind_of(args.config) == "tune":  # a sweep file: every variant and space value against its base
        from fedsweep.config.sweep import load_sweep, trial_count

        sweep, _ = load_sweep(args.config, args.overrides)
        console.print(f"[green]ok[/]: {args.config} — study {sweep.name}: {trial_count(sweep)} trials of "
                      f"{sweep.experiment}, metric {sweep.metric} ({sweep.mode})")
        return 0
    cfg, clients = validate_file(args.config, args.overrides)
    sizes = [len(c.train) for c in clients]
    actors = f"{cfg.num_actors} actors" if cfg.layout_chosen else "actor layout auto: chosen from the cluster at start"
    console.print(f"[green]ok[/]: {args.config} — {cfg.algorithm}, {cfg.clients.num_clients} clients "
                  f"({actors}), {cfg.rounds} rounds, model {cfg.model.name}, "
                  f"{cfg.partition.scheme} split: {min(sizes)}–{max(sizes)} train examples per client")
    return 0
