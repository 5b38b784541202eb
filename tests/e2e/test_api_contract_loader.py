"""RemoteLoader's lifecycle as a user's own code meets it, against one real pipeline-server:
close twice, iterate after close, the ``with`` block, two loaders in one process, a loader
iterated from another thread, a pickled (used) loader, ``DataLoader(loader, batch_size=None)``,
a mid-epoch state through ``torch.save``/``torch.load(weights_only=True)``, no thread left
behind, no hang at interpreter exit without `close`, and Ctrl-C while it waits for a server.
"""

from __future__ import annotations

import _thread
import gc
import io
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader, ServerUnavailable
from serverproc import free_tcp_endpoint, running_server, small_server_args
from torch.utils.data import DataLoader

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=5)) as srv:
        yield srv


def make(endpoint: str, **kwargs) -> RemoteLoader:
    return RemoteLoader(endpoint, device="cpu", timeout=20, with_indices=True, **kwargs)


def epoch_of(loader) -> list[list[int]]:
    """The indices of every batch of one pass."""
    return [batch[2].tolist() for batch in loader]


@pytest.fixture(scope="module")
def reference(server) -> list[list[int]]:
    loader = make(server.endpoint)
    try:
        return epoch_of(loader)
    finally:
        loader.close()


def test_close_twice_iterate_after_close_and_the_with_block(server, reference):
    loader = make(server.endpoint)
    assert epoch_of(loader) == reference
    loader.close()
    loader.close()
    loader.set_epoch(0)  # the same epoch again, after close: it reconnects
    assert epoch_of(loader) == reference
    loader.close()
    with make(server.endpoint) as again:
        assert len(again) == len(reference)
        assert epoch_of(again) == reference


def test_two_loaders_in_one_process_and_a_loader_iterated_from_another_thread(server, reference):
    first, second = make(server.endpoint), make(server.endpoint)
    try:
        pairs = list(zip(epoch_of(first), epoch_of(second), strict=True))
        assert [a for a, _ in pairs] == [b for _, b in pairs] == reference
    finally:
        first.close()
        second.close()
    built_here = make(server.endpoint)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(epoch_of(built_here)))
    worker.start()
    worker.join(30)
    built_here.close()
    assert not worker.is_alive() and got == [reference]


def test_pickled_used_loader_and_dataloader_without_workers(server, reference):
    loader = make(server.endpoint)
    next(iter(loader))
    copy = pickle.loads(pickle.dumps(loader))
    loader.close()
    copy.set_epoch(0)
    assert epoch_of(copy) == reference
    copy.close()
    wrapped = make(server.endpoint)
    assert epoch_of(DataLoader(wrapped, batch_size=None, num_workers=0)) == reference
    wrapped.close()


def test_mid_epoch_state_through_torch_load_weights_only_resumes_exactly(server, reference):
    loader = make(server.endpoint)
    it = iter(loader)
    for _ in range(3):
        next(it)
    buf = io.BytesIO()
    torch.save({"data": loader.state_dict()}, buf)
    loader.close()
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["data"]
    resumed = make(server.endpoint)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop's call keeps the restored position
    assert epoch_of(resumed) == reference[3:]
    resumed.close()


def test_no_thread_is_left_behind_by_close_or_by_a_dropped_loader(server):
    before = {t.ident for t in threading.enumerate()}
    closed = make(server.endpoint)
    next(iter(closed))
    closed.close()
    dropped = make(server.endpoint)
    it = iter(dropped)
    next(it)
    del it, dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {t.name for t in threading.enumerate() if t.ident not in before}


SCRIPT = """
import sys
from batchwire.client import RemoteLoader
loader = RemoteLoader(sys.argv[1], device="cpu", timeout=20)
it = iter(loader)
next(it)
next(it)
print("leaving without close", flush=True)
"""


@pytest.mark.timeout(60)
def test_interpreter_exit_without_close_does_not_hang(server):
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.endpoint], capture_output=True, text=True, timeout=40
    )
    assert done.returncode == 0, done.stderr
    assert "leaving without close" in done.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(30)
def test_server_info_without_a_server_times_out_and_ctrl_c_interrupts_the_wait():
    endpoint = free_tcp_endpoint()
    loader = RemoteLoader(endpoint, device="cpu", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=endpoint):
        loader.server_info()
    assert time.monotonic() - t0 < 3.0
    loader.close()
    waiting = RemoteLoader(endpoint, device="cpu", timeout=20.0)
    ctrl_c = threading.Timer(0.5, _thread.interrupt_main)
    t0 = time.monotonic()
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            len(waiting)
    finally:
        ctrl_c.cancel()
    assert time.monotonic() - t0 < 5.0
    waiting.close()
