"""The plugin contract, checked for every registered method on the tiny model (in-process, no Ray).

For each name in the registry: the declared capabilities are consistent with what the config
accepts (declared adapters validate, others are refused in one line naming the method); one round
on a real ClientActor — ``dispatch`` covers every sampled client (the centralized row: client 0
for all), every client trains on its payload, ``aggregate`` returns a ServerState and a Report —
and the state survives a checkpoint round trip: the restored state gives every client the same
evaluation payload, and evaluating with it gives a finite loss. The layering rule (no module
imports from a layer above it) is checked here too.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from fedsweep.algorithms.types import ServerContext
import torch

from fedsweep import checkpoint as ckpt
from fedsweep.algorithms import registry
from fedsweep.algorithms.base import Capabilities, HyperParams
from fedsweep.algorithms.types import AggregationContext, ClientInfo, Payload, Report, ServerState
from fedsweep.config import ConfigError, validate
from fedsweep.orchestrator.experiment_data import prepare_data

from in_process import client_actor

TASKS = ["basic_arithmetic", "gcd"]
# the smallest settings of methods whose defaults are sized for real studies
SMALL = {"fedcofit": {"public_prompts": 3, "max_new_tokens": 4}, "pfedgpt": {"validation_size": 4},
         "fedreft": {"alpha_tuning": "fixed"}}


def _raw(name: str, adapter: str) -> dict:
    raw = {"name": "contract", "algorithm": name, "adapter": adapter, "seed": 3, "rounds": 1,
           "lora": {"r": 4}, "reft": {"rank": 2}, "data": {"tasks": TASKS, "examples_per_task": 12},
           "partition": {"scheme": "iid"}, "clients": {"num_clients": 2, "clients_per_actor": 2},
           "train": {"steps": 1, "batch_size": 2, "max_length": 64}, "eval": {"max_new_tokens": 0, "batch_size": 4},
           "tracking": {"enabled": False}, "checkpoint": {"enabled": False}}
    if name in SMALL:
        raw[name] = dict(SMALL[name])
    return raw


def _equal_sets(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", registry.names())
def test_capabilities_are_declared_and_adapters_outside_them_are_refused_in_one_line(name):
    cls = registry.get(name)
    assert isinstance(cls.capabilities, Capabilities) and registry.capabilities(name) is cls.capabilities
    assert issubclass(cls.Params, HyperParams) and cls.summary
    for adapter in ("lora", "reft"):
        if adapter in cls.capabilities.adapters:
            assert validate(_raw(name, adapter)).adapter == adapter
        else:
            with pytest.raises(ConfigError) as info:
                validate(_raw(name, adapter))
            message = str(info.value)
            assert "\n" not in message and f"'{name}'" in message and adapter in message


@pytest.mark.parametrize("name", registry.names())
def test_one_round_dispatch_aggregate_and_checkpoint_round_trip(name, tmp_path):
    _one_round(name, tmp_path)


def _one_round(name: str, tmp_path: Path):
    """One round of method ``name`` on a real ClientActor; asserts the contract; (state, results)."""
    cls = registry.get(name)
    caps = cls.capabilities
    cfg = validate(_raw(name, caps.adapters[0]))
    clients, pool, public = prepare_data(cfg)
    hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val} for c in clients]
    actor = client_actor(cfg, hosted, None, pool if caps.validation_pool else None)
    algo = registry.create(name, cfg.algo_params)
    embed = None
    if caps.server_encoder:
        from fedsweep.models.encoder import load_encoder

        embed = load_encoder(algo.server_encoder_name())
    ranks = cfg.client_ranks()
    infos = [ClientInfo(cid=c.cid, num_examples=len(c.train), tasks=c.tasks, rank=ranks[c.cid],
                        lora_scale=cfg.lora.alpha / ranks[c.cid]) for c in clients]
    state = algo.init(actor.initial_params(), ServerContext(infos, public if caps.public_prompts else None, embed))
    assert isinstance(state, ServerState)

    sampled = [0, 1]
    payloads = algo.dispatch(1, sampled, state)
    assert set(payloads) == ({0} if caps.centralized else set(sampled))
    assert all(isinstance(p, Payload) for p in payloads.values())
    results = [actor.train(1, cid, p) for cid, p in sorted(payloads.items())]
    assert all(math.isfinite(r.metrics["train_loss"]) for r in results)
    state, report = algo.aggregate(1, results, state, AggregationContext(embed=embed))
    assert isinstance(state, ServerState) and isinstance(report, Report)
    final = algo.final_payloads(state, sampled)
    if final:
        for cid, p in final.items():
            actor.train(1, cid, p)

    ckpt.write_tensors(tmp_path / "server.safetensors", ckpt.server_state_tensors(state))
    ckpt.write_json(tmp_path / "server.json", {"algorithm": state.meta})
    restored = ckpt.server_state_from(ckpt.read_tensors(tmp_path / "server.safetensors"),
                                      ckpt.read_json(tmp_path / "server.json")["algorithm"])
    assert json.dumps(restored.meta, sort_keys=True) == json.dumps(state.meta, sort_keys=True)
    assert (restored.globals is None) == (state.globals is None)
    if state.globals is not None:
        assert _equal_sets(restored.globals, state.globals)
    assert restored.personal.keys() == state.personal.keys()
    assert all(_equal_sets(restored.personal[c], state.personal[c]) for c in state.personal)
    assert restored.buffers.keys() == state.buffers.keys()
    for cid in sampled:
        before, after = algo.eval_payload(state, cid), algo.eval_payload(restored, cid)
        assert (before.params is None) == (after.params is None)
        if before.params is not None:
            assert _equal_sets(before.params, after.params)
        assert math.isfinite(actor.evaluate(1, cid, after)["test_loss"])
    return state, results


def test_the_example_method_in_the_architecture_doc_registers_and_runs(tmp_path):
    """docs/architecture.md's ten-line method: registered by running the doc's code, it validates in a
    config, passes the contract round, and its aggregate is numpy's coordinate-wise median."""
    import re

    import numpy as np

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 16
    from fedsweep.algorithms import registry as reg

    try:
        exec(compile(code, "docs/architecture.md", "exec"), {"__name__": "architecture_example"})
        assert "coord_median" in reg.names() and validate(_raw("coord_median", "lora")).algorithm == "coord_median"
        state, results = _one_round("coord_median", tmp_path)
        for key, value in state.globals.items():
            stack = np.stack([r.upload.params[key].numpy() for r in results])
            expected = np.sort(stack, axis=0)[(len(results) - 1) // 2]  # torch's median: the lower middle
            np.testing.assert_array_equal(value.numpy(), expected)
    finally:
        reg._REGISTRY.pop("coord_median", None)


def test_every_registered_method_has_a_page_naming_its_options():
    docs = Path(__file__).resolve().parents[1] / "docs" / "methods"
    for name in registry.names():
        page = docs / f"{name}.md"
        assert page.is_file(), f"no docs/methods/{name}.md"
        text = page.read_text()
        assert "Paper" in text and "## Options" in text and "## Not implemented" in text, name
        for option in registry.get(name).Params.model_fields:
            assert f"`{name}.{option}`" in text, f"docs/methods/{name}.md does not document {name}.{option}"


# ----------------------------------------------------------------------------- layering

# a module may import from its own layer or a lower one, never from a higher one
LAYERS = {"cli": 11, "reproduce": 10, "bench": 9, "reports": 9, "orchestrator": 8, "actors": 7, "engine": 6, "plan": 5,
          "config": 4, "models": 3, "federation": 2, "checkpoint": 2,
          "algorithms": 1, "data": 1, "storage": 1, "tensor_file": 1, "metrics": 1, "env": 0, "errors": 0,
          "process_start": 0, "lazy": 0, "kernels": 0, "salts": 0, "provenance": 0, "machine": 0, "host_work": 0}


def test_no_module_imports_from_a_layer_above_it():
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    wrong = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == "__init__":
            continue
        assert parts[0] in LAYERS, f"fedsweep/{parts[0]} is in no layer: give it one in LAYERS"
        layer = LAYERS[parts[0]]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedsweep."):
                targets = [node.module.split(".")[1]]
            elif isinstance(node, ast.ImportFrom) and node.module == "fedsweep":
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] for a in node.names if a.name.startswith("fedsweep.")]
            wrong += [f"{path.relative_to(root)} imports fedsweep.{t}" for t in targets if LAYERS[t] > layer]
    assert not wrong, wrong


