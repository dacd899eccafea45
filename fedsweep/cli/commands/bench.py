"""``fedsweep bench aggregation|checkpoint|consensus|faults|memory|throughput|run|transport`` (and ``archive``, ``cli/commands/bench_lab.py``): measured speed and memory, JSON under results/bench/."""

from __future__ import annotations

import argparse
import statistics

from fedsweep.cli.commands import bench_lab
from fedsweep.cli.views import add_config_args, console
from rich.table import Table


def add(sub) -> None:
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
    b.set_defaults(handler=cmd_bench)
    c = bench.add_parser("consensus", help="FedCoFiT server seconds: embed K·M responses, cluster, select")
    c.add_argument("--clients", type=int, default=10, help="K (default 10)")
    c.add_argument("--prompts", type=int, default=500, help="M (default 500, the paper's budget)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out", default="results/bench", help="output folder")
    c.set_defaults(handler=cmd_bench_consensus)
    m = bench.add_parser("memory", help="device memory and round time: K clients on one base vs one base each")
    add_config_args(m)
    m.add_argument("--clients", default="1,8", help="comma-separated client counts K (default 1,8)")
    m.add_argument("--separate-max", type=int, default=8, help="one-base-per-client actors measured at most (default 8)")
    m.add_argument("--rounds", type=int, default=1, help="rounds per layout (default 1)")
    m.add_argument("--out", default="results/bench", help="output folder")
    m.set_defaults(handler=cmd_bench_actor)
    _add_throughput(bench)
    w = bench.add_parser("transport", help="seconds to move one client's adapter between processes: fedsweep's "
                                           "numpy buffers against torch's pickling")
    w.add_argument("--model", default="smollm2-135m-instruct", help="model config JSON (path or name in configs/models/)")
    w.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    w.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules (default q_proj,v_proj)")
    w.add_argument("--repeats", type=int, default=50, help="alternating repetitions (median reported)")
    w.add_argument("--out", default="results/bench", help="output folder")
    w.set_defaults(handler=cmd_bench_transport)
    k = bench.add_parser("checkpoint", help="seconds to checkpoint one round of K clients' adapters and AdamW state: "
                                            "fedsweep's writer against safetensors' save_file")
    k.add_argument("--clients", type=int, default=50, help="K (default 50)")
    k.add_argument("--model", default="smollm2-135m-instruct", help="model config JSON (path or name in configs/models/)")
    k.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    k.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules (default q_proj,v_proj)")
    k.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the clients' state lives (default cpu)")
    k.add_argument("--repeats", type=int, default=3, help="alternating repetitions (median reported)")
    k.add_argument("--scratch", default="results/bench/checkpoint-scratch",
                   help="folder the rounds are written in, removed after: put it on the disk checkpoints use")
    k.add_argument("--out", default="results/bench", help="output folder")
    k.set_defaults(handler=cmd_bench_checkpoint)
    f = bench.add_parser("faults", help="the config undisturbed and again with seeded kills (client actors, the "
                                        "server actor, the driver then resumed): what recovered, what each cost, "
                                        "and whether the final state equals the undisturbed run's bit for bit")
    add_config_args(f)
    f.add_argument("--kills", type=int, default=3, help="faults spread over the rounds (default 3)")
    f.add_argument("--seed", type=int, default=0, help="draws the kills' rounds, kinds and targets (default 0)")
    f.add_argument("--scratch", default="results/bench/faults-scratch",
                   help="folder the two runs' checkpoints are written in, removed after")
    f.add_argument("--kinds", default="",
                   help="comma-separated faults outside the run, each once beside the same work undisturbed: commit "
                        "(the driver SIGKILLed between a round's commit and its metrics, then --resume), tracking (a "
                        "real mlflow server killed, back --away-s later), study (the driver of --study killed after "
                        "its first trial, then --resume), node (the worker node of a two-node local Ray cluster "
                        "that holds a client actor, removed inside a round), setup (the driver SIGKILLed inside its "
                        "set-up, its MLflow run made, then --resume), tracking-start (the run started with the "
                        "mlflow server away for --away-s), study-tracking (the server of --study killed as it "
                        "began, back --away-s later, while trials start and end)")
    f.add_argument("--away-s", type=float, default=30.0, help="how long the tracking server stays away (default 30)")
    f.add_argument("--study", help="the sweep file whose driver the study kind kills")
    f.add_argument("--out", default="results/bench", help="output folder")
    f.set_defaults(handler=cmd_bench_faults)
    _add_run(bench)
    bench_lab.add(bench)


