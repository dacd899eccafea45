"""``fedsweep bench faults CONFIG [--kills N] [--seed S]``: does a run survive its faults, and what
do they cost?

What a platform team runs on its own cluster before a long study. ``--kinds`` adds the faults outside
the run (``bench.outages``): a driver killed between a round's commit and its metrics, the tracking
server, a study's driver, a worker node. The config runs twice, tracking
off, checkpoints in a scratch folder: undisturbed, then with N kills drawn from ``--seed`` and
spread over the rounds — a client actor killed inside a round (Ray restarts it; the server replays
the round's work of its clients), the server actor killed inside a round (the driver replaces it
from the newest committed round), the driver stopped after a round and the run resumed (``--resume``).
Per fault: where it landed, what recovered, and what it cost in seconds (the disturbed round's time,
or the resumption up to the next round's end, less the undisturbed round's; a kill that landed
after its round is charged to the next); at the end whether every
tensor of the final checkpoint (the server's state, every client's adapter, optimiser and method
state) equals the undisturbed run's bit for bit.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

KINDS = ("client", "server", "driver")


@dataclass
class Kill:
    round: int
    kind: str
    """client (a client actor, killed inside the round), server (the server actor, inside the round),
    driver (the run stopped after the round, then resumed)."""
    target: int = 0
    """Which client actor (client kills): this number modulo the run's actors."""
    landed: str = "not fired"
    recovered: str = ""
    cost_s: float | None = None


def plan(rounds: int, kills: int, seed: int) -> list[Kill]:
    """``kills`` faults over rounds 1..``rounds``, one kind after another (client, server, driver, …)
    in a seeded order, at rounds spread evenly with seeded jitter; a driver stop never after the last
    round (there is nothing left to resume)."""
    import numpy as np

    if kills < 0 or rounds < 1:
        raise ValueError("--kills must be ≥ 0 and the config must have rounds")
    gen = np.random.default_rng(seed)
    kinds = [KINDS[i % 3] for i in range(kills)]
    gen.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        last = rounds - 1 if kind == "driver" else rounds
        if last < 1:
            kind, last = "client", rounds
        lo = 1 + (last - 1) * i // max(kills, 1)
        hi = max(lo, 1 + (last - 1) * (i + 1) // max(kills, 1))
        out.append(Kill(int(gen.integers(lo, hi + 1)), kind, int(gen.integers(0, 1 << 16))))
    return sorted(out, key=lambda k: (k.round, KINDS.index(k.kind)))


def final_state(run_dir: Path) -> dict:
    """Every tensor of the run's newest committed round: the server's state and each client's."""
    from fedsweep import checkpoint as ckpt

    folder = ckpt.latest(Path(run_dir) / "checkpoints")
    if folder is None:
        raise RuntimeError(f"{run_dir}: no committed round")
    out = {f"server/{k}": v for k, v in ckpt.read_tensors(folder / "server.safetensors").items()}
    for f in sorted(folder.glob("client_*.safetensors")):
        out.update({f"{f.stem}/{k}": v for k, v in ckpt.read_tensors(f).items()})
    return out


@dataclass
class Timeline:
    """When each round's report reached the driver, and the segments' starts and stops."""

    ends: dict[int, float] = field(default_factory=dict)
    stops: dict[int, float] = field(default_factory=dict)
    """After which round the driver was stopped, and when."""
    starts: list[float] = field(default_factory=list)
    """When each run of the driver began its rounds."""

    def duration(self, rnd: int, start: float) -> float | None:
        """Round ``rnd``'s time from the later of the round before's end and the start of the run that
        ran it (a resumption's start-up is the driver stop's cost, not the round's)."""
        if rnd not in self.ends:
            return None
        before = max([self.ends.get(rnd - 1, start)] + [t for t in self.starts if t < self.ends[rnd]])
        return self.ends[rnd] - before


class Disturber:
    """The on_event hook of a disturbed run: fires the planned client and server kills inside their
    rounds, as each is sent to the server."""

    def __init__(self, kills: list[Kill], timeline: Timeline):
        self.kills, self.timeline = kills, timeline
        self.actors: list = []
        self.server = None
        self.current = 0

    def __call__(self, kind: str, data: Any) -> None:
        if kind == "actors":
            self.actors = list(data)
        elif kind == "server":
            self.server = data
        elif kind == "start":  # a run's rounds begin (after a resumption's start-up)
            self.timeline.starts.append(time.perf_counter())
        elif kind == "round_start":  # the round is on its way to the server: a kill now lands inside it
            self.current = data
            self._fire(data, "inside")
        elif kind == "round":
            self.timeline.ends[data["round"]] = time.perf_counter()
            self._fire(data["round"], "after")  # what a round too short to report progress left
            self.current = data["round"] + 1

    def _fire(self, rnd: int, where: str) -> None:
        import ray

        for k in self.kills:
            if k.round == rnd and k.kind in ("client", "server") and k.landed == "not fired":
                handle = self.actors[k.target % len(self.actors)] if k.kind == "client" else self.server
                k.landed = f"{where} round {rnd}"
                ray.kill(handle, no_restart=False)


def bench_faults(cfg, kills: int, seed: int, scratch: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """The undisturbed run and the disturbed one (module docstring); the faults outside the run
    (``bench.outages``) are measured against the undisturbed run's folder (``undisturbed_dir``)."""
    from fedsweep.config import validate
    from fedsweep.errors import RunError
    from fedsweep.orchestrator.runner import run

    root = Path(scratch)
    shutil.rmtree(root, ignore_errors=True)

    def config(name: str):
        raw = cfg.to_dict()
        raw["tracking"] = {**raw["tracking"], "enabled": False}
        raw["checkpoint"] = {**raw["checkpoint"], "enabled": True, "dir": str(root / name)}
        return validate(raw)

    base = Timeline()
    t0 = time.perf_counter()
    progress(f"undisturbed: {cfg.rounds} rounds of {cfg.clients.num_clients} clients")
    calm = run(config("undisturbed"), on_event=Disturber([], base))  # the same bookkeeping, no kills
    calm_s = time.perf_counter() - t0
    planned = plan(cfg.rounds, kills, seed)
    timeline = Timeline()
    t1 = time.perf_counter()
    outcomes = [calm]
    if planned:  # (no kills: nothing to disturb, the outages alone are asked for)
        progress("kills: " + ", ".join(f"{k.kind} in round {k.round}" for k in planned))
        disturber = Disturber(planned, timeline)
        disturbed_cfg = config("disturbed")
        outcomes, resume = [], False
        for stop in sorted({k.round for k in planned if k.kind == "driver"}) + [None]:
            try:
                outcomes.append(run(disturbed_cfg, resume=resume, on_event=disturber, stop_after=stop))
            except RunError as exc:
                if stop is None or "stop_after" not in str(exc):
                    raise
                timeline.stops[stop] = time.perf_counter()
                progress(f"driver stopped after round {stop}; resuming")
            resume = True
        _account(planned, outcomes, timeline, base, t0=t1, calm_start=t0)
    disturbed_s = time.perf_counter() - t1
    a, b = final_state(calm.run_dir), final_state(outcomes[-1].run_dir)
    differing = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not bitwise_equal(a[k], b[k]))
    return {"benchmark": "faults", "name": cfg.name, "clients": cfg.clients.num_clients, "rounds": cfg.rounds,
            "seed": seed, "kills": [asdict(k) for k in planned], "undisturbed_s": calm_s, "disturbed_s": disturbed_s,
            "tensors": len(a), "bitwise_equal": not differing, "differing": differing[:20], "outages": [],
            "undisturbed_dir": str(calm.run_dir), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def bitwise_equal(x, y) -> bool:
    import torch

    return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))


