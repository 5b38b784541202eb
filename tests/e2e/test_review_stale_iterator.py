"""A superseded iterator's first next() must not take over the live pass's bookkeeping: a
set_epoch during the live pass still ends it with the LoaderError naming the call."""

from __future__ import annotations

import pytest
from batchwire.client import LoaderError, RemoteLoader
from serverproc import running_server, small_server_args


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=11)) as srv:
        yield srv


def test_a_stale_iterator_begun_late_leaves_the_live_pass_endable(server) -> None:
    loader = RemoteLoader(server.endpoint, "train", device="cpu")
    try:
        stale = iter(loader)
        live = iter(loader)
        next(live)
        with pytest.raises(LoaderError, match="superseded"):
            next(stale)
        loader.set_epoch(3)  # meant for after the loop
        with pytest.raises(LoaderError, match=r"set_epoch\(\) during a pass ended it"):
            next(live)
    finally:
        loader.close()
