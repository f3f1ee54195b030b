# batch_assets: `make demo`, `make test`, `make ui`. Each sets up .venv first when needed.
VENV      := .venv
STAMP     := $(VENV)/.batch_assets_installed
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
# Python's compiled bytecode in one folder inside .venv (none next to the sources), written by the first
# process that imports a module and read by every later one. An engine start is three interpreters
# importing torch and vLLM; where PYTHONDONTWRITEBYTECODE is set (CI's machines set it) each of them
# compiled those from source again: the tiny model's engine start took twice as long (BENCHMARKS.md).
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/$(VENV)/pycache
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup demo test test-fast lint golden ui image image-check deploy-check ray-up ray-down ray-check clean

$(STAMP): pyproject.toml scripts/setup.sh scripts/uv_sources.sh requirements/cpu.txt requirements/gpu.txt requirements/extra.txt
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

# batch-assets creates $(DAGSTER_HOME) (dagster.yaml, storages) itself, under a lock, so that
# commands started at once on a new home leave one usable instance.
demo: setup
	$(VENV)/bin/batch-assets demo

# Two pytest-xdist workers: one test keeps about one core busy (engine start-ups, subprocesses and
# waits leave the rest idle), so two workers fill CI's two cores. `--dist loadgroup` with the groups
# conftest.py gives runs each test file on one worker, so a file's module and session fixtures
# (engines, servers) are built once; `--no-loadscope-reorder` hands the groups out in the order
# conftest.py gives (longest first, so both workers end together), not by number of tests.
# A crashed worker ends the run (`--max-worker-restart=0`): xdist's loadscope scheduler hands the
# crashed file's remaining tests to a replacement worker and then waited forever (CI, 2026-11-28).
# `PYTEST_WORKERS=0` runs in one process; `--durations` lists the slowest tests in the log.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --max-worker-restart=0

test: setup lint
	bash scripts/install_system_deps.sh
	$(VENV)/bin/python -m pytest -m "not image" $(XDIST) --durations=40 $(PYTEST_ARGS)

# Pure functions and the definitions snapshot: no engine, daemon, browser or server (about a minute).
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# vLLM's own answers that tests compare with (batch_assets_tests/golden/), made anew: after a change of
# vLLM, torch, a model or the requests (a stale file makes its test run vLLM and warn).
golden: setup
	BATCH_ASSETS_WRITE_GOLDEN=1 $(VENV)/bin/python -m pytest -p no:xdist -k "matches_vllm_run_batch or match_plain_vllm" \
		batch_assets_tests/test_openai_batch_pipeline.py batch_assets_tests/test_openai_batch_embeddings.py \
		batch_assets_tests/test_lora.py
	BATCH_ASSETS_WRITE_GOLDEN=1 $(VENV)/bin/python -m pytest -p no:xdist -k labels_equal_plain_vllm \
		batch_assets_tests/test_image_tasks.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# `dg dev` (webserver + daemon); a second `make ui` on the same home is refused with a message.
ui: setup
	$(VENV)/bin/batch-assets ui --host 127.0.0.1 --port 3000

# The CPU image (ENGINE=gpu for the GPU one) built on this machine: dockerd started when none runs, a
# Debian base made with debootstrap once (deploy/README.md, "The image").
image:
	bash deploy/build_image.sh

# The demo in that image as a platform engineer runs it: another UID, a read-only root, volumes.
image-check: setup
	$(VENV)/bin/python -m pytest -p no:xdist -m image batch_assets_tests/test_image_run.py $(PYTEST_ARGS)

# The deployment as containers (deploy/docker/topology.py: Postgres, S3, code server, daemon, webserver,
# a container per run) driven for real: `make image` first.
deploy-check: setup
	$(VENV)/bin/python -m pytest -p no:xdist -m image batch_assets_tests/test_deploy_docker.py $(PYTEST_ARGS)

# Runs on a multi-node Ray cluster of containers (deploy/ray/ray_topology.py: a Ray head, two workers with an
# engine slot each, Postgres, S3 and the Dagster services; docs/ray.md): `make image` first. `ray-up`
# prints S3_ENDPOINT=, DATA= and WEBSERVER= lines; `ray-check` starts its own and removes it.
ray-up: setup
	$(VENV)/bin/python deploy/ray/ray_topology.py up

ray-down: setup
	$(VENV)/bin/python deploy/ray/ray_topology.py down

ray-check: setup
	$(VENV)/bin/python -m pytest -p no:xdist -m image batch_assets_tests/test_ray_docker.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .dagster_home data