def _account(kills: list[Kill], outcomes: list, timeline: Timeline, base: Timeline, t0: float, calm_start: float) -> None:
    """Each kill's recovery and cost from the runs' outcomes and the two timelines."""
    rounds = {r["round"]: r for o in outcomes for r in o.rounds}
    replaced = [rep for o in outcomes for rep in o.server_replacements]
    for k in kills:
        if k.kind == "driver":
            k.landed = f"after round {k.round}" if k.round in timeline.stops else "not fired"
            nxt = k.round + 1
            if k.round in timeline.stops and nxt in timeline.ends:
                k.recovered = f"resumed from round {k.round}"
                k.cost_s = (timeline.ends[nxt] - timeline.stops[k.round]) - (base.duration(nxt, calm_start) or 0.0)
            continue
        hit = k.round if k.landed.startswith("inside") else k.round + 1  # the round that paid for it
        got, calm = timeline.duration(hit, t0), base.duration(hit, calm_start)
        if k.kind == "server":
            rep = next((r for r in replaced if r["died_in_round"] == hit), None)
            k.recovered = (f"replaced from round {rep['restored_round']} in {rep['seconds']:.1f} s, rounds "
                           f"{rep['restored_round'] + 1}–{hit} run again" if rep else "no replacement recorded")
        else:
            retried = rounds.get(hit, {}).get("metrics", {}).get("clients_retried", 0.0)
            k.recovered = (f"restarted by Ray; {int(retried)} client(s) replayed" if retried
                           else "restarted by Ray before its clients' calls")
        if got is not None and calm is not None:
            k.cost_s = got - calm


def write(result: dict[str, Any], out: str) -> Path:
    from fedsweep.bench.record import write_json

    return write_json(result, Path(out) / f"faults_{result['name']}_k{result['clients']}.json")
