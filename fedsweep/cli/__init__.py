"""The ``fedsweep`` command: one parser assembled from ``cli/commands/``, one error handler.

    fedsweep run CONFIG [--set path=value ...] [--resume]   run one experiment
    fedsweep validate CONFIG [--set path=value ...]         check config and data, start nothing
    fedsweep algorithms                                     list methods and their hyperparameters
    fedsweep tune SWEEP [--set path=value ...] [--resume]   a Ray Tune study, MLflow parent + child runs
    fedsweep reproduce NAME [--budget cpu|gpu]              a paper's reproduction card: study, then verdicts
    fedsweep compare --experiment NAME                      Markdown table and plots from MLflow
    fedsweep runs [--experiment NAME]                       studies and runs in the store: status, metric, checkpoints
    fedsweep submit FILE --address http://HEAD:8265         run an experiment or a study as a Ray job
    fedsweep jobs status|logs|stop ID                       follow a submitted job
    fedsweep bench aggregation --algorithm NAME [...]       time server aggregation; JSON in results/bench/
    fedsweep bench consensus [--clients K --prompts M]      time FedCoFiT's server consensus
    fedsweep bench memory CONFIG [--clients 1,50]           device memory of packed vs one-base-per-client actors
    fedsweep bench throughput CONFIG                        training tokens/s: a ClientActor vs a plain loop
    fedsweep params --model-config NAME [--rank R ...]      adapter sizes and bytes from a model config
    fedsweep plan CONFIG [--gpu-memory 80GB]                memory per actor and how many clients fit a GPU

Each command is a module in ``cli/commands/`` with ``add(subparsers)`` (its arguments,
and its handler as the parser default) and the handler. Errors a user can fix (every
:class:`~fedsweep.errors.FedsweepError`) end with one line per problem on stderr and exit code 2.
"""

from __future__ import annotations

import argparse

from fedsweep.cli.commands import (algorithms, bench, compare, params, plan, reproduce, run, runs, submit,
                                                tune, validate)
from fedsweep.cli.views import err

COMMANDS = (run, validate, algorithms, tune, reproduce, compare, runs, submit, bench, params, plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsweep", description="Federated fine-tuning of LLMs on Ray.")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full Python traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fedsweep.env import apply_defaults

    apply_defaults()  # RAY_AUTH_MODE: left to the user (ray_runtime.py)
    args = build_parser().parse_args(argv)
    from rich.markup import escape

    from fedsweep.errors import FedsweepError, printable

    try:
        return args.handler(args)
    except FedsweepError as exc:
        if args.debug:
            raise
        for problem in getattr(exc, "problems", None) or [str(exc)]:  # a config lists every problem it has
            err.print(f"[red]error[/]: {escape(printable(problem))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: the last complete round is checkpointed; continue with --resume")
        return 130
    except Exception as exc:  # anything else (Ray, the OS, a bug): one line; the trace with --debug
        if args.debug:
            raise
        from fedsweep.orchestrator.runner import root_cause

        where = f"fedsweep {args.command}"
        err.print(f"[red]error[/]: {where}: {type(exc).__name__}: {escape(printable(root_cause(exc)))} "
                  "(--debug shows the traceback)", highlight=False, soft_wrap=True)
        return 1

