"""Which sampled clients answer a round: dropout, a simulated deadline and over-selection.

All of it is simulated and seeded, so a run with unreliable clients is as reproducible as one
without (the wall-clock guard on a call stays ``server.call_timeout_s``):

* a client's speed is ``clients.speed.examples_per_s`` · exp(σ z_k), z_k ~ N(0, 1) drawn once from
  (seed, client); its simulated time for a round is its local steps × batch size over its speed;
* a sampled client drops with probability ``clients.dropout``, drawn from (seed, round, client);
* with ``server.deadline_s``, a client whose simulated time is later than the deadline is late;
* with ``clients.over_selection`` the round samples that many more clients and keeps the
  ⌈fraction · K⌉ that would answer first (simulated time, then client id), the rest late.

A client that drops or is late is not trained that round: its adapter, optimiser and method state
stay where they were (the server never sees an update it would have to discard, and the client is
not advanced by a round whose result is not taken).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from fedsweep import salts


@dataclass
class Participation:
    sampled: list[int]
    answering: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    seconds: dict[int, float] = field(default_factory=dict)
    """Each sampled client's simulated seconds for the round."""

    def as_dict(self) -> dict:
        return {"sampled": self.sampled, "answering": self.answering, "dropped": self.dropped, "late": self.late,
                "simulated_seconds": {str(k): v for k, v in self.seconds.items()}}


def sample_clients(seed: int, rnd: int, clients) -> list[int]:
    """``clients.per_round`` (max(1, ⌈C·K⌉)) distinct clients and ``clients.over_selection`` more, a pure
    function of (seed, round)."""
    m = min(clients.num_clients, clients.per_round + clients.over_selection)
    rng = np.random.default_rng([seed, salts.SAMPLE_CLIENTS, rnd])
    return sorted(rng.choice(clients.num_clients, size=m, replace=False).tolist())


def answering(cfg, rnd: int, examples: dict[int, int] | None = None) -> Participation:
    """Round ``rnd``'s participation as the server will decide it (``examples``: each client's training
    examples, where its steps depend on them; with ``train.steps`` they do not)."""
    return decide(cfg, rnd, sample_clients(cfg.seed, rnd, cfg.clients), examples or {})


def speed(seed: int, cid: int, examples_per_s: float, sigma: float) -> float:
    z = float(np.random.default_rng([seed, salts.CLIENT_SPEED, cid]).standard_normal())
    return examples_per_s * math.exp(sigma * z)


def decide(cfg, rnd: int, sampled: list[int], examples: dict[int, int]) -> Participation:
    """Who of ``sampled`` answers round ``rnd`` (``examples``: each client's training examples)."""
    cc, tc = cfg.clients, cfg.train
    out = Participation(list(sampled))
    for cid in sampled:
        work = tc.steps_for(examples.get(cid, 0)) * tc.batch_size
        out.seconds[cid] = work / speed(cfg.seed, cid, cc.speed.examples_per_s, cc.speed.sigma)
    alive = []
    for cid in sampled:
        if cc.dropout and np.random.default_rng([cfg.seed, salts.DROPOUT, rnd, cid]).random() < cc.dropout:
            out.dropped.append(cid)
        elif cfg.server.deadline_s is not None and out.seconds[cid] > cfg.server.deadline_s:
            out.late.append(cid)
        else:
            alive.append(cid)
    if cc.over_selection:
        want = cc.per_round
        first = sorted(alive, key=lambda c: (out.seconds[c], c))
        out.late += first[want:]
        alive = first[:want]
    out.answering = sorted(alive)
    out.late.sort()
    return out
