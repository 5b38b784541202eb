# batchwire: `make demo` and `make test` set everything up in .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-runtime native demo test test-fast test-cuda-build lint docs bench clean

# The developer's venv: batchwire with the test tools, DALI (its CPU tests) and the chart.
setup:
	@BATCHWIRE_EXTRAS=dev,dali,bench scripts/setup.sh

# What a user of the demo needs: batchwire's runtime dependencies only (no test tools, no DALI).
setup-runtime:
	@BATCHWIRE_EXTRAS= scripts/setup.sh

native: setup
	@$(PY) -m batchwire.native build

demo: setup-runtime
	@$(PY) -m batchwire.native build
	@$(PY) -m batchwire.train.demo

# The whole suite: tests/e2e (real server processes, sockets, DDP ranks) and tests/unit
# (in-process, seconds) in one session of TEST_WORKERS processes: most of an end-to-end test's
# time is spent waiting on servers and timeouts, so more workers than cores pay, and the unit
# files fill that time (tests/conftest.py: the longest files first, the unit files last; a
# unit tier run on its own after the e2e one cost 30-50 s more here). One file per worker
# (--dist loadfile) keeps each file's module-scoped servers started once.
TEST_WORKERS ?= 4
# Bytecode for our packages first: this environment sets PYTHONDONTWRITEBYTECODE, so each of the
# suite's ~400 server and CLI processes would otherwise compile batchwire from source (~70 ms each).
# (They fork from one process per worker that imported torch: tests/forkserver.py.)
PACKAGES := src bench client common monitor native pipeline prepare server train wire
test: native
	@$(PY) -m compileall -q $(PACKAGES) tests > /dev/null
	@$(PY) -m ruff check .
	@$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder tests/e2e tests/unit

# The unit tier and lint only: under a minute, for every edit.
test-fast: native
	@$(PY) -m compileall -q $(PACKAGES) tests > /dev/null
	@$(PY) -m ruff check .
	@$(PY) -m pytest -q -p no:cacheprovider -n 2 tests/unit

# The CUDA build of the native op in .venv-cuda (CUDA torch, nvcc), no GPU needed: compiles,
# links and loads it and runs the native CPU tests through it. Not part of `make test`.
test-cuda-build:
	@scripts/test_cuda_build.sh

# The documentation site into .cache/site (strict: a broken link or docstring fails); `mkdocs serve`
# shows it live. make test builds it too (tests/unit/test_docs.py).
docs: setup
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

lint: setup
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .

# The sample as it is and as pipeline-prepare rewrites it, side by side in one run. The copy is
# kept in .cache (a rerun only checks it); pipeline-prepare's exit 1 (corrupt JPEGs found and
# copied as they were) still leaves a complete copy to measure. The chart needs the bench extra.
BENCH_DATA := ../shared/imagenet-sample
BENCH_PREPARED := .cache/prepared/imagenet-sample
bench: native
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	@$(VENV)/bin/pipeline-prepare $(BENCH_DATA) $(BENCH_PREPARED) || [ $$? -eq 1 ]
	@$(VENV)/bin/pipeline-bench --data $(BENCH_DATA) --prepared $(BENCH_PREPARED) \
		--json bench/pipeline-bench.json --plot bench/pipeline-bench.png

clean:
	rm -rf $(VENV) .cache