def _add_run(bench) -> None:
    """``fedsweep bench run``'s arguments."""
    r = bench.add_parser("run", help="one experiment end to end: seconds of every start-up phase, of every round's "
                                     "phases beside their ideal, of tear-down, and the process tree's peak memory")
    add_config_args(r)
    r.add_argument("--variant", default=None, metavar="NAME",
                   help="CONFIG is a sweep file: benchmark this variant's trial exactly as the study runs it")
    r.add_argument("--seed", type=int, default=None, help="with --variant: the trial's seed (default the study's first)")
    r.add_argument("--out", default="results/bench", help="output folder, or a .json file path")
    r.add_argument("--no-ideal", action="store_true",
                   help="leave the rounds' ideal out (measure it apart with --ideal-of the JSON this writes)")
    r.add_argument("--ideal-of", default=None, metavar="JSON",
                   help="measure only the ideal of the rounds of an earlier bench run's JSON (written with "
                        "--no-ideal) and write the JSON again with it; CONFIG is then not run")
    r.set_defaults(handler=cmd_bench_run)


def _add_throughput(bench) -> None:
    """``fedsweep bench throughput``'s arguments."""
    t = bench.add_parser("throughput", help="training tokens/s of one client: ClientActor vs a plain training loop; "
                                            "with --clients: K packed clients trained as one group vs one at a time "
                                            "vs the bare loop on the same rows (the ceiling)")
    add_config_args(t)
    t.add_argument("--clients", default=None,
                   help="comma-separated K (e.g. 1,10,50): K clients on one actor, in groups (the batch plan of "
                        "train.batch_clients: auto) vs one at a time")
    t.add_argument("--ops", action="store_true",
                   help="count operator calls (aten::, torch.profiler) of a round and of a group step per K "
                        "(--clients, default 1,10,50) instead of timing")
    t.add_argument("--repeats", type=int, default=3, help="alternating repeats (median reported)")
    t.add_argument("--sequential-max", type=int, default=None, metavar="K",
                   help="with --clients: time one at a time only for K up to this (default: every K; 50 clients "
                        "one at a time take minutes on a GPU)")
    t.add_argument("--padding-free", action="store_true",
                   help="with --clients: also time the bare loop over the same sequences laid end to end in rows "
                        "without padding (what a padding-free forward would buy; JSON bare_padding_free_*)")
    t.add_argument("--out", default="results/bench", help="output folder")
    t.set_defaults(handler=cmd_bench_actor)


