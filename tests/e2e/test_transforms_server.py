"""User transforms and rectangular output through real servers: identical bytes from two
servers, exact mid-epoch resume, and a hostile transform (it raises, exits, returns NaN, values a
float16 output cannot hold or a meta tensor on some samples, and draws from torch's global RNG)
whose failures are replaced with the epoch whole."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.synthetic import default_dataset
from batchwire.pipeline.transforms import transform_seeds
from promtext import parse_metrics
from serverproc import running_server, small_server_args

USER = Path(__file__).resolve().parent / "test_transforms_user.py"
SEED = 5


def loader_for(endpoint: str) -> RemoteLoader:
    """The raw wire (no normalisation on the loader), with each sample's index."""
    return RemoteLoader(
        endpoint,
        "train",
        rank=0,
        world_size=1,
        device="cpu",
        with_indices=True,
        timeout=60.0,
        normalize_on_device=False,
    )


def epoch_of(loader: RemoteLoader, epoch: int, start: int = 0) -> list[tuple[torch.Tensor, ...]]:
    state = loader.state_dict()
    loader.load_state_dict({**state, "epoch": epoch, "next_batch": start})
    loader.set_epoch(epoch)
    return [tuple(t.clone() for t in b) for b in loader]


#: How the hostile transform misbehaves on the 3rd to 8th samples of batch 2 (test_transforms_user).
HOSTILE_KINDS = ("raise", "exit", "interrupt", "nan", "int70000", "meta")


@pytest.mark.timeout(180)
def test_hostile_transform_identical_across_servers_resume_and_failures_replaced() -> None:
    root = str(default_dataset().val_root)
    n = len(open_dataset(root))
    order = ShardSampler(n, 16, seed=SEED, shuffle=True, drop_last=True).plan(0, 2).indices
    victims = [int(i) for i in order[2 : 2 + len(HOSTILE_KINDS)]]
    seeds = transform_seeds(SEED, 0, victims)
    env = {
        "BW_TEST_HOSTILE": ",".join(f"{s}:{k}" for s, k in zip(seeds, HOSTILE_KINDS, strict=True))
    }
    args = (
        *small_server_args(seed=SEED, root=root),
        *("--output-dtype", "float16", "--transform", f"{USER}:hostile_global_rng"),
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics_args = ("--metrics-port", str(port))
    with running_server(*args, *metrics_args, env=env) as a, running_server(*args, env=env) as b:
        with loader_for(a.endpoint) as la:
            first = epoch_of(la, 0)
        with loader_for(b.endpoint) as lb:
            second = epoch_of(lb, 0)
            resumed = epoch_of(lb, 0, start=3)
        stats = a.stats()
        log = a.log()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = parse_metrics(resp.read().decode())
    # The transform's global-RNG draws are seeded per sample: both servers send the same bytes.
    assert len(first) == n // 16
    for k, (x, y) in enumerate(zip(first, second, strict=True)):
        assert x[0].shape == (16, 3, 32, 32) and x[0].dtype == torch.float16
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True)), f"batch {k}"
    for x, y in zip(first[3:], resumed, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
    pixels = torch.stack([b[0] for b in first]).float()
    assert torch.isfinite(pixels).all() and pixels.std() > 10  # real images, no NaN, no inf
    assert first[2][2][2 : 2 + len(victims)].tolist() == victims  # slots keep their indices ...
    assert stats["counters"]["replaced_total"] >= len(victims)  # ... their pixels a substitute's
    # Each failure counted once (the stats map and Prometheus); server b failed them twice.
    assert stats["counters"]["transform_errors_total"] == len(victims)
    assert metrics["batchwire_transform_errors_total"] == float(len(victims))
    warned = [line for line in log.splitlines() if "replacing the sample" in line]
    assert len(warned) == len(victims) and all("hostile_global_rng" in w for w in warned), log
    for why in ("RuntimeError", "SystemExit", "KeyboardInterrupt", "non-finite", "range", "meta"):
        assert sum(why in w for w in warned) == 1, (why, warned)
    assert log.count("Traceback") == len(victims)
    assert log.count("draws from a global RNG") == 1


@pytest.mark.timeout(120)
def test_rectangular_output_with_the_fused_op_and_a_transform() -> None:
    base = small_server_args(seed=1)
    for extra in ((), ("--transform", f"{USER}:rrc24x40")):
        args = (*base, *extra, "--image-size", "24,40")
        with running_server(*args) as srv, loader_for(srv.endpoint) as loader:
            images, labels, _ = next(iter(loader))
            assert images.shape == (16, 3, 24, 40) and labels.shape == (16,)
            assert images.float().std() > 10
