"""The server actor's keeper on the driver: starts it, and replaces it when it dies.

The server actor holds a run's algorithm state and schedules its rounds; a study may run for days,
so its death is handled as a client actor's is. When a call to it fails because its process died,
the keeper

1. finds the newest committed round on disk (``checkpoint.latest``: every file checked against its
   manifest) — the round a resumed run would start from; where none is committed yet, the start;
2. brings every client actor back to it (:meth:`ClientActor.rewind`: its deferred writes finished
   first, then its clients restored from that round), as a resume would;
3. starts a new server actor from that round, in the dead one's place in the placement group;

and the driver runs the rounds after it again. Client randomness is a function of (seed, round,
client) and the server's of (seed, round), so the rounds run again are bitwise the rounds lost.
At most ``server.max_replacements`` replacements per run, each announced and counted
(``server_replacements`` in MLflow); beyond them, or with checkpoints off, the run stops with one line that names the round kept and how to go on (``--resume``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fedsweep.errors import one_line


class ServerLost(Exception):
    """The server actor's process died (not: its round raised)."""


@dataclass
class ServerKeeper:
    """How to start a server actor for a run, and the replacements made so far."""

    cfg: Any
    pg: Any
    bundle_offset: int
    actors: list
    server_args: dict[str, Any]
    """``ServerActor``'s arguments other than ``restore_from`` and ``theta0``: infos, assignment,
    state_root, public."""
    emit: Callable[[str, Any], None]
    replacements: int = 0
    log: list[dict] = field(default_factory=list)
    """One entry per replacement: the round it died in, the round restored, seconds it took."""

    def start(self, restore: str | None, theta0=None):
        """A new server actor from round folder ``restore`` (None: a new run, θ_0 from ``theta0``)."""
        from fedsweep.actors import remote

        a = self.server_args
        server = remote.server_actor(self.cfg, self.pg, self.bundle_offset).remote(
            self.cfg, a["infos"], self.actors, a["assignment"], a["state_root"], a["public"], restore, theta0)
        self.emit("server", server)
        return server

    def _rewind(self, folder: str | None) -> None:
        """Every client actor back to ``folder``; an actor that Ray is restarting (it died too) is waited
        for, up to ``server.call_timeout_s``."""
        import time

        import ray

        deadline = time.monotonic() + self.cfg.server.call_timeout_s
        waiting = list(range(len(self.actors)))
        while waiting:
            refs = {i: self.actors[i].rewind.remote(folder) for i in waiting}
            waiting = []
            for i, ref in refs.items():
                try:
                    ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    waiting.append(i)
            if waiting:
                time.sleep(0.5)

    def replace(self, dead, rnd: int, why: str):
        """A new server actor in place of ``dead`` (died in round ``rnd`` of ``why``), every client actor
        brought back to the newest committed round; (the server, the round it completed). Raises
        RunError (one line, how to go on) where that cannot be done."""
        import time

        import ray

        from fedsweep import checkpoint as ckpt
        from fedsweep.errors import RunError

        t0 = time.perf_counter()
        root = self.server_args["state_root"]
        folder = ckpt.latest(root) if self.cfg.checkpoint.enabled else None
        kept = f"round {int(folder.name.split('_')[-1])} is kept in {folder}" if folder is not None \
            else "no round was committed"
        go_on = "run the same command again with --resume" if folder is not None else "run it again"
        limit = self.cfg.server.max_replacements
        if not self.cfg.checkpoint.enabled or self.replacements >= limit:
            reason = ("checkpoints are off" if not self.cfg.checkpoint.enabled else
                      f"it was replaced {self.replacements} time(s) already (server.max_replacements: {limit})")
            raise RunError(f"the server actor died in round {rnd} ({why}); {reason}: {kept}; {go_on}")
        try:
            ray.kill(dead)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.replacements += 1
        start = folder.name if folder is not None else "the start (no round committed yet)"
        self.emit("warning", f"the server actor died in round {rnd} ({why}): replacing it from {start} "
                             f"(replacement {self.replacements} of at most {limit})")
        try:
            self._rewind(str(folder) if folder is not None else None)
        except ray.exceptions.RayError as exc:
            raise RunError(f"the server actor died in round {rnd}, and a client actor could not be brought back "
                           f"to {start}: {one_line(exc)}; {kept}; {go_on}") from None
        theta0 = [self.actors[0].initial_params.remote()] if folder is None else None
        server = self.start(str(folder) if folder is not None else None, theta0)
        completed = ray.get(server.completed_rounds.remote(), timeout=600)
        self.log.append({"died_in_round": rnd, "restored_round": completed, "seconds": time.perf_counter() - t0,
                         "why": why})
        return server, completed
