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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable

from fedsweep.host_work import host_work
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


class Search:
    """One minimisation of an objective over ``{name: w ∈ [0, 1]}`` with Ax, asked and told a trial at a
    time (:meth:`ask`, :meth:`tell`), so that the objective of many searches (a training group's clients)
    can be evaluated together between their steps.

    ``prior`` observations are attached first, in order, as completed trials (trial 0 is the first of
    them) and count towards the model's initialisation: with a prior the GP is fit on it from the first
    new trial on. Without one, the first ``init_trials`` (default d + 1: the centre of the box and d
    Sobol points) explore before the GP takes over. Deterministic in ``seed``: Ax's own seed, and torch's
    global generator, which Ax's acquisition optimiser draws its restarts from, seeded with it and kept
    per search (swapped in around each of its Ax calls), so searches advanced in turn draw exactly what
    each would alone. ``fit_seconds``: the time spent in Ax (GP fits, acquisition)."""

    def __init__(self, names: list[str], trials: int, seed: int, *, prior: list[Observation] = (),
                 init_trials: int | None = None):
        if not names:
            raise ValueError("nothing to optimise: no mixing weights")
        self.names, self.trials = list(names), trials
        self.out: list[Observation] = []
        self.fit_seconds = 0.0
        self._pending: tuple[int, dict[str, float]] | None = None
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            with self._ax():
                from ax import Client, RangeParameterConfig

                self.client = client = Client(random_seed=seed)
                client.configure_experiment(
                    parameters=[RangeParameterConfig(name=_ax_name(n), parameter_type="float", bounds=(0.0, 1.0))
                                for n in names], name="mixing_weights")
                client.configure_optimization(objective="-loss")
                for obs in prior:
                    index = client.attach_trial(parameters={_ax_name(n): float(obs.params[n]) for n in names})
                    client.complete_trial(trial_index=index, raw_data={"loss": float(obs.value)})
                    self.out.append(Observation(dict(obs.params), float(obs.value), attached=True))
                if prior:
                    client.configure_generation_strategy(initialization_budget=0, initialize_with_center=False,
                                                         initialization_random_seed=seed)
                else:
                    budget = min(trials, init_trials if init_trials is not None else len(names) + 1)
                    client.configure_generation_strategy(initialization_budget=budget, initialize_with_center=True,
                                                         initialization_random_seed=seed)
        finally:
            self._rng = torch.get_rng_state()
            torch.set_rng_state(outside)
        self._asked = 0

    @contextmanager
    def _ax(self):
        """Ax quiet, its warnings off, this search's torch generator state in place (and kept), the time counted."""
        import time

        t0 = time.perf_counter()
        with warnings.catch_warnings(), host_work():  # (counted apart from the model's calls)
            warnings.simplefilter("ignore")
            logging.disable(logging.INFO)  # Ax logs at INFO while it imports
            try:
                import ax  # noqa: F401
            finally:
                logging.disable(logging.NOTSET)
            _quiet_ax()
            yield
        self.fit_seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self._asked >= self.trials

    def ask(self) -> dict[str, float]:
        """The next trial's point (Ax's proposal: the centre, a Sobol point or the GP's)."""
        if self._pending is not None or self.done:
            raise RuntimeError("ask after tell, and only until the search's trials are spent")
        outside = torch.get_rng_state()
        torch.set_rng_state(self._rng)
        try:
            with self._ax():
                (index, params), = self.client.get_next_trials(max_trials=1).items()
        finally:
            self._rng = torch.get_rng_state()
            torch.set_rng_state(outside)
        self._pending = (index, {n: float(params[_ax_name(n)]) for n in self.names})
        return dict(self._pending[1])

    def tell(self, value: float) -> None:
        """The asked point's objective value (a non-finite one: no data for the model, never chosen)."""
        index, w = self._pending
        self._pending = None
        self._asked += 1
        value = float(value)
        with self._ax():
            if math.isfinite(value):
                self.client.complete_trial(trial_index=index, raw_data={"loss": value})
            else:
                self.client.mark_trial_failed(trial_index=index)
                value = math.inf
        self.out.append(Observation(w, value))

    def observations(self) -> list[Observation]:
        """The prior followed by the new observations, in trial order, each new one with the generation
        node that proposed it (``MODEL_BASED`` for the GP's)."""
        with self._ax():
            nodes = dict(zip(*(self.client.summarize()[c].tolist() for c in ("trial_index", "generation_node"))))
        for index, obs in enumerate(self.out):
            if not obs.attached:
                obs.generator = str(nodes.get(index, ""))
        return self.out


def minimise(names: list[str], objective: Callable[[dict[str, float]], float], trials: int, seed: int, *,
             prior: list[Observation] = (), init_trials: int | None = None) -> list[Observation]:
    """Minimise ``objective`` over ``{name: w ∈ [0, 1]}`` with ``trials`` evaluations, one after another
    (a :class:`Search` told each value as it comes); its :meth:`Search.observations`."""
    search = Search(names, trials, seed, prior=prior, init_trials=init_trials)
    while not search.done:
        search.tell(objective(search.ask()))
    return search.observations()


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
