"""A loader handed to another process (pickled: torch.multiprocessing.spawn, a launcher) counts
and reports its batches as the original would."""

from __future__ import annotations

import pickle

import pytest
from batchwire.client import RemoteLoader
from serverproc import running_server, small_server_args


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=5)) as srv:
        yield srv


def test_an_unpickled_loader_counts_its_batches_and_reports_its_waits(server):
    loader = RemoteLoader(server.endpoint, device="cpu", timeout=20)
    copy = pickle.loads(pickle.dumps(loader))  # what spawn does with a loader argument
    loader.close()
    batches = sum(1 for _ in copy)
    # Before: stats() is None and batch_totals() is (0, 0) after 25 batches, and the copy sends
    # the server no loader report (RemoteLoader.__getstate__ sets _stats=None).
    assert copy.batch_totals() == (batches, 0)
    figures = copy.stats()
    assert figures is not None and figures["images_per_s"] > 0
    copy.close()
