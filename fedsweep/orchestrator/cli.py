"""The ``fedsweep`` command.

    fedsweep run CONFIG [--set path=value ...] [--resume]   run one experiment
    fedsweep validate CONFIG [--set path=value ...]         check config and data, start nothing
    fedsweep algorithms                                     list methods and their hyperparameters
    fedsweep tune SWEEP [--set path=value ...] [--resume]   a Ray Tune study, MLflow parent + child runs
    fedsweep compare --experiment NAME                      Markdown table and plots from MLflow
    fedsweep submit FILE --address http://HEAD:8265         run an experiment or a study as a Ray job
    fedsweep jobs status|logs|stop ID                       follow a submitted job
    fedsweep bench aggregation --algorithm NAME [...]       time server aggregation; JSON in results/bench/
    fedsweep bench consensus [--clients K --prompts M]      time FedCoFiT's server consensus
    fedsweep bench memory CONFIG [--clients 1,50]           device memory of packed vs one-base-per-client actors
    fedsweep bench throughput CONFIG                        training tokens/s: a ClientActor vs a plain loop
    fedsweep params --model-config NAME [--rank R ...]      adapter sizes and bytes from a model config
    fedsweep plan CONFIG [--gpu-memory 80GB]                memory per actor and how many clients fit a GPU

Errors in config, data or model end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=False)
err = Console(stderr=True)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML (e.g. configs/experiments/smoke.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set clients.num_clients=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsweep", description="Federated fine-tuning of LLMs on Ray.")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full Python traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run one experiment (tracked in MLflow, checkpointed every round)")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue the latest run of this config from its last complete round")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("validate", help="validate a config and its data; starts nothing")
    _add_config_args(p)
    sub.add_parser("algorithms", help="list registered methods with their hyperparameters and defaults")
    p = sub.add_parser("bench", help="measure speed; writes JSON under results/bench/")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("aggregation", help="server aggregation seconds per round on synthetic uploads of a real LoRA shape")
    b.add_argument("--algorithm", required=True, help="a registered method (see fedsweep algorithms)")
    b.add_argument("--clients", default="4,8,16,32,50", help="comma-separated client counts (default 4,8,16,32,50)")
    b.add_argument("--variant", help="the method's variant hyperparameter, e.g. sp or mst for drift")
    b.add_argument("--hp", action="append", default=[], metavar="NAME=VALUE", help="another hyperparameter (repeatable)")
    b.add_argument("--model", default="llama-3.1-8b", help="model config JSON (path or name in configs/models/)")
    b.add_argument("--rank", type=int, default=None, help="adapter rank (default: 16 for LoRA, 8 for ReFT)")
    b.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules")
    b.add_argument("--repeats", type=int, default=3, help="timed repetitions per client count (median reported)")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the server math runs")
    b.add_argument("--out", default="results/bench", help="output folder")
    c = bench.add_parser("consensus", help="FedCoFiT server seconds: embed K·M responses, cluster, select")
    c.add_argument("--clients", type=int, default=10, help="K (default 10)")
    c.add_argument("--prompts", type=int, default=500, help="M (default 500, the paper's budget)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out", default="results/bench", help="output folder")
    m = bench.add_parser("memory", help="device memory and round time: K clients on one base vs one base each")
    _add_config_args(m)
    m.add_argument("--clients", default="1,8", help="comma-separated client counts K (default 1,8)")
    m.add_argument("--separate-max", type=int, default=8, help="one-base-per-client actors measured at most (default 8)")
    m.add_argument("--rounds", type=int, default=1, help="rounds per layout (default 1)")
    m.add_argument("--out", default="results/bench", help="output folder")
    t = bench.add_parser("throughput", help="training tokens/s of one client: ClientActor vs a plain training loop")
    _add_config_args(t)
    t.add_argument("--repeats", type=int, default=3, help="alternating repeats (median reported)")
    t.add_argument("--out", default="results/bench", help="output folder")
    p = sub.add_parser("plan", help="memory per client actor from the model config alone, and how many clients fit a GPU")
    _add_config_args(p)
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB, 40GB, 24GiB (default 80GB)")
    p = sub.add_parser("tune", help="run a hyperparameter study (Ray Tune), one MLflow child run per trial")
    p.add_argument("sweep", help="sweep YAML (e.g. configs/sweeps/drift_delta.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the base experiment (or of the sweep file with sweep.PATH=VALUE)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted study; finished trials are kept")
    p.add_argument("--no-report", action="store_true", help="skip the comparison report at the end")
    p = sub.add_parser("compare", help="comparison report of an MLflow experiment: Markdown table and plots")
    p.add_argument("--experiment", required=True, help="MLflow experiment name (a study's or a config's name)")
    p.add_argument("--uri", default="sqlite:///results/mlflow.db", help="MLflow tracking URI")
    p.add_argument("--metric", default="accuracy", help="metric to compare (default accuracy)")
    p.add_argument("--out", default="results/reports", help="output folder (a subfolder per experiment)")
    p.add_argument("--all-runs", action="store_true",
                   help="every finished run of the experiment (default: the newest study's trials, if any)")
    p.add_argument("--baseline", default="fedavg",
                   help="method every other is tested against (paired Wilcoxon over clients × seeds; default fedavg)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="significance level for the bold marks and the report's statements (default 0.05)")
    p = sub.add_parser("submit", help="run an experiment or a study as a Ray job on a cluster; streams the logs")
    p.add_argument("file", help="experiment or sweep YAML (validated here before it is sent)")
    p.add_argument("--address", default=None, help="Ray dashboard / Jobs API, e.g. http://HEAD:8265 "
                   "(default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--python", default="python", help="interpreter on the cluster that has fedsweep (default python)")
    p.add_argument("--working-dir", default=".", help="directory shipped with the job (default .; 'none' ships nothing)")
    p.add_argument("--requirements", help="pip requirements file installed for the job (pinned versions)")
    p.add_argument("--image", help="prebuilt container image for the job instead of pip")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the job")
    p.add_argument("--no-follow", action="store_true", help="return after submitting instead of streaming logs")
    p = sub.add_parser("jobs", help="status, logs or stop of a submitted job")
    p.add_argument("action", choices=["status", "logs", "stop"])
    p.add_argument("job_id")
    p.add_argument("--address", default=None, help="Ray Jobs API address (as for submit)")
    p = sub.add_parser("params", help="trainable and communicated sizes from a model config (no weights loaded)")
    p.add_argument("--model-config", required=True, help="config JSON (path, or a name in configs/models/)")
    p.add_argument("--adapter", default="lora", choices=["lora", "reft"], help="adapter kind")
    p.add_argument("--untied", action="store_true", help="reft: one intervention per position group")
    p.add_argument("--share", default="W,R,b", help="reft: shared parameter types (default W,R,b)")
    p.add_argument("--layers", default=None, help="reft: comma-separated layers (default all)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules (default q_proj,v_proj)")
    p.add_argument("--bytes-per-param", type=int, default=2, help="2 for fp16/bf16 communication (default), 4 for fp32")
    p.add_argument("--clients", type=int, default=10, help="K, for per-round totals")
    p.add_argument("--prompts", type=int, default=1024, help="M public prompts, for the consensus estimate")
    p.add_argument("--tokens", type=int, default=128, help="mean response length ℓ̄ in tokens")
    p.add_argument("--bytes-per-token", type=float, default=2.0, help="c_t")
    return parser


# ------------------------------------------------------------------------- commands


def cmd_algorithms(_: argparse.Namespace) -> int:
    from fedsweep.algorithms import registry

    table = Table(title="fedsweep algorithms", show_lines=False)
    for col in ("name", "kind", "hyperparameters (default)", "summary"):
        table.add_column(col)
    for name in registry.names():
        cls = registry.get(name)
        fields = cls.Params.model_fields
        hp = ", ".join(f"{k}={f.default!r}" for k, f in fields.items()) or "—"
        table.add_row(name, "personalised" if cls.personalized else "global", hp, cls.summary)
    console.print(table)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.runner import validate_file
    from fedsweep.orchestrator.submit import kind_of

    if kind_of(args.config) == "tune":  # a sweep file: every variant and space value against its base
        from fedsweep.orchestrator.sweep import load_sweep, trial_count

        sweep, _ = load_sweep(args.config, args.overrides)
        console.print(f"[green]ok[/]: {args.config} — study {sweep.name}: {trial_count(sweep)} trials of "
                      f"{sweep.experiment}, metric {sweep.metric} ({sweep.mode})")
        return 0
    cfg, clients = validate_file(args.config, args.overrides)
    sizes = [len(c.train) for c in clients]
    console.print(f"[green]ok[/]: {args.config} — {cfg.algorithm}, {cfg.clients.num_clients} clients "
                  f"({cfg.num_actors} actors), {cfg.rounds} rounds, model {cfg.model.name}, "
                  f"{cfg.partition.scheme} split: {min(sizes)}–{max(sizes)} train examples per client")
    return 0


class RunView:
    """Progress over rounds and clients, with the current training loss."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                                 disable=not enabled, transient=False)
        self.rounds = self.clients = None

    def __call__(self, kind: str, data: Any) -> None:
        p = self.progress
        if kind == "status":
            console.print(f"[dim]{data}[/]")
        elif kind == "warning":
            console.print(f"[yellow]warning[/]: {data}", highlight=False, soft_wrap=True)
        elif kind == "start":
            p.start()
            self.rounds = p.add_task("rounds", total=data["rounds"], completed=data["first"] - 1, info="")
            self.clients = p.add_task("clients", total=1, completed=0, info="")
        elif kind == "progress" and self.clients is not None:
            loss = f"loss {data['loss']:.4f}" if data.get("loss") is not None else ""
            p.update(self.clients, total=max(data["total"], 1), completed=data["done"],
                     description=f"round {data['round']} {data['phase']}", info=loss)
        elif kind == "round" and self.rounds is not None:
            m = data["metrics"]
            info = f"train_loss {m.get('train_loss', float('nan')):.4f}"
            if "accuracy" in m:
                info += f"  acc {m['accuracy']:.3f}"
            p.update(self.rounds, advance=1, info=info)
            p.update(self.clients, completed=p.tasks[self.clients].total, description=f"round {data['round']} done",
                     info="")
            for cid, why in sorted(data.get("retried", {}).items()):
                p.console.print(f"[yellow]round {data['round']}: client {cid} recovered: {why}[/]", highlight=False)
            for cid, why in sorted(data["failures"].items()):
                p.console.print(f"[yellow]round {data['round']}: client {cid} left out: {why}[/]", highlight=False)

    def stop(self) -> None:
        self.progress.stop()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary_table(outcome) -> Table:
    last = outcome.last_eval
    table = Table(title=f"final evaluation (round {last['round']})" if last else "summary")
    for col in ("client", "tasks", "train n", "accuracy", "test loss", "sent up", "sent down"):
        table.add_column(col, justify="right" if col != "tasks" else "left")
    per = last["client_metrics"] if last else {}
    totals = {}
    for r in outcome.rounds:
        for cid, m in r["client_metrics"].items():
            t = totals.setdefault(int(cid), [0.0, 0.0])
            t[0] += m.get("bytes_up", 0.0)
            t[1] += m.get("bytes_down", 0.0)
    for c in outcome.clients:
        m = per.get(c.cid, {})
        up, down = totals.get(c.cid, [0.0, 0.0])
        table.add_row(str(c.cid), ",".join(c.tasks), str(len(c.train)),
                      f"{m['accuracy']:.3f}" if "accuracy" in m else "—",
                      f"{m['test_loss']:.4f}" if "test_loss" in m else "—", human_bytes(up), human_bytes(down))
    if last:
        g = last["metrics"]
        table.add_row("all", "weighted", "", f"{g.get('accuracy', float('nan')):.3f}",
                      f"{g.get('test_loss', float('nan')):.4f}", "", "", style="bold")
    return table


