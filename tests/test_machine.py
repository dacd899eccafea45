"""The machine record beside reports and benchmarks (fedsweep/machine.py)."""

from __future__ import annotations

import json

from fedsweep import machine


def test_cpu_model_reads_the_kernels_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                    "flags\t\t: fpu avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert machine.cpu_model(info) == "AMD EPYC 9654 96-Core Processor"


def test_cpu_model_falls_back_where_the_kernel_does_not_say(tmp_path, monkeypatch):
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")
    assert machine.cpu_model(tmp_path / "absent") == "arm"
    empty = tmp_path / "cpuinfo"
    empty.write_text("processor\t: 0\nmodel name\t:\n")
    assert machine.cpu_model(empty) == "arm"
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert machine.cpu_model(empty) == "unknown"


def test_machine_names_the_cpu_its_kernels_and_no_gpu_here():
    import os
    import platform
    import re
    from pathlib import Path

    import torch

    record = machine.machine()
    info = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(\S.*?)\s*$", info.read_text(), re.M) if info.exists() else None
    assert record["cpu"] == (found.group(1) if found else platform.processor() or "unknown")
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert 1 <= record["cpus"] <= os.cpu_count()
    assert record["gpu"] is None  # the suite runs on CPUs
    json.dumps(record)  # it travels in reports' JSON block and bench files


def test_reports_and_bench_files_carry_it(tmp_path):
    from fedsweep.bench.record import write_json
    from fedsweep.reproduce.card_report import provenance

    assert provenance(None, [])["machine"] == machine.machine()
    out = json.loads(write_json({"benchmark": "x"}, tmp_path / "b.json").read_text())
    assert out["provenance"]["machine"] == machine.machine()
    assert out["provenance"]["device"] == "cpu"  # the GPU's name where there is one


def test_without_torch_the_record_says_unknown(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    record = machine.machine()
    assert record["torch_cpu_capability"] == record["gpu"] == "unknown"
