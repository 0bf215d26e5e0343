# pdspec developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch; on a CUDA machine use e.g. `make TORCH_SPEC=torch test-gpu`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: install proto run test test-gpu sanitize-gpu bench bench-gpu lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

# Regenerate the committed protobuf/gRPC code (grpcio-tools pinned in pyproject's dev extra).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pdspec.proto

run: $(STAMP)
	$(PY) -m pdspec.local

# Two workers: the statistical end-to-end tests dominate and parallelise across cores.
test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

sanitize-gpu: $(STAMP)
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) tests/sampling/sanitize_kernel.py

bench: $(STAMP)
	$(PY) bench/sampling_cpu.py

bench-gpu: $(STAMP)
	$(PY) bench/kernel.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