def cmd_run(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.config import load_config
    from fedsweep.orchestrator.runner import run

    cfg = load_config(args.config, args.overrides)
    view = RunView(enabled=not args.quiet)
    try:
        outcome = run(cfg, resume=args.resume, on_event=view)
    finally:
        view.stop()
    console.print(summary_table(outcome))
    rounds = outcome.rounds
    if rounds:
        secs = [r["metrics"]["round_seconds"] for r in rounds]
        evals = [r["metrics"].get("eval_seconds", 0.0) for r in rounds]
        console.print(f"rounds {rounds[0]['round']}–{rounds[-1]['round']}: {sum(secs):.1f}s "
                      f"({sum(secs) / len(secs):.1f}s per round, of which evaluation {sum(evals) / len(evals):.1f}s); "
                      f"checkpoints in {outcome.run_dir / 'checkpoints'}")
    if outcome.run_id:
        console.print(f"MLflow run [bold]{outcome.run_id}[/] in experiment '{cfg.tracking.experiment or cfg.name}' "
                      f"at {outcome.tracking_uri}")
        console.print(f"  open it with: mlflow ui --backend-store-uri {outcome.tracking_uri}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from fedsweep.orchestrator import bench
    from fedsweep.orchestrator.config import ConfigError

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    try:
        clients = [int(k) for k in args.clients.split(",") if k.strip()]
    except ValueError:
        raise ConfigError(f"--clients {args.clients!r}: expected comma-separated integers, e.g. 4,8,16") from None
    hp = {}
    for item in args.hp:
        if "=" not in item:
            raise ConfigError(f"--hp {item!r}: expected NAME=VALUE")
        key, _, value = item.partition("=")
        hp[key] = yaml.safe_load(value)
    if args.variant:
        hp["variant"] = args.variant
    try:
        rank = args.rank or (8 if args.algorithm == "fedreft" else 16)
        model = "llama-7b" if args.algorithm == "fedreft" and args.model == "llama-3.1-8b" else args.model
        args.model = model
        result = bench.bench_aggregation(args.algorithm, clients, hp, model=model, rank=rank,
                                         targets=tuple(args.targets.split(",")), repeats=args.repeats, device=device,
                                         progress=lambda line: console.print(f"[dim]{line}[/]"))
    except (KeyError, ValueError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    path = bench.write(result, args.out)
    table = Table(title=f"aggregation: {args.algorithm} {hp} on {device}, {result['adapter']} on {args.model}, "
                        f"{result['params_per_client']:,} params/client")
    for col in ("clients", "median s", "min s", "breakdown (median s)"):
        table.add_column(col, justify="right" if col != "breakdown (median s)" else "left")
    for row in result["results"]:
        parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in row.get("breakdown_median", {}).items())
        table.add_row(str(row["clients"]), f"{row['seconds_median']:.3f}", f"{row['seconds_min']:.3f}", parts)
    console.print(table)
    if "target" in result:
        t = result["target"]
        verdict = "[green]met[/]" if t["met"] else "[red]missed[/]"
        console.print(f"target: ≤ {t['seconds']} s at {t['clients']} clients on {device}: {t['measured']:.3f} s — {verdict}")
    console.print(f"written to {path}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.sweep import load_sweep, trial_count, tune_study

    sweep, base = load_sweep(args.sweep, args.overrides)
    console.print(f"[dim]study {sweep.name}: {trial_count(sweep)} trials of {sweep.experiment}, "
                  f"metric {sweep.metric} ({sweep.mode}); MLflow at {sweep.tracking_uri}[/]")
    results, parent = tune_study(sweep, base, resume=args.resume)
    errors = len(results.errors)
    best = None
    try:
        best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, filter_nan_and_inf=True)
    except Exception:
        pass
    if best is not None:
        console.print(f"best trial: {best.config} → {sweep.metric} {best.metrics.get(sweep.metric, float('nan')):.4f}")
    if errors:
        console.print(f"[yellow]{errors} trial(s) failed; see {results.experiment_path}[/]")
    if not args.no_report:
        report(sweep.name, sweep.tracking_uri, sweep.metric)
    console.print(f"MLflow parent run {parent} in experiment '{sweep.name}'; open it with: "
                  f"mlflow ui --backend-store-uri {sweep.tracking_uri}")
    return 1 if errors else 0


def cmd_compare(args: argparse.Namespace) -> int:
    report(args.experiment, args.uri, args.metric, args.out, args.all_runs, args.baseline, args.alpha)
    return 0


def report(experiment: str, uri: str, metric: str, out: str = "results/reports", all_runs: bool = False,
           baseline: str = "fedavg", alpha: float = 0.05) -> None:
    """Write the comparison report and print its table and what is significant."""
    from fedsweep.orchestrator.compare import compare
    from fedsweep.orchestrator.config import ConfigError

    try:
        path, table, found = compare(experiment, uri, out, metric, all_runs, baseline, alpha)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console.print(table, highlight=False, soft_wrap=True)
    if found:
        console.print("\n".join(found), highlight=False, soft_wrap=True)
    console.print(f"report: {path} (and plots beside it)")


def _jobs_address(address: str | None) -> str:
    return address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"


def cmd_submit(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import submit
    from fedsweep.orchestrator.config import ConfigError

    env = {}
    for item in args.env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r}: expected KEY=VALUE")
        key, _, value = item.partition("=")
        env[key] = value
    address = _jobs_address(args.address)
    working_dir = None if args.working_dir in ("none", "") else args.working_dir
    job_id = submit.submit(args.file, address, args.overrides, python=args.python, working_dir=working_dir,
                           requirements=args.requirements, image=args.image, env=env)
    console.print(f"submitted job [bold]{job_id}[/] to {address}")
    console.print(f"  fedsweep jobs status {job_id} --address {address}")
    if args.no_follow:
        return 0
    final = submit.follow(address, job_id, lambda text: print(text, end="", flush=True))
    console.print(f"job {job_id}: {final}")
    return 0 if final == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    import json

    from fedsweep.orchestrator import submit

    address = _jobs_address(args.address)
    if args.action == "status":
        console.print(json.dumps(submit.status(address, args.job_id), indent=1), highlight=False)
    elif args.action == "logs":
        print(submit.logs(address, args.job_id), end="")
    else:
        console.print(f"stop requested: {submit.stop(address, args.job_id)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fedsweep.models.memory import GiB, RESERVE, parse_size, plan, usable_bytes
    from fedsweep.orchestrator.bench_actor import model_config
    from fedsweep.orchestrator.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides)
    try:
        gpu = parse_size(args.gpu_memory)
    except ValueError as exc:
        raise ConfigError(f"--gpu-memory: {exc}") from None
    est = plan(cfg, model_config(cfg))
    K = cfg.clients.num_clients
    per = cfg.clients.clients_per_actor
    table = Table(title=f"memory plan: {cfg.model.name}, dtype {cfg.model.dtype}, quantization {cfg.model.quantization}, "
                        f"autocast {cfg.train.autocast}, checkpointing {'on' if cfg.train.gradient_checkpointing else 'off'}, "
                        f"batch {cfg.train.batch_size} × {cfg.train.max_length} tokens")
    table.add_column("part")
    table.add_column("MiB", justify="right")
    mib = lambda n: f"{n / 2 ** 20:,.1f}"  # noqa: E731
    table.add_row("frozen base weights", mib(est.base))
    table.add_row("adapters attached to the base (float32)", mib(est.live_adapters))
    table.add_row(f"optimiser state per client ({cfg.train.optimizer}; idle clients' parked on {est.park})",
                  mib(est.optimizer_per_client))
    table.add_row("training step peak (activations, gradients, logits)", mib(est.train_step))
    table.add_row("evaluation peak (test-loss forward or generation KV cache)", mib(est.evaluation))
    table.add_row(f"one actor hosting {per} client(s) (clients_per_actor)", mib(est.per_actor(per)))
    console.print(table)
    fit = est.clients_per_gpu(gpu, K)
    usable = usable_bytes(gpu)
    if fit == 0:
        console.print(f"[red]one client does not fit[/] a {gpu / GiB:g} GiB GPU ({usable / GiB:.1f} GiB usable, "
                      f"{RESERVE:.0%} kept for the CUDA context): lower train.batch_size or max_length, turn on "
                      f"train.gradient_checkpointing, or quantise the base")
        return 1
    actors = -(-K // fit)
    console.print(f"on a {gpu / GiB:g} GiB GPU ({usable / GiB:.1f} GiB usable): up to {fit} of {K} clients on one base "
                  f"per GPU → layout: clients.clients_per_actor={fit}, clients.resources.num_gpus=1, {actors} actor(s)/GPU(s)")
    console.print(f"one base per client instead: {int(usable // est.per_actor(1))} clients per GPU "
                  f"({mib(est.per_actor(1))} MiB each)")
    if cfg.clients.resources.num_gpus > 0 and est.per_actor(per) > usable * cfg.clients.resources.num_gpus:
        console.print(f"[yellow]this config's layout does not fit[/]: {per} clients per actor need "
                      f"{mib(est.per_actor(per))} MiB, {cfg.clients.resources.num_gpus:g} GPU(s) of it give "
                      f"{usable * cfg.clients.resources.num_gpus / 2 ** 20:,.0f} MiB")
    return 0


def cmd_bench_actor(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import bench_actor
    from fedsweep.orchestrator.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides)
    say = lambda line: console.print(f"[dim]{line}[/]")  # noqa: E731
    if args.bench == "memory":
        try:
            clients = [int(k) for k in args.clients.split(",") if k.strip()]
        except ValueError:
            raise ConfigError(f"--clients {args.clients!r}: expected comma-separated integers, e.g. 1,50") from None
        result = bench_actor.bench_memory(cfg, clients, args.separate_max, args.rounds, progress=say)
        for row in result["rows"]:
            p, s = row["packed"], row["separate"]
            console.print(f"K={row['clients']}: packed {p['peak_bytes'] / 2 ** 20:,.0f} MiB "
                          f"({p['peak_bytes_per_client'] / 2 ** 20:,.1f} MiB/client, planned "
                          f"{p['planned_peak_bytes'] / 2 ** 20:,.0f}), round {p['round_seconds'][-1]:.1f} s; "
                          f"one base each: {s['peak_bytes_per_client'] / 2 ** 20:,.1f} MiB/client")
    else:
        result = bench_actor.bench_throughput(cfg, args.repeats, progress=say)
        console.print(f"{result['tokens']:,} tokens: fedsweep {result['fedsweep_tokens_per_s']:,.0f} tok/s, plain loop "
                      f"{result['plain_tokens_per_s']:,.0f} tok/s ({result['fedsweep_over_plain']:.2f}× the floor's time)")
    path = bench_actor.write(result, cfg.name, args.out)
    console.print(f"written to {path}")
    return 0


def cmd_bench_consensus(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import bench

    result = bench.bench_consensus(args.clients, args.prompts, args.repeats,
                                   progress=lambda line: console.print(f"[dim]{line}[/]"))
    path = bench.write(result, args.out)
    console.print(f"consensus, K={args.clients}, M={args.prompts}: {result['seconds_median']:.2f} s median "
                  f"(embed {result['embed_seconds_median']:.2f} s, cluster+select {result['cluster_seconds_median']:.2f} s)")
    console.print(f"written to {path}")
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    import json

    from fedsweep.models.shapes import load_model_config
    from fedsweep.orchestrator.config import ConfigError
    from fedsweep.orchestrator.params import lora_report, mib

    if args.adapter == "reft":
        from fedsweep.orchestrator.params import reft_report

        cfg = load_model_config(args.model_config)
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
        rep = reft_report(cfg, args.rank, not args.untied, args.share.split(","), layers, args.bytes_per_param)
        table = Table(title=f"{args.model_config}: LoReFT r={args.rank}, {'untied' if args.untied else 'tied'}")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        table.add_row("model parameters (meta device)", f"{rep['model_params']:,} ({rep['model_millions']:,.2f} M)")
        table.add_row("interventions", f"{rep['interventions']:,} ("
                      + ("tied: one per layer" if rep["tied"] else "untied: one per position group per layer") + ")")
        table.add_row("trainable parameters", f"{rep['trainable_params']:,} ({rep['trainable_millions']:.4g} M)")
        table.add_row("trainable share of the model", f"{rep['trainable_percent']:.4f} %")
        table.add_row(f"upload per client per round (shares {args.share})",
                      f"{rep['upload_bytes_per_client']:,} B = {mib(rep['upload_bytes_per_client'])}")
        console.print(table)
        console.print(json.dumps(rep), soft_wrap=True, highlight=False)
        return 0
    try:
        cfg = load_model_config(args.model_config)
        rep = lora_report(cfg, args.rank, args.targets.split(","), args.bytes_per_param, args.clients,
                          args.prompts, args.tokens, args.bytes_per_token)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--model-config {args.model_config}: {exc}") from None
    table = Table(title=f"{args.model_config}: LoRA r={args.rank} on {args.targets}, {args.bytes_per_param} bytes/param")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("trainable parameters per client", f"{rep['trainable_params']:,}")
    for t, n in rep["per_module"].items():
        table.add_row(f"  {t} {tuple(rep['shapes'][t])}", f"{n:,}")
    table.add_row("upload per client per round (exact)", f"{rep['upload_bytes_per_client']:,} B = {mib(rep['upload_bytes_per_client'])}")
    table.add_row("  paper's estimate (attention d×d, MLP d×d_ff)",
                  f"{rep['paper_estimate_upload_bytes']:,} B = {mib(rep['paper_estimate_upload_bytes'])}")
    table.add_row(f"round total, up + down, K={args.clients}", mib(rep["round_bytes_all_clients"]))
    table.add_row(f"semantic consensus 2·K·M·ℓ̄·c_t (M={args.prompts}, ℓ̄={args.tokens}, c_t={args.bytes_per_token:g})",
                  f"{rep['consensus_round_bytes']:,} B = {mib(rep['consensus_round_bytes'])} = {rep['consensus_round_bytes'] / 1e6:.2f} MB")
    table.add_row("LoRA / consensus", f"{rep['lora_over_consensus']:,.0f}×")
    console.print(table)
    console.print(json.dumps({k: v for k, v in rep.items() if k != "shapes"}), soft_wrap=True, highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # RAY_AUTH_MODE: left to the user (ray_runtime.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    from fedsweep.data.records import DataError
    from fedsweep.models.lora import AdapterError
    from fedsweep.models.loading import ModelError
    from fedsweep.orchestrator.config import ConfigError
    from fedsweep.orchestrator.runner import RunError

    handlers = {"run": cmd_run, "validate": cmd_validate, "algorithms": cmd_algorithms, "params": cmd_params,
                "tune": cmd_tune, "compare": cmd_compare, "submit": cmd_submit, "jobs": cmd_jobs,
                "plan": cmd_plan,
                "bench": lambda a: {"consensus": cmd_bench_consensus, "memory": cmd_bench_actor,
                                    "throughput": cmd_bench_actor}.get(a.bench, cmd_bench)(a)}
    try:
        return handlers[args.command](args)
    except (ConfigError, DataError, ModelError, AdapterError, RunError) as exc:
        if args.debug:
            raise
        err.print(f"[red]error[/]: {exc}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: the last complete round is checkpointed; continue with --resume")
        return 130
    except Exception as exc:  # anything else (Ray, the OS, a bug): one line; the trace with --debug
        if args.debug:
            raise
        from fedsweep.orchestrator.runner import root_cause

        where = f"fedsweep {args.command}"
        err.print(f"[red]error[/]: {where}: {type(exc).__name__}: {root_cause(exc)} (--debug shows the traceback)",
                  highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
