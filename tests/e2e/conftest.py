"""Order of the end-to-end tier: the longest files first.

`make test` spreads whole files over xdist workers in collection order (`--dist loadfile`); a long
file taken last would run alone at the end while the other workers idle. Measured per file on
2 cores (CPU seconds, children included; 2026-11-25); files not listed keep their order after
these.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "test_frameworks.py",  # 72 s: Lightning, Accelerate and torchrun, 2 ranks each
    "test_discovery.py",  # 49 s, mostly waiting on DNS re-resolves and servers
    "test_prepared_identity.py",  # 33 s
    "test_demo.py",  # 29 s
    "test_train.py",  # 25 s
    "test_object_store.py",  # 25 s (+ a SeaweedFS start)
    "test_fleet.py",  # 24 s
    "test_sources_identity.py",  # 20 s
    "test_train_preemption.py",  # 20 s: SIGUSR1 checkpoints, 1 and 2 ranks
    "test_train_data.py",  # 36 s under load: multi-label, mixing, resize, resumes
    "test_sources_gcs_azure.py",  # 13 s (+ fake-gcs-server and Azurite starts)
    "test_remote_loader_epochs.py",  # 18 s
    "test_native_lock.py",  # 17 s: a real build
    "test_server.py",  # 17 s
    "test_server_limits.py",  # 15 s
    "test_shards_prepare.py",  # 14 s
    "test_native_build.py",  # 13 s: nvcc
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