def cmd_bench_faults(args: argparse.Namespace) -> int:
    import shutil

    from fedsweep.config import load_config
    from fedsweep.errors import ConfigError
    from fedsweep.bench import recovery

    from fedsweep.bench.outages import OUTAGE_KINDS

    if args.kills < 0:
        raise ConfigError(f"--kills {args.kills}: expected 0 or more")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(OUTAGE_KINDS))
    if unknown:
        raise ConfigError(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(OUTAGE_KINDS)})")
    for needs in ("study", "study-tracking"):
        if needs in kinds and not args.study:
            raise ConfigError(f"--kinds {needs} needs --study SWEEP: the study it disturbs")
    cfg = load_config(args.config, args.overrides)
    try:
        say = lambda line: console.print(f"[dim]{line}[/]", highlight=False)  # noqa: E731
        result = recovery.bench_faults(cfg, args.kills, args.seed, args.scratch, progress=say)
        if kinds:
            from pathlib import Path

            from fedsweep.bench.outages import run_outages

            result["outages"] = run_outages(cfg, kinds, Path(args.scratch), args.seed, Path(result["undisturbed_dir"]),
                                            result["undisturbed_s"], args.away_s, args.study, say)
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)
    table = Table(title=f"{result['name']}: {result['clients']} clients, {result['rounds']} rounds, "
                        f"{len(result['kills'])} kills (seed {result['seed']})")
    for col in ("fault", "landed", "recovered", "cost s"):
        table.add_column(col, justify="right" if col == "cost s" else "left")
    for k in result["kills"]:
        table.add_row(f"{k['kind']} (round {k['round']})", k["landed"], k["recovered"],
                      "—" if k["cost_s"] is None else f"{k['cost_s']:+.1f}")
    console.print(table)
    same = "[green]bitwise equal[/]" if result["bitwise_equal"] else f"[red]differs in {len(result['differing'])} tensors[/]"
    console.print(f"final state ({result['tensors']} tensors) against the undisturbed run: {same}; "
                  f"{result['undisturbed_s']:.1f} s undisturbed, {result['disturbed_s']:.1f} s disturbed")
    outage_ok = True
    for o in result.get("outages", []):
        ok = o.get("bitwise_equal", o.get("equal_final_losses")) and o.get("exit", 0) == 0 \
            and o.get("metrics_once", True) and not str(o.get("landed", "")).startswith("not fired")
        outage_ok = outage_ok and bool(ok)
        extra = {k: o[k] for k in ("longest_round_gap_s", "waited_for_server_s", "actors_moved", "child_runs", "status")
                 if k in o}
        console.print(f"{o['kind']}: {o.get('landed')}; {'[green]recovered[/]' if ok else '[red]NOT recovered[/]'}"
                      f" (cost {o.get('cost_s', float('nan')):+.1f} s; {extra})", highlight=False, soft_wrap=True)
    path = recovery.write(result, args.out)
    console.print(f"written to {path}")
    return 0 if result["bitwise_equal"] and outage_ok and all(k["landed"] != "not fired" for k in result["kills"]) else 1


def cmd_bench_run(args: argparse.Namespace) -> int:
    from fedsweep.bench import run as bench_run

    if args.ideal_of:
        import json
        from pathlib import Path

        source = Path(args.ideal_of)
        result = bench_run.measure_ideal(json.loads(source.read_text()))
        path = bench_run.write(result, str(source) if args.out == "results/bench" else args.out)
        console.print(_ideal_table(result))
        console.print(f"→ {path}")
        return 0
    config = args.config
    if args.variant is not None:
        import tempfile

        config = bench_run.study_cell(args.config, args.variant, args.seed, tempfile.mkdtemp(prefix="fedsweep-cell-"))
    elif args.seed is not None:
        from fedsweep.errors import ConfigError

        raise ConfigError("--seed goes with --variant (a study's cell); for an experiment file use --set seed=S")
    result = bench_run.bench_run(config, args.overrides, ideal=not args.no_ideal)
    if args.variant is not None:
        result.update(study=args.config, variant=args.variant, seed=result.get("seed"))
    path = bench_run.write(result, args.out)
    table = Table(title=f"{result['name']}: {result['clients']} clients, {result['rounds']} rounds, "
                        f"{result['num_actors']} actor(s) ({result['layout']})")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for name, sec in result["phases_s"].items():
        table.add_row(name, f"{sec:.2f}")
    for r in result["per_round"]:
        table.add_row(f"  round: train {r['train']:.2f} · aggregate {r['aggregation']:.3f} · eval {r['eval']:.2f} · "
                      f"checkpoint {r['checkpoint']:.2f} · overhead {r['overhead']:.2f}", f"{r['round']:.2f}")
    forks = result["worker_forks"]
    ready = (f"; workers forked, fork server ready {forks['server_ready_after_process_start_s']:.2f} s after start"
             if forks["on"] else "")
    table.add_row(f"set-up (process start → round 1{ready})", f"{result['setup_s']:.2f}")
    table.add_row("total (process start → tear-down done)", f"{result['total_wall_s']:.2f}")
    console.print(table)
    if result["run_over_ideal"] is not None or result["ideal"].get("phases"):
        console.print(_ideal_table(result))
    pss = f", {result['peak_pss_tree_mib']:,.0f} MiB PSS (shared pages split)" if result["peak_pss_tree_mib"] else ""
    console.print(f"peak memory of the process tree: {result['peak_rss_tree_mib']:,.0f} MiB RSS{pss} → {path}")
    return 0


