"""``fedsweep algorithms``: the registered methods, what they need, their hyperparameters."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console
from rich.table import Table


def add(sub) -> None:
    p = sub.add_parser("algorithms", help="list registered methods with their hyperparameters and defaults")
    p.set_defaults(handler=cmd_algorithms)


def cmd_algorithms(_: argparse.Namespace) -> int:
    from fedsweep.algorithms import registry

    table = Table(title="fedsweep algorithms", show_lines=False)
    for col in ("name", "kind", "needs / accepts", "hyperparameters (default)", "summary"):
        table.add_column(col)
    for name in registry.names():
        cls = registry.get(name)
        caps = cls.capabilities
        fields = cls.Params.model_fields
        hp = ", ".join(f"{k}={f.default!r}" for k, f in fields.items()) or "—"
        needs = [f"adapters {'/'.join(caps.adapters)}"] + [label for flag, label in (
            (caps.mixed_ranks, "mixed ranks"), (caps.mixed_models, "mixed models"), (caps.public_prompts, "public prompts"),
            (caps.validation_pool, "validation pool"), (caps.client_encoder or caps.server_encoder, "sentence encoder"),
            (caps.base_merges, "base merges"), (caps.centralized, "reference row")) if flag]
        table.add_row(name, "personalised" if caps.personalized else "global", ", ".join(needs), hp, cls.summary)
    console.print(table)
    return 0
