# Every target does its own set-up: a fresh machine needs nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast lint demo proto proto-check bench bench-quick clean

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