def _ideal_table(result: dict) -> Table:
    """The rounds' phases: seconds measured, the ideal (their work at the best bare rates), their ratio."""
    ideal = result["ideal"]
    ratio = result["run_over_ideal"]
    table = Table(title=f"the rounds against their ideal: {ratio:.2f}×" if ratio else "the rounds against their ideal")
    for column in ("phase", "actual s", "ideal s", "actual / ideal"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, row in ideal["phases"].items():
        if row["actual_s"] or row["ideal_s"]:
            table.add_row(phase, f"{row['actual_s']:.2f}", f"{row['ideal_s']:.2f}",
                          f"{row['ratio']:.2f}" if row["ratio"] is not None else "—")
    table.add_row("all rounds", f"{ideal['rounds_s']:.2f}", f"{ideal['ideal_s']:.2f}", f"{ratio:.2f}" if ratio else "—")
    return table


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from fedsweep.bench import synthetic as bench
    from fedsweep.errors import ConfigError

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    clients = _counts(args.clients, "e.g. 4,8,16")
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
        result = bench.bench_aggregation(args.algorithm, clients, hp, model=model, rank=rank,
                                         targets=tuple(args.targets.split(",")), repeats=args.repeats, device=device,
                                         progress=lambda line: console.print(f"[dim]{line}[/]"))
    except (KeyError, ValueError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None
    path = bench.write(result, args.out)
    table = Table(title=f"aggregation: {args.algorithm} {hp} on {device}, {result['adapter']} on {model}, "
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


def cmd_bench_actor(args: argparse.Namespace) -> int:
    from fedsweep.bench import actor as bench_actor
    from fedsweep.config import load_config

    cfg = load_config(args.config, args.overrides)
    say = lambda line: console.print(f"[dim]{line}[/]")  # noqa: E731
    if args.bench == "memory":
        clients = _counts(args.clients, "e.g. 1,50")
        result = bench_actor.bench_memory(cfg, clients, args.separate_max, args.rounds, progress=say)
        for row in result["rows"]:
            p, s = row["packed"], row["separate"]
            console.print(f"K={row['clients']}: packed {p['peak_bytes'] / 2 ** 20:,.0f} MiB "
                          f"({p['peak_bytes_per_client'] / 2 ** 20:,.1f} MiB/client, planned "
                          f"{p['planned_peak_bytes'] / 2 ** 20:,.0f}), round {p['round_seconds'][-1]:.1f} s; "
                          f"one base each: {s['peak_bytes_per_client'] / 2 ** 20:,.1f} MiB/client")
    elif getattr(args, "clients", None) or getattr(args, "ops", False):
        from fedsweep.bench import grouped

        clients = _counts(args.clients or "1,10,50", "e.g. 1,10,50")
        if args.ops:
            result = grouped.bench_ops(cfg, clients, progress=say)
            _print_ops(result)
        else:
            result = grouped.bench_batched(cfg, clients, args.repeats, progress=say, sequential_max=args.sequential_max,
                                           padding_free=args.padding_free)
            _print_grouped(result)
    else:
        result = bench_actor.bench_throughput(cfg, args.repeats, progress=say)
        console.print(f"{result['tokens']:,} tokens: fedsweep {result['fedsweep_tokens_per_s']:,.0f} tok/s, plain loop "
                      f"{result['plain_tokens_per_s']:,.0f} tok/s ({result['fedsweep_over_plain']:.2f}× the floor's time)")
    path = bench_actor.write(result, cfg.name, args.out)
    console.print(f"written to {path}")
    return 0


def _counts(text: str, example: str) -> list[int]:
    """``--clients``: comma-separated positive integers, or one ConfigError line."""
    from fedsweep.errors import ConfigError

    try:
        clients = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        clients = []
    if not clients or min(clients) < 1:
        raise ConfigError(f"--clients {text!r}: expected comma-separated positive integers, {example}")
    return clients


def _print_grouped(result: dict) -> None:
    def use(row, mode):
        mfu = row[mode + "_mfu"]
        return f"MFU {mfu:.1%}" if mfu is not None else f"{row[mode + '_flops_per_s'] / 1e9:,.1f} GFLOP/s"

    for row in result["rows"]:
        seq = row["sequential_tokens_per_s"] is not None
        one = (f"sequential {row['sequential_tokens_per_s']:,.0f} tok/s ({use(row, 'sequential')}), " if seq
               else "sequential not measured (--sequential-max), ")
        vs = (f"round {statistics.median(row['batched_seconds']):.2f} s vs {statistics.median(row['sequential_seconds']):.2f} s; "
              f"peak {row['batched_peak_bytes'] / 2 ** 20:,.0f} vs {row['sequential_peak_bytes'] / 2 ** 20:,.0f} MiB; "
              f"padding {row['batched_padding_share']:.1%} vs {row['sequential_padding_share']:.1%}" if seq else
              f"round {statistics.median(row['batched_seconds']):.2f} s; peak {row['batched_peak_bytes'] / 2 ** 20:,.0f} MiB; "
              f"padding {row['batched_padding_share']:.1%}")
        console.print(f"K={row['clients']}: batched {row['batched_tokens_per_s']:,.0f} tok/s ({use(row, 'batched')}), "
                      f"{one}bare {row['bare_tokens_per_s']:,.0f} tok/s ({use(row, 'bare')}); "
                      f"grouped/bare {row['grouped_over_bare']:.2f}×"
                      + (f", grouped/sequential {row['speedup']:.2f}×" if seq else "")
                      + f"; {vs} of {row['tokens']:,} real tokens"
                      + (f"; bare padding-free {row['bare_padding_free_tokens_per_s']:,.0f} tok/s "
                         f"({row['bare_padding_free_over_bare']:.2f}× bare, padding {row['bare_padding_free_padded_tokens']:,} "
                         f"against {row['bare_padded_tokens']:,} tokens); careful bare loop (packed, scored logits, "
                         f"fused AdamW, TF32 for fp32) {row['bare_careful_tokens_per_s']:,.0f} tok/s, grouped/careful "
                         f"{row['grouped_over_careful']:.2f}×" if row.get("bare_padding_free_over_bare") else "")
                      + (f"; grouped packed (train.pack_tokens={row['pack_tokens_measured']}) "
                         f"{row['batched_packed_tokens_per_s']:,.0f} tok/s, padding {row['batched_packed_padded_tokens']:,}, "
                         f"{row['grouped_packed_over_grouped']:.2f}× grouped, "
                         f"{row['grouped_packed_over_careful']:.2f}× careful" if row.get("grouped_packed_over_careful") else ""))


def _print_ops(result: dict) -> None:
    table = Table(title=f"operator calls (aten::) of {result['model']}, {result['steps']} steps a round")
    for col in ("K", "forwards", "round", "round compute", "step", "step compute", "round compute ÷ K=1",
                "step ÷ K=1"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["clients"]), r["forwards"], f"{r['round_aten_calls']:,}", f"{r['round_compute_calls']:,}",
                      f"{r['step_aten_calls']:,.0f}", f"{r['step_compute_calls']:,.0f}",
                      f"{r['round_compute_calls_over_one']:.2f}×", f"{r['step_aten_calls_over_one']:.2f}×")
    console.print(table)
    for r in result["rows"]:
        for name, g in r.get("gpu", {}).items():
            console.print(f"K={r['clients']} {name} on the GPU: a round {g['round_seconds'] * 1e3:,.1f} ms, {g['kernels']:,} "
                          f"kernels, {g['kernel_seconds'] * 1e3:,.1f} ms of them ({g['busy_share']:.0%} busy); top kernels: "
                          + "; ".join(f"{k['name'][:60]} ×{k['calls']} {k['seconds'] * 1e3:.1f} ms" for k in g["top_kernels"][:5])
                          + "; top host ops: "
                          + "; ".join(f"{o['name']} ×{o['calls']} {o['self_cpu_seconds'] * 1e3:.1f} ms" for o in g["top_host_ops"][:5]))


def cmd_bench_consensus(args: argparse.Namespace) -> int:
    from fedsweep.bench import synthetic as bench

    result = bench.bench_consensus(args.clients, args.prompts, args.repeats,
                                   progress=lambda line: console.print(f"[dim]{line}[/]"))
    path = bench.write(result, args.out)
    console.print(f"consensus, K={args.clients}, M={args.prompts}: {result['seconds_median']:.2f} s median "
                  f"(embed {result['embed_seconds_median']:.2f} s, cluster+select {result['cluster_seconds_median']:.2f} s)")
    console.print(f"written to {path}")
    return 0


def _on_a_model_shape(measure, **counts: int):
    """Run ``measure()`` (a benchmark on a model config's shape) after checking that every ``--name``
    count is at least 1; a bad count, model name or target module is one ConfigError line."""
    from fedsweep.errors import ConfigError

    low = [f"--{name} {value}" for name, value in counts.items() if value < 1]
    if low:
        raise ConfigError(f"{' '.join(low)}: expected at least 1")
    try:
        return measure()
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc).strip("'\"")) from None


