# Tangram: what a newcomer runs. CI runs `make test` (see .ci/run).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo up sandbox-image test test-fast lint typecheck bench bench-throughput bench-scheduler bench-docker bench-gpu bench-quota docker-engine chromium clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: 2.13.0 is the CPU wheel on these machines (any other version pulls CUDA)
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/pip install -q -e '.[ray]' && $(BIN)/pip install -q --no-deps -r tests/integrations/frameworks.txt  # adapters' base classes
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install tangram with its dev tools

demo: setup  ## an embedded mesh running a small AI-coding rollout
	$(BIN)/tangram demo

up: setup  ## the whole mesh on this machine; Ctrl-C stops it
	$(BIN)/tangram up

sandbox-image: setup  ## build tangram-sandbox:latest offline (`tangram up` also builds it when absent)
	$(BIN)/tangram sandbox-image

docker-engine:  ## install a Docker engine and a compose tool if absent (tests start their own dockerd)
	bash scripts/docker-engine.sh
	bash scripts/compose-tool.sh

chromium:  ## install Debian's chromium if absent (the browser tests drive it headless)
	bash scripts/chromium.sh

test: setup docker-engine chromium  ## lint, format, types, then the whole suite against real NATS, Postgres, Docker
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: setup  ## unit tests only
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

bench: bench-throughput bench-scheduler bench-docker bench-gpu bench-quota  ## every benchmark; JSON in bench/results

$(VENV)/.ray-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[ray]'
	touch $@

bench-throughput: setup $(VENV)/.ray-installed  ## no-op actions through the mesh, CPU per action per process, a local Ray side by side
	$(BIN)/python -m bench.throughput

bench-scheduler: setup
	$(BIN)/python -m bench.decision_latency
	$(BIN)/python -m bench.figures

bench-gpu: setup  ## restore bandwidth, per-call overhead, batching; Figure 8(b) (simulated)
	$(BIN)/python -m bench.gpu
	$(BIN)/python -m bench.fig8b

bench-quota: setup  ## quotas against a real rate-limited server; DeepSearch (simulated)
	$(BIN)/python -m bench.quota
	$(BIN)/python -m bench.deepsearch

bench-docker: setup docker-engine
	$(BIN)/python -m bench.docker_exec

clean:
	rm -rf $(VENV) .state .pytest_cache .ruff_cache .mypy_cache
