"""Small C kernels, compiled on first use by the machine's C compiler and loaded with ctypes.

A kernel is a ``.c`` file beside this module. ``load(name)`` builds it once per source, flags and
CPU (``-O3 -march=native``: the machine that runs it builds it) into ``kernels/`` of fedsweep's
cache folder (``env.cache_home``: ``$FEDSWEEP_CACHE``, else ``~/.cache/fedsweep``), writing to a temporary file and
renaming it, so processes that build at the same time do not see half a library. Where there is
no compiler (``$CC``, else ``cc``), the build fails, or ``FEDSWEEP_KERNELS=0`` is set, ``load``
returns None and the caller takes its torch path; the reason is kept in ``why_not(name)``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from fedsweep.env import cache_home

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.append("-mprefer-vector-width=512")  # where the CPU has AVX-512, use all of it (else no effect)
_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    return cache_home() / "kernels"


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (Linux), else the machine."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def library_path(name: str, compiler: str) -> Path:
    source = (Path(__file__).parent / f"{name}.c").read_bytes()
    key = hashlib.sha256(source + " ".join([compiler] + FLAGS).encode() + _cpu().encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


def _build(name: str) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} not found)")
    target = library_path(name, compiler)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(Path(__file__).parent / f"{name}.c")],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def load(name: str) -> ctypes.CDLL | None:
    """The kernel ``name`` (``name.c`` beside this module), or None where it cannot be had."""
    if os.environ.get("FEDSWEEP_KERNELS", "1") == "0":
        _reasons[name] = "FEDSWEEP_KERNELS=0"
        return None
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _build(name)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _loaded[name], _reasons[name] = None, str(exc)
        return _loaded[name]


def function(name: str, symbol: str, restype, argtypes: list):
    """``symbol`` of the kernel ``name`` with its C signature, or None where ``load`` gives None."""
    lib = load(name)
    if lib is None:
        return None
    f = getattr(lib, symbol)
    f.restype, f.argtypes = restype, argtypes
    return f


def why_not(name: str) -> str | None:
    """Why ``load(name)`` returned None (None if it did not)."""
    return _reasons.get(name)


def forget() -> None:
    """Drop what this process loaded or failed to load (tests that change the environment)."""
    with _lock:
        _loaded.clear()
        _reasons.clear()
