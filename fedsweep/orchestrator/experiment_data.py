"""An experiment's data: records from the configured source, split into clients, pool and public prompts.

Deterministic in the seed, and done in the driver before any actor starts, so bad data
fails in one line, early.
"""

from __future__ import annotations

import numpy as np

from fedsweep.algorithms import registry
from fedsweep.config import ExperimentConfig
from fedsweep.data import bundled
from fedsweep.data.partition import ClientData, make_clients, return_holdout, split_holdout
from fedsweep.data.records import Record, load_hf, load_jsonl
from fedsweep.errors import ConfigError
from fedsweep import salts


def load_records(cfg: ExperimentConfig) -> list[Record]:
    d = cfg.data
    if d.source == "reasoning_gym" and d.kind == "preference" and d.preferences == "conflicting_styles":
        records = bundled.generate_style_preferences(d.tasks, d.examples_per_task, cfg.seed)
    elif d.source == "reasoning_gym" and d.kind == "preference":
        records = bundled.generate_preferences(d.tasks, d.examples_per_task, cfg.seed)
    elif d.source == "reasoning_gym" and d.kind == "classification":
        if len(d.labels) != 2:
            raise ConfigError(f"the bundled classification data has two classes (wrong, right): data.labels has "
                              f"{len(d.labels)}")
        records = bundled.generate_verification(d.tasks, d.examples_per_task, cfg.seed, tuple(d.labels))
    elif d.source == "reasoning_gym":
        records = bundled.generate(d.tasks, d.examples_per_task, cfg.seed)
    elif d.source == "jsonl":
        records = load_jsonl(d.path, d.kind, d.max_record_bytes, d.columns)
    else:
        records = load_hf(d.path, d.split, d.kind, d.columns)
    if d.kind == "preference":  # SFT, test loss and generation use the preferred answer
        records = [{**r, "response": r["chosen"]} for r in records]
    if d.kind == "classification":  # the label is the answer accuracy is scored against
        unknown = sorted({r["label"] for r in records} - set(d.labels))
        if unknown:
            raise ConfigError(f"classification records carry label(s) {unknown[:5]} outside data.labels {d.labels}")
        records = [{**r, "response": r["label"]} for r in records]
    return records


def prepare_clients(cfg: ExperimentConfig) -> tuple[list[ClientData], list[Record]]:
    """Per-client train/test splits and the held-out pool, deterministic in the seed."""
    clients, holdout, _ = prepare_data(cfg)
    return clients, holdout


def prepare_data(cfg: ExperimentConfig) -> tuple[list[ClientData], list[Record], list[Record]]:
    """(clients, held-out pool, public prompts): the public prompts a method asks for are drawn
    from the data first and so never appear in any client's split."""
    records = load_records(cfg)
    method = registry.get(cfg.algorithm)
    caps = method.capabilities
    m = method.public_prompt_count(cfg.algo_params)
    withheld = cfg.data.public_prompts or m  # the public set, drawn out for every method where it is set
    if cfg.data.public_prompts and m > cfg.data.public_prompts:
        raise ConfigError(f"{cfg.algorithm}.public_prompts = {m} is more than the public set data.public_prompts = "
                          f"{cfg.data.public_prompts} holds")
    public: list[Record] = []
    if withheld:
        if withheld >= len(records) // 2:
            raise ConfigError(f"{cfg.algorithm}.public_prompts = {withheld}: too many for {len(records)} records"
                              if not cfg.data.public_prompts else
                              f"data.public_prompts = {withheld}: too many for {len(records)} records")
        drawn = np.random.default_rng([cfg.seed, salts.PUBLIC_PROMPTS]).choice(len(records), size=withheld, replace=False).tolist()
        pick, taken = set(drawn), set(drawn[:m])
        public = [r for i, r in enumerate(records) if i in taken]
        records = [r for i, r in enumerate(records) if i not in pick]
    rest, holdout = split_holdout(records, cfg.data.holdout_fraction, np.random.default_rng([cfg.seed, salts.HOLDOUT]))
    p = cfg.partition
    clients = make_clients(rest, p.scheme, cfg.clients.num_clients, seed=cfg.seed,
                           test_fraction=cfg.data.test_fraction, beta=p.dirichlet_beta,
                           tasks_per_client=p.tasks_per_client, min_examples=p.min_examples,
                           val_fraction=cfg.data.val_fraction)
    if cfg.data.holdout_for == "pool_methods" and not caps.validation_pool:
        return_holdout(clients, holdout, cfg.seed)  # trains on the original data; no pool is handed out
    if caps.centralized:  # one trainer with the union; everyone keeps its test split
        union = [r for c in clients for r in c.train]
        for c in clients:
            c.train = union if c.cid == 0 else []
    if cfg.data.kind == "preference" and cfg.data.preferences == "conflicting_styles":
        for c in clients:  # the odd-numbered clients prefer the verbose answer: two conflicting groups
            if c.cid % 2:
                c.train, c.test, c.val = ([bundled.prefer_verbose(r) for r in part] for part in (c.train, c.test, c.val))
    return clients, holdout, public
