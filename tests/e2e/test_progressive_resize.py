"""Progressive resizing (issue 22): a loader changes its output size between epochs, one server.

Server "small" starts at 32 px with ``--max-image-size 48``; server "big" starts at 48 px. A
loader on "small" that asks for 48 px gets exactly what "big" sends by default (train crops do
not depend on the output size; val centre crops are planned at the size asked), its welcome and
batches have the new shape, a mid-epoch state resumes exactly at that size, the share window
never hands a 32 px batch to a 48 px session, and a size beyond --max-image-size is refused.
Real servers over the embedded val folder (400 JPEGs) served as both splits.
"""

from __future__ import annotations

import pytest
import torch
from batchwire.client import RemoteLoader, ServerError
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.synthetic import default_dataset
from serverproc import running_server, small_server_args

SEED = 7
B = 16


@pytest.fixture(scope="module")
def small():
    with running_server(*small_server_args(seed=SEED, val=True), "--max-image-size", "48") as s:
        yield s


@pytest.fixture(scope="module")
def big():
    with running_server(*small_server_args(seed=SEED, val=True), "--image-size", "48") as s:
        yield s


def loader_for(endpoint: str, split: str = "train", **kw) -> RemoteLoader:
    kw.setdefault("timeout", 60.0)
    kw.setdefault("normalize_on_device", False)  # the wire's uint8, as LocalLoader makes it
    return RemoteLoader(
        endpoint, split, rank=0, world_size=1, device="cpu", with_indices=True, **kw
    )


def take(loader, n: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for batch in loader:
        out.append(tuple(t.clone() for t in batch))
        if n is not None and len(out) == n:
            break
    return out


def epoch_of(loader, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    loader.set_epoch(epoch)
    return take(loader)


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert torch.equal(tx, ty), f"batch {k} differs"


@pytest.fixture(scope="module")
def reference(small, big):
    """Epochs 0 (32 px, "small") and 1 (48 px, "big"), fresh loaders, no size asked."""
    with loader_for(small.endpoint, prefetch_next_epoch=False) as at32:
        e0 = epoch_of(at32, 0)
    with loader_for(big.endpoint, prefetch_next_epoch=False) as at48:
        e1 = epoch_of(at48, 1)
    # "small"'s buffers are flat (sized for 48 px): its own size's batches are still those
    # of the pipeline itself (LocalLoader: shaped buffers, no server).
    root = str(default_dataset().val_root)
    with LocalLoader(
        root, batch_size=B, image_size=32, seed=SEED, output_dtype="uint8", with_indices=True
    ) as local:
        assert_same(take(local), e0)
    return e0, e1


@pytest.mark.timeout(120)
def test_one_loader_trains_at_32_then_48_against_one_server(small, reference):
    e0, e1 = reference
    with loader_for(small.endpoint) as loader:
        got0 = epoch_of(loader, 0)
        assert loader.server_info().shape == [B, 3, 32, 32]
        loader.set_image_size(48)
        got1 = epoch_of(loader, 1)
        assert loader.server_info().shape == [B, 3, 48, 48]
        assert loader.image_size == (48, 48)
    assert got0[0][0].shape == (B, 3, 32, 32) and got1[0][0].shape == (B, 3, 48, 48)
    assert_same(got0, e0)
    assert_same(got1, e1)
    log = small.log()
    assert "train epoch 1 rank 0/1 at 48x48, asks for" in log, log
    assert "32x32 (clients may ask up to 48x48) px" in log, log


@pytest.mark.timeout(120)
def test_a_mid_epoch_resume_at_the_new_size_is_exact(small, reference):
    _, e1 = reference
    with loader_for(small.endpoint, image_size=48) as first:
        first.set_epoch(1)
        head = take(first, 5)
        state = first.state_dict()
    assert state["image_size"] == [48, 48]
    with loader_for(small.endpoint) as second:  # the state says the size
        second.load_state_dict(state)
        tail = take(second)
    assert_same(head + tail, e1)


@pytest.mark.timeout(120)
def test_sessions_at_two_sizes_never_share_a_batch(small, reference):
    e0, _ = reference
    with (
        loader_for(small.endpoint, image_size=(48, 48)) as at48,
        loader_for(small.endpoint) as at32,
    ):
        at48.set_epoch(0)
        at32.set_epoch(0)
        pairs = [
            (tuple(t.clone() for t in x), tuple(t.clone() for t in y))
            for x, y in zip(at32, at48, strict=True)
        ]
    assert_same([p[0] for p in pairs], e0)
    assert all(p[1][0].shape == (B, 3, 48, 48) for p in pairs)
    for (_, _, ix), (_, _, iy) in pairs:
        assert torch.equal(ix, iy)  # the same samples, at two sizes


@pytest.mark.timeout(120)
def test_val_is_planned_at_the_size_asked(small, big):
    with loader_for(big.endpoint, "val") as ref:
        want = take(ref)
    with loader_for(small.endpoint, "val", image_size=48, normalize_on_device=True) as loader:
        got = take(loader)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    for (gx, gl, gi), (wx, wl, wi) in zip(got, want, strict=True):
        assert torch.equal(gi, wi) and torch.equal(gl, wl)
        torch.testing.assert_close(gx, (wx.float() / 255 - mean) / std, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_a_size_beyond_max_image_size_is_refused_clearly(small, big):
    too_big = "larger than this server's --max-image-size 48x48"
    for endpoint, size in ((small.endpoint, 64), (big.endpoint, (48, 64))):
        loader = loader_for(endpoint, image_size=size, timeout=10.0)
        try:
            with pytest.raises(ServerError, match=too_big):
                next(iter(loader))
        finally:
            loader.close()
    with pytest.raises(ValueError, match="image_size"):
        loader_for(small.endpoint, image_size=0)


def test_smaller_asks_need_no_flag(big, small):
    """A server started without --max-batch-size or --max-image-size ("big": 48 px, batch 16)
    serves a smaller batch size and a smaller image size (its buffers are flat): the batches
    equal those of servers started at that size ("small" at 32 px; LocalLoader at batch 8)."""
    with loader_for(big.endpoint, image_size=(32, 32), prefetch_next_epoch=False) as at32:
        got = epoch_of(at32, 0)
    with loader_for(small.endpoint, prefetch_next_epoch=False) as own:
        assert_same(got, epoch_of(own, 0))
    with loader_for(big.endpoint, batch_size=8, prefetch_next_epoch=False) as by8:
        got = epoch_of(by8, 0)
    root = str(default_dataset().val_root)
    with LocalLoader(
        root, batch_size=8, image_size=48, seed=SEED, output_dtype="uint8", with_indices=True
    ) as local:
        assert_same(got, take(local))