def cmd_bench_transport(args: argparse.Namespace) -> int:
    from fedsweep.bench import synthetic as bench

    result = _on_a_model_shape(lambda: bench.bench_transport(args.model, args.rank, tuple(args.targets.split(",")),
                                                             args.repeats), repeats=args.repeats)
    path = bench.write(result, args.out)
    console.print(f"{result['model']} LoRA r={result['rank']} on {','.join(result['targets'])}: {result['tensors']} "
                  f"tensors, {result['bytes'] / 2 ** 20:.2f} MiB; pickle + unpickle: fedsweep "
                  f"{result['fedsweep_wire_seconds_median'] * 1e3:.2f} ms, torch "
                  f"{result['torch_pickle_seconds_median'] * 1e3:.2f} ms ({result['torch_over_wire']:.1f}×)")
    console.print(f"written to {path}")
    return 0


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from fedsweep.bench import synthetic as bench
    from fedsweep.bench.checkpoint import bench_checkpoint

    result = _on_a_model_shape(lambda: bench_checkpoint(args.model, args.rank, tuple(args.targets.split(",")), args.clients,
                                                        args.repeats, args.device, args.scratch,
                                                        progress=lambda line: console.print(f"[dim]{line}[/]")),
                               clients=args.clients, repeats=args.repeats)
    path = bench.write(result, args.out)
    console.print(f"{result['clients']} clients of {result['model']} (LoRA r={result['rank']}, AdamW state), "
                  f"{result['tensors_per_client']} tensors each, {result['round_bytes'] / 2 ** 20:.0f} MiB a round: "
                  f"fedsweep {result['fedsweep_seconds_median']:.2f} s, save_file "
                  f"{result['safetensors_save_file_seconds_median']:.2f} s ({result['save_file_over_fedsweep']:.1f}×)")
    console.print(f"written to {path}")
    return 0
