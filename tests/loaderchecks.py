"""RemoteLoaders as the end-to-end tests build them, and the checks of what they hand out.

- `take`, `rest`, `assert_same`: batches copied off an iterator and compared by their first
  sample index and their tensors (test_remote_loader_recovery, test_fleet, test_client_fleet_e2e).
- `loader`, `epoch`, `assert_identical`: one rank's whole epoch, compared bit for bit across
  sources and dtypes (test_sources_identity, test_sources_s3, test_sources_gcs_azure, test_mix_s3).
- `counting_loader`: a loader whose batches are exactly those the server counts
  (test_corrupt_served, test_checksums_server, test_mix_s3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from batchwire.client import RemoteLoader


def take(it, n: int) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in next(it)) for _ in range(n)]


def rest(it) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in batch) for batch in it]


def assert_same(a, b) -> None:
    got = [int(x[2][0]) for x in a]
    want = [int(x[2][0]) for x in b]
    assert got == want, "batches lost, duplicated or out of order (first index of each batch)"
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert torch.equal(tx, ty), f"batch {k} differs"


def loader(endpoint: str, split: str) -> RemoteLoader:
    return RemoteLoader(
        endpoint, split, rank=0, world_size=1, device="cpu", with_indices=True, timeout=60
    )


def epoch(
    endpoint: str, split: str, n: int, make: Callable[[str, str], RemoteLoader] | None = None
) -> list[tuple[torch.Tensor, ...]]:
    """Epoch ``n`` of ``split`` from a fresh loader (`loader`, or ``make``: `counting_loader`
    where the server's counts are checked against what was taken)."""
    ld = (make or loader)(endpoint, split)
    ld.set_epoch(n)
    try:
        return [tuple(t.clone() for t in batch) for batch in ld]
    finally:
        ld.close()


def assert_identical(want, got, what: str) -> None:
    assert len(want) == len(got) > 0, what
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        for tx, ty in zip(x, y, strict=True):
            assert tx.dtype == ty.dtype and tx.shape == ty.shape, what
            assert torch.equal(tx.view(torch.uint8), ty.view(torch.uint8)), f"{what}: batch {k}"


def counting_loader(endpoint: str, split: str) -> RemoteLoader:
    """The only rank of `split`, each batch with its sampler indices, no next-epoch batches
    asked ahead and a heartbeat as long as the timeout: the server's counts (`replaced_total`,
    a mix's `served_total`) must count exactly the batches taken here. A batch asked ahead and
    never taken would count too, and so would one sent again after a hello re-sent to a server
    that was silent past the default 1 s heartbeat (a loaded machine). Also used by
    test_checksums_server and test_mix_s3."""
    return RemoteLoader(
        endpoint,
        split,
        rank=0,
        world_size=1,
        with_indices=True,
        timeout=60,
        heartbeat=60,
        prefetch_next_epoch=False,
    )


def counted_batches(endpoint: str, split: str, epochs: int) -> list[tuple[torch.Tensor, list[int]]]:
    """(images, sampler indices) of every batch of ``epochs`` epochs, through `counting_loader`."""
    out = []
    with counting_loader(endpoint, split) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for images, _labels, indices in loader:
                out.append((images.clone(), indices.tolist()))
    return out
