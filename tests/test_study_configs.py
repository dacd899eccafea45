"""The shipped studies: the main job and every budget of the reproduction cards (cpu, gpu-small, the
paper-scale gpu) validate, sized as their headers say, without touching the network."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsweep.config import validate
from fedsweep.config.sweep import load_sweep, trial_raw

SWEEPS = Path(__file__).resolve().parents[1] / "configs" / "sweeps"
CARDS = sorted((SWEEPS.parent / "reproductions").glob("*.yaml"))


def _trials(path: Path, overrides: list[str] | None = None):
    sweep, base = load_sweep(str(path), overrides or [])
    cfgs = [validate(trial_raw(base, sweep, {"variant": v, "seed": sweep.seeds[0],
                                             **{k: d.examples()[0] for k, d in sweep.space.items()}}))
            for v in (sweep.variants or {"_": {}})]
    return sweep, cfgs


def _card_trials(path: Path, budget: str):
    """Every variant's trial config of a card's budget (first seed), and the card."""
    import tempfile

    from fedsweep.config.card import load_card
    from fedsweep.reproduce.card_run import study_file

    card, _ = load_card(str(path))
    with tempfile.TemporaryDirectory() as tmp:
        sweep, cfgs = _trials(study_file(card, budget, path, Path(tmp)))
    return card, sweep, cfgs


def test_paper_scale_studies_are_the_cards_gpu_budgets():
    """The paper-scale GPU sweeps are the cards' gpu budgets, not files beside them."""
    assert not list(SWEEPS.glob("reproduce_*.yaml"))
    with_gpu = {p.stem for p in CARDS if "gpu:" in p.read_text()}
    assert {"drift", "fedicu", "fedreft", "fedcofit", "pfedgpt", "premise"} <= with_gpu


@pytest.mark.parametrize("path", [p for p in CARDS if "\n  gpu:" in p.read_text()], ids=lambda p: p.stem)
def test_a_cards_gpu_budget_is_set_for_gpus(path):
    card, _, cfgs = _card_trials(path, "gpu")
    assert card.budgets["gpu"].differs
    for cfg in cfgs:
        assert cfg.clients.resources.num_gpus >= 1 and cfg.model.dtype == "bfloat16"
        assert "/" in cfg.model.name, "a hub model id (overridable to a local path)"


GPU_SMALL = [p for p in CARDS if "\n  gpu-small:" in p.read_text()]


def test_the_premise_and_the_seed_method_cards_have_a_gpu_small_budget():
    assert {"premise", "drift", "fedicu", "fedreft", "fedcofit", "pfedgpt"} <= {p.stem for p in GPU_SMALL}


@pytest.mark.parametrize("path", GPU_SMALL, ids=lambda p: p.stem)
def test_a_gpu_small_budget_runs_the_bundled_model_on_a_shared_gpu_with_the_cards_seeds(path):
    """16-20 clients, at least 20 rounds, the bundled weights (no hub), trials sharing one GPU, the
    card's seeds, and every cpu row at the larger size."""
    card, sweep, cfgs = _card_trials(path, "gpu-small")
    budget = card.budgets["gpu-small"]
    assert budget.minutes is not None and budget.minutes <= 8
    assert sweep.seeds == card.budgets["cpu"].study["seeds"]
    assert set(sweep.variants) == set(card.budgets["cpu"].study["variants"])
    for cfg in cfgs:
        assert cfg.model.name == "smollm2-135m-instruct" and 16 <= cfg.clients.num_clients <= 20 and cfg.rounds >= 20
        assert 0 < cfg.clients.resources.num_gpus < 1, "trials share the GPU"
        assert cfg.clients.clients_per_actor == cfg.clients.num_clients, "one group a trial"


def _actor_cpus_here(cfg) -> float:
    """CPUs the trial's client actors take on a 2-core machine (its layout chosen as a run would)."""
    from fedsweep.plan.layout import Cluster
    from fedsweep.plan.resolve import resolve_layout
    from fedsweep.orchestrator.study import DRIVER_BUNDLE

    if not cfg.layout_chosen:
        cfg, _ = resolve_layout(cfg, Cluster(cpus=3 - cfg.server.resources.num_cpus - DRIVER_BUNDLE["CPU"]))
    return cfg.num_actors * cfg.clients.resources.num_cpus


