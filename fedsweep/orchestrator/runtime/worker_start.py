"""How the raylet of a local runtime starts a Python worker: forked by fedsweep's fork server where it
can be, else as Ray starts it (see :mod:`fedsweep.orchestrator.runtime.fork_server`).

The raylet runs ``python worker_start.py [site flags] default_worker.py ARGS --serialized-runtime-env-context=C
--language=L`` in place of Ray's ``setup_worker.py``. Where the context asks nothing (no command prefix,
environment variables, interpreter or entry point of its own), the language is Python and
``FEDSWEEP_FORK_SOCKET`` names a server that answers, the worker is forked there and this process
stays as the raylet's handle on it (:func:`wait_forked`). Anything else execs Ray's own
``setup_worker.py`` with the same arguments, which is what the raylet would have run.

This file is run as a script by every worker start: it imports the standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "FEDSWEEP_FORK_SOCKET"
"""Where the starter finds the fork server (the raylet passes its environment to the workers it starts)."""
RAY_SETUP_ENV = "FEDSWEEP_RAY_SETUP_WORKER"
"""Ray's own ``setup_worker.py``, which the starter execs where it does not fork."""
CONTEXT_FLAG, LANGUAGE_FLAG = "--serialized-runtime-env-context", "--language"


def split_args(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """Ray's two set-up flags (``--flag=value`` or ``--flag value``) apart from the worker's own arguments."""
    context = language = None
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        for flag in (CONTEXT_FLAG, LANGUAGE_FLAG):
            if arg == flag or arg.startswith(flag + "="):
                value = arg.split("=", 1)[1] if "=" in arg else next(it, None)
                if flag == CONTEXT_FLAG:
                    context = value
                else:
                    language = value
                break
        else:
            rest.append(arg)
    return context, language, rest


def plain_context(serialized: str | None) -> bool:
    """The runtime environment asks nothing of the worker's process (Ray's ``RuntimeEnvContext`` fields at their defaults)."""
    try:
        ctx = json.loads(serialized or "{}")
    except ValueError:
        return False
    return (not ctx.get("command_prefix") and not ctx.get("env_vars") and not ctx.get("override_worker_entrypoint")
            and not ctx.get("java_jars") and ctx.get("py_executable") in (None, sys.executable))


def request_fork(path: str, argv: list[str], env: dict[str, str], cwd: str,
                 wait_s: float = 120.0) -> tuple[socket.socket, int] | None:
    """Ask the server at ``path`` for a worker running ``argv``; the open connection and the worker's pid,
    or None where the server is not there or declines (the caller then starts the worker itself).
    ``wait_s``: how long the server may take to answer (it answers once its imports are done)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(5.0)
        conn.connect(path)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        socket.send_fds(conn, [len(body).to_bytes(4, "big")], [0, 1, 2])
        conn.sendall(body)
        conn.settimeout(wait_s)
        answer = b""
        while len(answer) < 5:
            chunk = conn.recv(5 - len(answer))
            if not chunk or answer + chunk[:1] == b"N":
                raise ConnectionError("declined")
            answer += chunk
        conn.settimeout(None)
        return conn, int.from_bytes(answer[1:5], "big")
    except (OSError, ConnectionError):
        conn.close()
        return None


ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class SignalsForWorker:
    """The signals that end a worker, caught from before the fork is asked for: each goes to the worker
    once its pid is known (:meth:`to`), one that came earlier as soon as it is; where no worker is forked
    (:meth:`release`) an earlier one ends this process as it would have without the catch."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for signum in ENDING_SIGNALS:
            signal.signal(signum, self._caught)

    def _caught(self, signum, _frame) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except OSError:
            pass

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self._send(signum)

    def release(self) -> None:
        for signum in ENDING_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        for signum in self.pending:
            os.kill(os.getpid(), signum)


def wait_forked(conn: socket.socket) -> int:
    """Stay the worker's process for the raylet (its signals passed on by :class:`SignalsForWorker`), and
    return the worker's exit status once its end of ``conn`` closes (1 where it died without saying)."""
    last = b""
    while True:
        chunk = conn.recv(64)  # (a forwarded signal's handler runs; recv resumes: PEP 475)
        if not chunk:
            break
        last = chunk[-1:]
    return last[0] if last else 1


def main(args: list[str]) -> int:
    context, language, rest = split_args(args)
    path = os.environ.get(SOCKET_ENV)
    if path and language == "PYTHON" and plain_context(context) and rest and rest[0].endswith("default_worker.py"):
        signals = SignalsForWorker()  # (from before the request: a signal while it is answered is not lost)
        forked = request_fork(path, rest, dict(os.environ), os.getcwd())
        if forked is not None:
            conn, pid = forked
            signals.to(pid)
            return wait_forked(conn)
        signals.release()
    setup = os.environ.get(RAY_SETUP_ENV)
    if not setup:
        print("fedsweep worker_start: FEDSWEEP_RAY_SETUP_WORKER is not set: cannot start Ray's worker", file=sys.stderr)
        return 1
    os.execv(sys.executable, [sys.executable, setup, *args])
    return 1  # (not reached)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
