"""``fedsweep params --model-config NAME``: adapter sizes and bytes per round from a model config alone."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console
from rich.table import Table


def add(sub) -> None:
    p = sub.add_parser("params", help="trainable and communicated sizes from a model config (no weights loaded)")
    p.add_argument("--model-config", required=True, help="config JSON (path, or a name in configs/models/)")
    p.add_argument("--adapter", default="lora", choices=["lora", "reft"], help="adapter kind")
    tying = p.add_mutually_exclusive_group()
    tying.add_argument("--tied", dest="tied", action="store_true", default=None,
                       help="reft: one intervention per layer, shared by all positions")
    tying.add_argument("--untied", dest="tied", action="store_false",
                       help="reft: one intervention per position group per layer (the config default, reft.tied: false)")
    p.add_argument("--share", default="W,R,b", help="reft: shared parameter types (default W,R,b)")
    p.add_argument("--layers", default=None, help="reft: comma-separated layers (default all)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules (default q_proj,v_proj)")
    p.add_argument("--bytes-per-param", type=int, default=2, help="2 for fp16/bf16 communication (default), 4 for fp32")
    p.add_argument("--clients", type=int, default=10, help="K, for per-round totals")
    p.add_argument("--prompts", type=int, default=1024, help="M public prompts, for the consensus estimate")
    p.add_argument("--tokens", type=int, default=128, help="mean response length ℓ̄ in tokens")
    p.add_argument("--bytes-per-token", type=float, default=2.0, help="c_t")
    p.set_defaults(handler=cmd_params)


def cmd_params(args: argparse.Namespace) -> int:
    import json

    from fedsweep.models.shapes import load_model_config
    from fedsweep.errors import ConfigError
    from fedsweep.models.sizes import lora_report, mib

    if args.adapter == "reft":
        from fedsweep.models.sizes import reft_report

        cfg = load_model_config(args.model_config)
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
        from fedsweep.config.schema import ReftSection

        tied = ReftSection().tied if args.tied is None else args.tied  # unless told, what a config gets
        rep = reft_report(cfg, args.rank, tied, args.share.split(","), layers, args.bytes_per_param)
        rep["tied_from"] = "config default (reft.tied)" if args.tied is None else ("--tied" if tied else "--untied")
        table = Table(title=f"{args.model_config}: LoReFT r={args.rank}, {'tied' if tied else 'untied'} "
                            f"({rep['tied_from']})")
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
