"""Operator calls of a piece of work, counted with ``torch.profiler``: a GPU's kernel launches,
seen on a CPU.

Each ``aten::`` call the profiler records is one dispatch (a nested one too: ``aten::linear``
calls ``aten::t`` and ``aten::addmm``, three calls). Most launch a kernel on a GPU; views and
metadata (``view``, ``as_strided``, ``detach``, …) and allocations (``empty``) do not: they cost host
time, not a launch. Both counts are reported: every call, and the *compute* calls (every call
less :data:`NO_KERNEL`), the closer stand-in for launches.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable

NO_KERNEL = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias",
    "aten::select", "aten::slice", "aten::narrow", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::chunk", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::expand_as", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::to", "aten::numpy_T", "aten::unflatten", "aten::flatten", "aten::view_as", "aten::result_type",
    "aten::is_nonzero", "aten::requires_grad_", "aten::set_", "aten::resize_", "aten::_has_compatible_shallow_copy_type",
})
"""Calls that launch no kernel: views, metadata and allocations (``aten::to`` dispatches its
copy as ``aten::_to_copy``/``aten::copy_``, which are counted)."""


def count_ops(work: Callable[[], Any], host: bool = True) -> dict[str, Any]:
    """Run ``work()`` under torch's profiler (CPU) and count its ``aten::`` calls:
    ``aten_calls`` (every one), ``compute_calls`` (less :data:`NO_KERNEL`) and the ten most frequent;
    calls inside :func:`fedsweep.host_work.host_work` blocks (a method's host work) are counted apart
    (``apart_aten_calls``, ``apart_compute_calls``), not in the others; ``host=False`` runs them
    unprofiled (those two counts 0: a method's host work can be millions of calls and minutes of
    profiling). The profiler's window closes at each such block's edges, so memory holds one block's
    events at a time. ``result``: what ``work()`` returned."""
    import torch

    from fedsweep.host_work import watched_by

    names, aside = Counter(), Counter()

    def opened():
        # torch's profiler without Kineto: the same ``aten::`` events as ``torch.profiler.profile`` with
        # CPU activity (checked on a grouped round: 4,175 both), without Kineto's two lines on stderr per call
        prof = torch.autograd.profiler.profile(use_kineto=False)
        prof.__enter__()
        return prof

    def closed(prof, into: Counter) -> None:
        prof.__exit__(None, None, None)
        into.update(e.name for e in prof.function_events if e.name.startswith("aten::"))

    @contextmanager
    def host_block():  # the model's window closed around a block of host work, reopened after it
        nonlocal model
        closed(model, names)
        inner = opened() if host else None
        try:
            yield
        finally:
            if inner is not None:
                closed(inner, aside)
            model = opened()

    model = opened()
    try:
        with watched_by(host_block):
            result = work()
    finally:
        closed(model, names)
    compute = Counter({n: c for n, c in names.items() if n not in NO_KERNEL})
    return {"aten_calls": sum(names.values()), "compute_calls": sum(compute.values()),
            "apart_aten_calls": sum(aside.values()),
            "apart_compute_calls": sum(c for n, c in aside.items() if n not in NO_KERNEL),
            "top_calls": names.most_common(10), "top_compute_calls": compute.most_common(10), "result": result}


def profile_kernels(work: Callable[[], Any], top: int = 15) -> dict[str, Any]:
    """Run ``work()`` under torch's profiler with CUDA activity and sum up what the GPU did: the kernels
    (and copies) launched, their summed device time, the ``top`` kernels by device time and the ``top``
    operators by host (self CPU) time. The caller times the same work unprofiled: the profiler's own
    host cost inflates the wall time it sees."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        work()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            slot = kernels.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += e.time_range.elapsed_us()
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    ops = sorted((a for a in prof.key_averages() if a.key.startswith("aten::")), key=lambda a: -a.self_cpu_time_total)[:top]
    return {"kernels": int(sum(c for c, _ in kernels.values())),
            "kernel_seconds": sum(t for _, t in kernels.values()) / 1e6,
            "top_kernels": [{"name": name[:120], "calls": c, "seconds": t / 1e6} for name, (c, t) in ranked],
            "top_host_ops": [{"name": a.key, "calls": a.count, "self_cpu_seconds": a.self_cpu_time_total / 1e6}
                             for a in ops]}
