# batchwire: `make demo` and `make test` set everything up in .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup native demo test test-cuda-build lint bench clean

setup:
	@scripts/setup.sh

native: setup
	@$(PY) -m batchwire.native build

demo: native
	@$(PY) -m batchwire.train.demo

test: native
	@$(PY) -m ruff check .
	@$(PY) -m pytest -q

# The CUDA build of the native op in .venv-cuda (CUDA torch, nvcc), no GPU needed: compiles,
# links and loads it and runs the native CPU tests through it. Not part of `make test`.
test-cuda-build:
	@scripts/test_cuda_build.sh

lint: setup
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .

bench: native
	@$(VENV)/bin/pipeline-bench --data ../shared/imagenet-sample

clean:
	rm -rf $(VENV) .cache
