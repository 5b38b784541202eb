"""Fixtures shared by test files (helpers that are not fixtures live in their own modules), and
the order of the files for `make test`.

Order: `make test` runs both tiers in one pytest-xdist session, whole files per worker
(`--dist loadfile`) in collection order (`--no-loadscope-reorder`: xdist's default would reorder
files by their number of tests). The longest end-to-end files go first, so that none is taken
last and runs alone while the other workers idle; the unit files, many and short, in-process
CPU work, go last and fill the workers that the end-to-end files leave waiting on servers and
timeouts, and the end of the run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import zmq

# pytest rewrites the asserts of every test module it imports (~6 s of CPU for the whole suite,
# in each xdist worker) and caches the result beside the module's bytecode, unless bytecode is
# not to be written: where PYTHONDONTWRITEBYTECODE is set (this machine and CI), every run of
# every worker rewrote them again. `make test` compiles our packages and the tests with
# compileall for the same reason; the rewritten modules are cached likewise (tests/**/__pycache__,
# ignored by git).
sys.dont_write_bytecode = False

# Seconds of each file's tests, from a fresh clone's `make test` on the 2-core host with 4
# workers (2026-11-27); e2e files not listed keep their order after these.
LONGEST_FIRST = (
    "test_packaging.py",  # 60 s: a wheel into a fresh venv, and its native build
    "test_object_store.py",  # 49 s (+ a SeaweedFS start)
    "test_train_preemption.py",  # 41 s: SIGUSR1 checkpoints, 1 and 2 ranks
    "test_discovery.py",  # 35 s, mostly waiting on DNS re-resolves and servers
    "test_demo.py",  # 34 s
    "test_sharing.py",  # 34 s
    "test_train.py",  # 32 s
    "test_frameworks.py",  # 23 s alone (35 s before its Lightning ranks forked with it imported)
    "test_server_limits.py",  # 21 s
    "test_bad_input_sources.py",  # 21 s
    "test_remote_loader.py",  # 21 s
    "test_forkserver.py",  # 18 s
    "test_native_build.py",  # 17 s
    "test_progressive_resize.py",  # 17 s
    "test_object_store_cache.py",  # 17 s
    "test_fleet.py",  # 16 s
    "test_pipeline_store.py",  # 16 s
    "test_sources_identity.py",  # 16 s
    "test_object_store_readahead.py",  # 15 s
    "test_multilabel_server.py",  # 15 s
    "test_native_lock.py",  # 15 s: a real build
    "test_train_elastic_audit.py",  # 11 s (2026-11-28): one history of gloo ranks, 4 runs
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        if item.path.parent.name == "unit":
            return len(rank) + 1
        return rank.get(item.path.name, len(rank))

    items.sort(key=key)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A private zmq context, destroyed with linger 0 so a stuck socket cannot hang the test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
