"""``fedsweep plan CONFIG --gpu-memory 80GB``: memory per client actor and how many clients fit a GPU."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import add_config_args, console
from rich.table import Table


def add(sub) -> None:
    p = sub.add_parser("plan", help="memory per client actor from the model config alone, and how many clients fit a GPU")
    add_config_args(p)
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB, 40GB, 24GiB (default 80GB)")
    p.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from fedsweep.models.memory import GiB, RESERVE, parse_size, usable_bytes
    from fedsweep.plan.memory import plan
    from fedsweep.bench.actor import model_config
    from fedsweep.config import load_config
    from fedsweep.errors import ConfigError

    cfg = load_config(args.config, args.overrides)
    try:
        gpu = parse_size(args.gpu_memory)
    except ValueError as exc:
        raise ConfigError(f"--gpu-memory: {exc}") from None
    est = plan(cfg, model_config(cfg))
    K = cfg.clients.num_clients
    fit = est.clients_per_gpu(gpu, K)
    per = cfg.clients.clients_per_actor if cfg.layout_chosen else max(fit, 1)  # auto: as many as fit
    table = Table(title=f"memory plan: {cfg.model.name}, dtype {cfg.model.dtype}, quantization {cfg.model.quantization}, "
                        f"autocast {cfg.train.autocast}, checkpointing {'on' if cfg.train.gradient_checkpointing else 'off'}, "
                        f"batch {cfg.train.batch_size} × {cfg.train.max_length} tokens")
    table.add_column("part")
    table.add_column("MiB", justify="right")
    mib = lambda n: f"{n / 2 ** 20:,.1f}"  # noqa: E731
    shard = cfg.clients.shard
    if shard:
        where = "none: offloaded to host memory" if shard.offload == "cpu" else f"1/{est.shards} share"
        table.add_row(f"frozen base weights ({where}; {shard.backend} over {est.shards} GPUs)", mib(est.base))
        table.add_row("layers gathered whole at a time (computing + prefetched)", mib(est.gathered))
    else:
        table.add_row("frozen base weights", mib(est.base))
    table.add_row("adapters attached to the base (float32)", mib(est.live_adapters))
    table.add_row(f"optimiser state per client ({cfg.train.optimizer}; idle clients' parked on {est.park})",
                  mib(est.optimizer_per_client))
    table.add_row("training step peak (activations, gradients, logits)", mib(est.train_step))
    together = est.batch_clients or est.batch_limit(gpu, per)  # auto: as many as fit beside the rest
    if est.batch_clients != 1 and min(together, per) > 1:
        m = min(together, per)
        table.add_row(f"group step of {m} clients (train.batch_clients={cfg.train.batch_clients}: "
                      f"+{mib(est.batch_slope)} per further batch, {mib(est.stacked_per_client)} stacked per client)",
                      mib(est.train_step_of(m)))
    table.add_row("evaluation peak (test-loss forward or generation KV cache)", mib(est.evaluation))
    table.add_row(f"one actor hosting {per} client(s) (clients_per_actor{'' if cfg.layout_chosen else ': auto'})"
                  + (f", on each of its {est.shards} GPUs" if shard else ""), mib(est.per_actor(per, together)))
    console.print(table)
    usable = usable_bytes(gpu)
    if fit == 0:
        console.print(f"[red]one client does not fit[/] {'each of ' + str(est.shards) + ' × ' if shard else 'a '}{gpu / GiB:g} GiB GPU ({usable / GiB:.1f} GiB usable, "
                      f"{RESERVE:.0%} kept for the CUDA context): lower train.batch_size or max_length, turn on "
                      f"train.gradient_checkpointing, " + ("shard over more GPUs (clients.shard.gpus_per_client) or "
                      "offload (clients.shard.offload=cpu)" if shard else "quantise the base, or shard it over "
                      "several GPUs (clients.shard)"))
        return 1
    actors = -(-K // fit)
    if shard:
        console.print(f"on {est.shards} × {gpu / GiB:g} GiB GPUs ({usable / GiB:.1f} GiB usable each): up to {fit} of {K} "
                      f"clients on one sharded base → layout: clients.clients_per_actor={fit}, {actors} sharded "
                      f"client actor(s), {actors * est.shards} GPU(s)")
        return 0
    console.print(f"on a {gpu / GiB:g} GiB GPU ({usable / GiB:.1f} GiB usable): up to {fit} of {K} clients on one base "
                  f"per GPU → layout: clients.clients_per_actor={fit}, clients.resources.num_gpus=1, {actors} actor(s)/GPU(s)")
    console.print(f"one base per client instead: {int(usable // est.per_actor(1))} clients per GPU "
                  f"({mib(est.per_actor(1))} MiB each)")
    if cfg.layout_chosen and cfg.clients.resources.num_gpus > 0 and \
            est.per_actor(per) > usable * cfg.clients.resources.num_gpus:
        console.print(f"[yellow]this config's layout does not fit[/]: {per} clients per actor need "
                      f"{mib(est.per_actor(per))} MiB, {cfg.clients.resources.num_gpus:g} GPU(s) of it give "
                      f"{usable * cfg.clients.resources.num_gpus / 2 ** 20:,.0f} MiB")
    return 0
