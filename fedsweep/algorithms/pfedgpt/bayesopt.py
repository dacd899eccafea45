"""Bayesian optimisation of mixing weights in [0, 1]^d with Ax (GP + acquisition, BoTorch).

Ax objects live only inside :func:`minimise`; what leaves is a plain list of
:class:`Observation` (JSON-friendly), so nothing Ax-specific crosses an actor boundary or
goes into a checkpoint. Runs are deterministic in ``seed`` (Ax's Sobol seed, and torch's
global seed for the acquisition optimiser's restarts).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

from fedsweep.lazy import torch


MODEL_BASED = "MBM"  # Ax's generation node of a GP-chosen trial (the others: CenterOfSearchSpace, Sobol)


@dataclass
class Observation:
    params: dict[str, float]
    value: float
    attached: bool = False
    generator: str = ""  # Ax's generation node that proposed it ("" for an attached prior)
    """A prior observation attached to the experiment rather than evaluated by it."""

    def to_json(self) -> dict:
        return asdict(self)


def minimise(names: list[str], objective: Callable[[dict[str, float]], float], trials: int, seed: int, *,
             prior: list[Observation] = (), init_trials: int | None = None) -> list[Observation]:
    """Minimise ``objective`` over ``{name: w ∈ [0, 1]}`` with ``trials`` evaluations.

    ``prior`` observations are attached first, in order, as completed trials (trial 0 is the
    first of them) and count towards the model's initialisation: with a prior the GP is fit on
    it from the first new trial on. Without one, the first ``init_trials`` (default d + 1:
    the centre of the box and d Sobol points) explore before the GP takes over.
    Returns the prior followed by the new observations, in trial order, each new one with the
    generation node that proposed it (``MODEL_BASED`` for the GP's).
    """
    if not names:
        raise ValueError("nothing to optimise: no mixing weights")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.INFO)  # Ax logs at INFO while it imports
        try:
            from ax import Client, RangeParameterConfig
        finally:
            logging.disable(logging.NOTSET)
        _quiet_ax()

        torch.manual_seed(seed)
        client = Client(random_seed=seed)
        client.configure_experiment(
            parameters=[RangeParameterConfig(name=_ax_name(n), parameter_type="float", bounds=(0.0, 1.0)) for n in names],
            name="mixing_weights")
        client.configure_optimization(objective="-loss")
        out: list[Observation] = []
        for obs in prior:
            index = client.attach_trial(parameters={_ax_name(n): float(obs.params[n]) for n in names})
            client.complete_trial(trial_index=index, raw_data={"loss": float(obs.value)})
            out.append(Observation(dict(obs.params), float(obs.value), attached=True))
        if prior:
            client.configure_generation_strategy(initialization_budget=0, initialize_with_center=False,
                                                 initialization_random_seed=seed)
        else:
            budget = min(trials, init_trials if init_trials is not None else len(names) + 1)
            client.configure_generation_strategy(initialization_budget=budget, initialize_with_center=True,
                                                 initialization_random_seed=seed)
        for _ in range(trials):
            for index, params in client.get_next_trials(max_trials=1).items():
                w = {n: float(params[_ax_name(n)]) for n in names}
                value = float(objective(w))
                if math.isfinite(value):
                    client.complete_trial(trial_index=index, raw_data={"loss": value})
                else:  # a diverged mix: no data for the model, never chosen
                    client.mark_trial_failed(trial_index=index)
                    value = math.inf
                out.append(Observation(w, value))
        nodes = dict(zip(*(client.summarize()[c].tolist() for c in ("trial_index", "generation_node"))))
        for index, obs in enumerate(out):
            if not obs.attached:
                obs.generator = str(nodes.get(index, ""))
    return out


def model_based(observations: list[Observation]) -> int:
    """How many of ``observations`` the GP proposed (not the centre, Sobol or an attached prior)."""
    return sum(o.generator == MODEL_BASED for o in observations)


def _quiet_ax() -> None:
    """Ax gives each of its modules an INFO logger; a client's trials would flood the run's log."""
    for name in list(logging.root.manager.loggerDict):
        if name == "ax" or name.startswith("ax."):
            logging.getLogger(name).setLevel(logging.WARNING)


def _ax_name(name: str) -> str:
    """Ax parameter names must be identifiers-like; cluster names read ``q_proj/c0``."""
    return "w_" + "".join(ch if ch.isalnum() else "_" for ch in name)


def best(observations: list[Observation], k: int = 1) -> list[Observation]:
    """The ``k`` observations of least value (ties: earlier trial first)."""
    order = sorted(range(len(observations)), key=lambda i: (observations[i].value, i))
    return [observations[i] for i in order[:k]]