def test_paper_scale_settings():
    _, _, cfgs = _card_trials(SWEEPS.parent / "reproductions" / "drift.yaml", "gpu")
    assert all(c.clients.num_clients == 16 and c.rounds == 25 and c.lora.r == 16 for c in cfgs)
    _, _, cfgs = _card_trials(SWEEPS.parent / "reproductions" / "fedicu.yaml", "gpu")
    assert all(c.clients.num_clients == 16 and c.rounds == 20 for c in cfgs)
    _, _, cfgs = _card_trials(SWEEPS.parent / "reproductions" / "pfedgpt.yaml", "gpu")
    assert all(c.partition.scheme == "dirichlet" and c.partition.dirichlet_beta == 0.5 for c in cfgs)


def test_main_study_asks_a_question_its_runs_can_answer():
    """The main job: seven methods against FedAvg on test loss; its question's rows are tested with the
    run as the unit, so it runs at least 3 seeds, and its header states, before the run, the
    difference the verdicts' rule can detect with them for the spread it quotes; CPU-only, a trial
    on at most one core so two run at once on 2 cores."""
    import math

    from fedsweep.reports.verdicts import detectable_effect

    sweep, cfgs = _trials(SWEEPS / "main.yaml")
    assert sweep.metric == "test_loss" and sweep.mode == "min" and "fedavg" in sweep.variants
    assert len(sweep.variants) == 7
    assert set(sweep.question.rows) == set(sweep.variants) - {"fedavg", "fedicu"}  # the methods keeping own models
    n, m = len(sweep.seeds), len(sweep.question.rows)
    assert n >= 3
    low, high = (detectable_effect(sd / math.sqrt(n), n - 1, 0.05, m) for sd in (0.07, 0.10))
    header = " ".join(line[1:].strip() for line in (SWEEPS / "main.yaml").read_text().splitlines() if line.startswith("#"))
    assert f"with {n} seeds, Holm over {m} rows" in header and f"{low:.2f}-{high:.2f} nats" in header
    for cfg in cfgs:
        assert cfg.clients.resources.num_gpus == 0 and _actor_cpus_here(cfg) <= 0.85
        assert cfg.partition.scheme == "task" and cfg.clients.num_clients % len(cfg.data.tasks) == 0


def test_the_main_studys_pfedgpt_runs_model_based_trials_in_both_stages():
    """The demo's pFedGPT budget lets the GP act: its own HBO, on LoRA tensors of the demo's target
    modules, records at least one trial the GP proposed in stage 1 and in stage 2 (Ax's generation
    node, not the centre or Sobol)."""
    import torch

    from fedsweep.algorithms import registry
    from fedsweep.algorithms.pfedgpt.plugin import GLOBAL, INIT
    from fedsweep.algorithms.types import ClientContext, Payload

    sweep, cfgs = _trials(SWEEPS / "main.yaml")
    cfg = next(c for c in cfgs if c.algorithm == "pfedgpt")
    algo = registry.create("pfedgpt", {**cfg.algo_params.model_dump(), "slow_start": False})
    g = torch.Generator().manual_seed(0)

    def lora(scale: float) -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn.{m}.lora_{f}.weight": torch.randn(4, 4, generator=g) * scale
                for i in range(3) for m in cfg.lora.target_modules for f in "AB"}

    glob, local, prev = lora(1.0), lora(1.0), lora(0.5)
    target = {k: 0.3 * local[k] + 0.7 * glob[k] for k in glob}
    ctx = ClientContext(cid=0, rnd=2, num_examples=10, local_params=local, payload=Payload(params=glob),
                        state={**{GLOBAL + k: v for k, v in prev.items()}, **{INIT + k: v for k, v in prev.items()}},
                        meta={"v_high": [0, 1, 2, 3], "v_high_labels": [0, 0, 1, 1], "losses": [3.0]},
                        pool_loss=lambda p, idx: float(sum(((p[k] - target[k]) ** 2).mean() for k in p)), seed=0)
    algo.client_prepare(ctx, Payload(params=glob))
    info = ctx.meta["round_info"]
    assert len(ctx.meta["hbo"]["stage1"]) == cfg.algo_params.stage1_trials
    assert info["stage1_model_based_trials"] >= 1, ctx.meta["hbo"]["stage1"]
    assert info["stage2_model_based_trials"] == cfg.algo_params.stage2_trials
    # with the default exploration (d + 1 = 5 > 4 trials) stage 1 would have had none
    assert cfg.algo_params.stage1_trials <= len(cfg.lora.target_modules) + 1
