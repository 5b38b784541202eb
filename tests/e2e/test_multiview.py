"""Multi-view crops (issue 22) through real pipeline-server processes and RemoteLoader.

DINO-style views, small: ``2x32:0.4-1.0,3x16:0.05-0.4`` (2 global 32 px views, 3 local 16 px
ones) over the embedded val folder (400 real JPEGs). The oracle is `LocalLoader` with the same
views (the same `BatchProducer`, in-process); tests/unit/test_multiview.py checks that one
against the fused op called by hand on each view's planned crop.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.synthetic import default_dataset
from serverproc import free_tcp_endpoint, running_server, running_servers, small_server_args

VIEWS = "2x32:0.4-1.0,3x16:0.05-0.4"
SIZES = [32, 32, 16, 16, 16]
B = 16  # small_server_args' batch size
SEED = 11
BIN = Path(sys.executable).parent


def server_args(*extra: str) -> tuple[str, ...]:
    return (*small_server_args(seed=SEED), "--views", VIEWS, *extra)


@pytest.fixture(scope="module")
def servers():
    with running_servers(2, *server_args()) as both:
        yield both


def loader_for(endpoint: str, **kw) -> RemoteLoader:
    kw.setdefault("timeout", 60.0)
    kw.setdefault("normalize_on_device", False)  # the wire's uint8, as LocalLoader makes it
    return RemoteLoader(
        endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, **kw
    )


def batches(loader, n: int | None = None) -> list[tuple]:
    out = []
    for views, labels, indices in loader:
        out.append(([v.clone() for v in views], labels.clone(), indices.clone()))
        if n is not None and len(out) == n:
            break
    return out


def assert_same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for k, ((va, la, ia), (vb, lb, ib)) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(ia, ib) and torch.equal(la, lb), f"batch {k}: other samples"
        for j, (x, y) in enumerate(zip(va, vb, strict=True)):
            assert torch.equal(x, y), f"batch {k} view {j} differs"


@pytest.fixture(scope="module")
def local_epoch():
    """Epoch 1 from LocalLoader with the server's settings (the oracle)."""
    with LocalLoader(
        str(default_dataset().val_root),
        batch_size=B,
        image_size=32,
        seed=SEED,
        views=VIEWS,
        output_dtype="uint8",
        with_indices=True,
    ) as local:
        local.set_epoch(1)
        return batches(local)


@pytest.mark.timeout(120)
def test_views_arrive_as_a_list_per_step_equal_to_the_local_oracle(servers, local_epoch):
    with loader_for(servers[0].endpoint) as loader:
        welcome = loader.server_info()
        assert welcome.views == [[s, s] for s in SIZES] and welcome.shape == [B, 3, 32, 32]
        loader.set_epoch(1)
        got = batches(loader)
    first_views = got[0][0]
    assert [list(v.shape) for v in first_views] == [[B, 3, s, s] for s in SIZES]
    assert all(v.dtype == torch.uint8 for v in first_views)
    assert_same(got, local_epoch)
    # Every view of a sample differs from every other (its own crop, flip and jitter draws).
    for views, _, _ in got[:3]:
        for i in range(len(views)):
            for j in range(i + 1, len(views)):
                if views[i].shape == views[j].shape:
                    for s in range(B):
                        assert not torch.equal(views[i][s], views[j][s]), (i, j, s)


@pytest.mark.timeout(120)
def test_two_servers_agree_and_a_mid_epoch_resume_is_exact(servers, local_epoch):
    with loader_for([s.endpoint for s in servers]) as both:  # batches from either server
        both.set_epoch(1)
        assert_same(batches(both), local_epoch)
    with loader_for(servers[1].endpoint) as first:
        first.set_epoch(1)
        head = batches(first, 3)
        state = first.state_dict()
    with loader_for(servers[0].endpoint) as second:
        second.load_state_dict(state)
        tail = batches(second)
    assert_same(head + tail, local_epoch)


@pytest.mark.timeout(120)
def test_two_jobs_share_the_multi_view_batches_of_one_server(servers, local_epoch):
    srv = servers[1]
    before = srv.stats()["counters"]["batches_shared_total"]
    with loader_for(srv.endpoint, job="a") as a, loader_for(srv.endpoint, job="b") as b:
        a.set_epoch(1)
        b.set_epoch(1)
        pairs = [
            (([v.clone() for v in x[0]], x[1].clone(), x[2].clone()), y)
            for x, y in zip(a, b, strict=True)
        ]
    assert_same([p[0] for p in pairs], local_epoch)
    assert_same([p[1] for p in pairs], local_epoch)
    assert srv.stats()["counters"]["batches_shared_total"] > before


@pytest.mark.timeout(120)
def test_normalize_on_device_applies_per_view(servers, local_epoch):
    with loader_for(servers[0].endpoint, normalize_on_device=True) as loader:
        loader.set_epoch(1)
        views, labels, _ = next(iter(loader))
        mean = torch.tensor(loader.server_info().mean).view(1, 3, 1, 1)
        std = torch.tensor(loader.server_info().std).view(1, 3, 1, 1)
        assert len(views) == len(SIZES)
        for view, raw in zip(views, local_epoch[0][0], strict=True):
            assert view.dtype == torch.float32 and view.shape == raw.shape
            want = (raw.float() / 255.0 - mean) / std
            torch.testing.assert_close(view, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(labels, local_epoch[0][1])


@pytest.mark.timeout(120)
def test_the_memory_statement_counts_every_view():
    per_batch = B * 3 * sum(s * s for s in SIZES) + 8 * B
    with running_server(
        *server_args("--max-buffers", "8", "--val", str(default_dataset().val_root))
    ) as srv:
        stats = srv.stats()
        log = srv.log()
    assert "views 32x32+32x32+16x16+16x16+16x16 px" in log, log
    assert stats["buffers"]["batch_bytes"] == per_batch, stats["buffers"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("views", "says"),
    [
        ("2x224", "cannot read '2x224'"),
        ("2x224:0.4-1.0,x96:0.05-0.4", "cannot read 'x96:0.05-0.4'"),
        ("2x224:0.6-0.4", "0 < LO <= HI <= 1"),
        ("0x224:0.4-1.0", "count and size must be >= 1"),
    ],
)
def test_a_bad_views_spelling_exits_2_saying_why(views: str, says: str):
    root = str(default_dataset().val_root)
    done = subprocess.run(
        [str(BIN / "pipeline-server"), "--train", root, "--bind", free_tcp_endpoint(),
         "--views", views],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--views" in done.stderr and says in done.stderr, done.stderr
    assert "COUNTxSIZE:LO-HI" in done.stderr, done.stderr