# the orchestrator's rooms: a room imports only from rooms of a lower rank (the command line at the top,
# the consoles at the bottom), so no two rooms import each other
ROOMS = {"study": 4, "runner": 3, "jobs": 2, "experiment_data": 2, "run_dirs": 2, "preflight": 3, "server_keeper": 2,
         "study_view": 1, "runtime": 1, "tracking": 1, "terminal": 0}


def _fedsweep_imports(path: Path) -> list[str]:
    """Every fedsweep module ``path`` imports, at module level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedsweep"):
            out += [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("fedsweep")]
    return out


def test_the_orchestrators_rooms_import_downwards_only():
    root = Path(__file__).resolve().parents[1] / "fedsweep" / "orchestrator"
    wrong = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts == ("__init__",):
            continue
        here = parts[0]
        assert here in ROOMS, f"fedsweep/orchestrator/{here} is in no room: give it one in ROOMS"
        for target in _fedsweep_imports(path):
            bits = target.split(".")
            if bits[:2] != ["fedsweep", "orchestrator"] or len(bits) < 3 or bits[2] not in ROOMS or bits[2] == here:
                continue
            if ROOMS[bits[2]] >= ROOMS[here]:
                wrong.append(f"orchestrator/{'/'.join(parts)} imports {target}")
    assert not wrong, wrong


def _import_graph(extra: dict[str, list[str]] | None = None):
    """Every module of ``fedsweep/`` and what it imports (``from package import module`` counts the
    package too: Python runs its ``__init__`` first), imports inside functions included; ``extra``:
    planted imports."""
    import networkx as nx

    root = Path(__file__).resolve().parents[1]
    modules = {}
    for path in (root / "fedsweep").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    g = nx.DiGraph()
    for name, path in modules.items():
        for target in _fedsweep_imports(path) + (extra or {}).get(name, []):
            if target in modules and target != name:
                g.add_edge(name, target)
    return g


def test_no_import_cycle_anywhere_in_fedsweep():
    """Module by module over all of ``fedsweep/`` (preflight and tracking used to import each other;
    DRIFT's divergence, fused and graph did; the plugin registry imported its package back)."""
    import networkx as nx

    g = _import_graph()
    assert g.number_of_edges() > 300
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles[:5]
    planted = _import_graph({"fedsweep.algorithms.drift.layout": ["fedsweep.algorithms.drift.graph"]})
    assert list(nx.simple_cycles(planted))  # the check sees a circle where one is planted


def test_only_the_tracking_module_imports_mlflow():
    """The driver prepares MLflow's store in a thread while Ray starts (``orchestrator.preflight``);
    another thread importing MLflow at the same time is safe only through ``orchestrator.tracking.mlflow_api``,
    whose module lock it then waits on (inside MLflow's own circular imports two threads can meet a
    module half-initialised)."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(root)}: {n}" for n in names if n == "mlflow" or n.startswith("mlflow.")]
    assert found and all(f.startswith("orchestrator/tracking/mlflow_api.py:") for f in found), found


def test_the_repository_does_not_refer_to_files_outside_it():
    repo = Path(__file__).resolve().parents[1]
    found = []
    for path in [*repo.glob("fedsweep/**/*.py"), *repo.glob("docs/**/*.md"), *repo.glob("configs/**/*.yaml"),
                 *repo.glob("tests/*.py"), repo / "README.md"]:
        text = path.read_text(errors="replace")
        for needle in ("../" + "shared", "DESIGN" + ".md", "ALGORITHMS" + ".md", "seeds" + "/"):
            if needle in text:
                found.append(f"{path.relative_to(repo)}: {needle}")
    assert not found, found


@pytest.mark.parametrize("name", ["fedadam", "fedreft", "drift"])
def test_bench_aggregation_command_writes_its_json(name, tmp_path, capsys):
    """``fedsweep bench aggregation`` reads each plugin's declared adapters (a LoRA shape, or ReFT for
    fedreft) and writes one timed row per client count under --out."""
    from fedsweep.cli import main

    assert main(["bench", "aggregation", "--algorithm", name, "--clients", "2,3", "--repeats", "1",
                 "--model", "smollm2-135m-instruct", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert result["adapter"] == registry.capabilities(name).adapters[0]
    assert [row["clients"] for row in result["results"]] == [2, 3]
    assert all(row["seconds_median"] > 0 for row in result["results"])


def test_fault_points_live_in_the_probe_and_production_code_asks_it_unconditionally():
    """The recovery tests' faults are a probe (``actors/probe.py``) handed to the fleet and the actors,
    whose default does nothing: only the probe module names a fault point or arms one from the
    environment (``actors/remote.py`` asks it for the probe to hand over), no production code tests
    whether a probe is there, and the server, the client actor and the round checkpoints never say
    "faults"."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    armed = {"FaultProbe", "PROBE_ENV", "FEDSWEEP_FAULT", "FaultPoints", "faults"}
    points = {"train_start", "train_end", "hold_commit", "poison"}
    found, guarded = set(), []
    for path in root.rglob("*.py"):
        rel = str(path.relative_to(root))
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            used = {node.id} if isinstance(node, ast.Name) else {node.attr} if isinstance(node, ast.Attribute) else \
                {a.name for a in node.names} | {node.module or ""} if isinstance(node, ast.ImportFrom) else set()
            said = {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()
            if used & armed or said & (points | {"FEDSWEEP_FAULT"}) or any(u.endswith(".faults") for u in used):
                found.add(rel)
            if isinstance(node, (ast.If, ast.IfExp)) and any(
                    isinstance(n, (ast.Name, ast.Attribute)) and (getattr(n, "id", "") or getattr(n, "attr", "")) == "probe"
                    for n in ast.walk(node.test)):
                guarded.append(f"{rel}:{node.lineno}")
    assert found == {"actors/probe.py"}, found
    assert not guarded, guarded
    for rel in ("actors/server.py", "actors/client.py", "actors/round_checkpoint.py"):
        assert (root / rel).read_text().count("faults") == 0, rel


def test_no_function_over_eighty_lines_and_the_client_actor_stays_small():
    """A function that does not fit a screen is several steps: give each a name. The client actor is
    its Ray-facing part; what it delegates lives in its collaborators (``actors/``, ``federation/``)."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    long = [f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in root.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
    assert len((root / "actors" / "client.py").read_text().splitlines()) <= 300


# ------------------------------------------------------------------ one place for each rule
def _tree(rel: str) -> ast.AST:
    return ast.parse((Path(__file__).resolve().parents[1] / rel).read_text())


def test_the_server_actor_makes_at_most_three_federation_calls():
    """Federation is composed, not threaded through the server by hand: the server opens a round with
    its chain, hands each answer to it and closes the round with it (``federation.chain``)."""
    tree = _tree("fedsweep/actors/server.py")
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("fedsweep.federation") for a in n.names}
    calls = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Call, ast.Attribute)):
            continue
        f = node.func if isinstance(node, ast.Call) else node
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "chain":
            calls.add(f"chain.{f.attr}")
        elif isinstance(node, ast.Call) and isinstance(f, ast.Name) and f.id in imported - {"ServerChain"}:
            calls.add(f.id)
    assert calls == {"chain.open", "chain.receive", "chain.close"}, calls


def test_nothing_is_assigned_onto_a_method_object():
    """A robust rule's mean and the encoder reach a method in its ``AggregationContext``: outside the
    methods' own package no code sets an attribute of a method object (``algo``, ``algorithm``)."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    found = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "algorithms":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                owner = t.value if isinstance(t, ast.Attribute) else None
                name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
                if name in ("algo", "algorithm"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_the_engine_neither_imports_nor_reads_the_run_config():
    """The engine is given its :class:`~fedsweep.engine.settings.EngineSettings`: no module of
    ``engine/`` imports ``fedsweep.config`` or reads a ``cfg``."""
    root = Path(__file__).resolve().parents[1] / "fedsweep" / "engine"
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedsweep.config"):
                found.append(f"{path.name}: imports {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr == "cfg":
                found.append(f"{path.name}:{node.lineno}: .cfg")
            elif isinstance(node, ast.Name) and node.id == "cfg":
                found.append(f"{path.name}:{node.lineno}: cfg")
    assert not found, found


def test_the_batch_plan_has_one_resolver():
    """``plan.batching``'s resolvers are imported by the run's plan alone (``plan/resolve.py``: a run's
    layout, or one actor built in-process); the actors and the server read the resolved plan."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    users = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fedsweep.plan.batching" \
                    and {a.name for a in node.names} & {"resolve", "resolve_for"}:
                users.add(str(path.relative_to(root)))
    assert users == {"plan/resolve.py"}, users


def test_no_module_draws_from_a_seed_it_computes_itself():
    """Every random stream of a run is named in ``salts.py``: a seed given to a generator is a
    variable, a constant, a ``salts`` function, or a list naming a ``salts`` constant, never arithmetic
    or a list of bare values computed on the spot."""
    root = Path(__file__).resolve().parents[1] / "fedsweep"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "salts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("manual_seed", "default_rng", "seed") and node.args):
                continue
            arg = node.args[0]
            names_salt = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "salts"
                             for n in ast.walk(arg))
            if isinstance(arg, ast.BinOp) or (isinstance(arg, (ast.List, ast.Tuple)) and not names_salt):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_a_probe_reaches_into_no_objects_attributes_and_the_fleet_never_calls_the_server():
    """``actors/probe.py`` is given what it acts on: it touches no private attribute and no attribute of an
    actor or its collaborators (``actor.…``, ``.saves``, ``.slots``); the fleet and the round checkpoints
    hold no server and call nothing of it (the server is reached from ``actors/`` only through its Ray
    handle)."""
    tree = _tree("fedsweep/actors/probe.py")
    private = [f"{n.lineno}: .{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "os"))]
    reach = [f"{n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id in ("actor", "client", "server")]
    assert not private and not reach, private + reach
    for rel in ("fedsweep/actors/fleet.py", "fedsweep/actors/round_checkpoint.py"):
        names = {n.id for n in ast.walk(_tree(rel)) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(_tree(rel)) if isinstance(n, ast.Attribute) and n.attr != "server"}  # (cfg.server)
        held = names & {"server", "ServerActor", "bring_back", "_bring_back", "run_round", "flush_checkpoint"}
        assert not held, (rel, held)


def test_the_federation_registries_are_the_schemas_choices():
    """Codec, robust-rule and attack names are written once, in their registries; the config's choices
    are built from them, and a codec's kind is its class (``CODECS['bf16']()`` is bf16)."""
    from typing import get_args

    from fedsweep.config.schema import ByzantineSection, RobustSection, UploadSection
    from fedsweep.federation.attacks import ATTACKS
    from fedsweep.federation.codecs import CODECS
    from fedsweep.federation.robust import RULES

    assert get_args(UploadSection.model_fields["compression"].annotation) == tuple(CODECS)
    assert get_args(RobustSection.model_fields["rule"].annotation) == tuple(RULES)
    assert get_args(ByzantineSection.model_fields["attack"].annotation) == tuple(ATTACKS)
    assert all(CODECS[name]().name == name for name in CODECS)


def test_benchmarks_keep_what_the_pages_cite_and_their_scripts_use_the_public_api():
    """``benchmarks/`` stays small (≤ 150 tracked files, one naming scheme) and its scripts import only
    ``fedsweep.bench.api`` of fedsweep, never a private name: the internals can move under them."""
    import re
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "benchmarks"], cwd=repo, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = listed.stdout.split()
    assert 0 < len(files) <= 150, len(files)
    folders = {f.split("/")[2] for f in files if f.startswith("benchmarks/raw/")}
    assert all(re.fullmatch(RAW_FOLDER, d) for d in folders), sorted(d for d in folders if not re.fullmatch(RAW_FOLDER, d))
    wrong = []
    for f in files:
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((repo / f).read_text())):
            names = [(node.module or "", [a.name for a in node.names])] if isinstance(node, ast.ImportFrom) else \
                [(a.name, []) for a in node.names] if isinstance(node, ast.Import) else []
            for module, imported in names:
                if module.startswith("fedsweep") and module != "fedsweep.bench.api":
                    wrong.append(f"{f}: {module}")
                wrong += [f"{f}: {module}.{n}" for n in imported if n.startswith("_")]
    assert not wrong, wrong


RAW_FOLDER = r"\d{4}-\d\d-\d\d-(cpu|h100|h200|a100)(-[a-z0-9-]+)?"
"""A measurement folder's name under ``benchmarks/raw/``: its date, the machine, what it measured."""


def test_the_evidence_the_docs_cite_reads_back_from_git_and_the_tree_keeps_little_of_it():
    """Every ``benchmarks/raw/…`` path a tracked document or module names is in the tree or in
    ``benchmarks/manifest.json``; every listed file reads back from git at its commit with its SHA-256
    (skipped only where the clone lacks the history); measurement output kept in the tree (everything
    under ``benchmarks/`` and ``reproductions/`` but scripts, a card's reports, CSVs and figures, the
    pages and the manifest) is at most 1 MB."""
    from fedsweep.bench import evidence

    repo = Path(__file__).resolve().parents[1]
    if not evidence.tracked(repo, ("benchmarks",)):
        pytest.skip("not a git checkout")
    assert evidence.uncited(repo) == []
    assert evidence.measurement_bytes(repo) <= 1_000_000, evidence.measurement_bytes(repo)
    files = evidence.load(repo)["files"]
    assert files and all(set(f) >= {"path", "commit", "sha256"} for f in files)
    if not evidence.has_history(repo, {f["commit"] for f in files}):
        pytest.skip("a clone without the history the manifest points into")
    assert evidence.verify(repo) == []


def test_archiving_a_folder_lists_it_and_a_changed_or_missing_file_is_caught(tmp_path):
    """``fedsweep bench archive``'s work on a scratch repository: the folder's files listed with the commit
    that holds them, removed from the tree, read back from git; a digest that does not match, or a
    commit the clone lacks, is named by ``verify``; a citation of a folder nobody kept is named."""
    import hashlib
    import json
    import subprocess

    from fedsweep.bench import evidence

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    raw = tmp_path / "benchmarks" / "raw" / "2026-12-07-cpu-probe"
    raw.mkdir(parents=True)
    (raw / "results.json").write_text('{"commit": "x", "seconds": 1.5}\n')
    (raw / "measure.sh").write_text("echo hi\n")
    (tmp_path / "README.md").write_text("see benchmarks/raw/2026-12-07-cpu-probe/ and benchmarks/raw/2026-12-07-cpu-gone/\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("# benchmarks/raw/2026-12-07-cpu-made-up/\n")  # tests name made-up ones
    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=t", "add", "-A")
    git("-c", "user.email=a@b", "-c", "user.name=t", "commit", "-q", "-m", "m")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert evidence.uncited(tmp_path) == ["README.md: benchmarks/raw/2026-12-07-cpu-gone"]
    added = evidence.archive(tmp_path, ["benchmarks/raw/2026-12-07-cpu-probe/"])
    assert {a["path"] for a in added} == {"benchmarks/raw/2026-12-07-cpu-probe/results.json",
                                          "benchmarks/raw/2026-12-07-cpu-probe/measure.sh"}
    assert all(a["commit"] == head for a in added)
    expected = hashlib.sha256(b'{"commit": "x", "seconds": 1.5}\n').hexdigest()
    assert next(a for a in added if a["path"].endswith(".json"))["sha256"] == expected
    assert not raw.exists() and evidence.verify(tmp_path) == []
    manifest = json.loads((tmp_path / evidence.MANIFEST).read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    manifest["files"][1]["commit"] = "f" * 40
    (tmp_path / evidence.MANIFEST).write_text(json.dumps(manifest))
    wrong = evidence.verify(tmp_path)
    assert len(wrong) == 2 and "SHA-256 differs" in wrong[0] and "not at" in wrong[1]
    assert not evidence.has_history(tmp_path, {"f" * 40})


def test_the_architecture_page_names_every_package_and_every_large_module():
    """``docs/architecture.md`` matches the tree: every package of ``fedsweep/`` (``fedsweep/<path>/``) and
    every module over 100 lines (its path under ``fedsweep/``) is named there."""
    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "architecture.md").read_text()
    root = repo / "fedsweep"
    missing = []
    for folder in sorted({p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts} - {root}):
        rel = folder.relative_to(root).as_posix()
        if f"fedsweep/{rel}/" not in doc and f"`{rel}/`" not in doc:
            missing.append(f"package {rel}/")
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts):
        if len(path.read_text().splitlines()) > 100 and path.relative_to(root).as_posix() not in doc:
            missing.append(path.relative_to(root).as_posix())
    assert not missing, missing


def test_every_bench_json_records_the_commit_it_measured():
    """Every JSON under benchmarks/raw/ names its commit (at its top or in its provenance), so a figure is
    read beside the code that made it; the ones measured before results carried it say how it was
    recorded afterwards."""
    import json

    root = Path(__file__).resolve().parents[1]
    missing = []
    for path in sorted((root / "benchmarks" / "raw").rglob("*.json")):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and (data.get("commit") or (data.get("provenance") or {}).get("commit"))):
            missing.append(str(path.relative_to(root)))
    assert not missing, missing
