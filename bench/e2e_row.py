"""The batchwire row of `pipeline-bench` (and of `bench_e2e`): a real `pipeline-server` process
feeding a RemoteLoader in this process, as a training job would use them.

By default the server decodes and augments into uint8 batches (4x fewer wire bytes than
float32) and the loader normalises them to float32 on its device; with `wire="float32"` the
server's fused op normalises and the loader takes the batches as they come. Either way a
training loop receives normalised float32 images, like the DataLoader's and DALI's rows.
The loader connects once the server answers (its start-up is never timed); the first batches
fall into the warm-up.

`pipeline_server` and `time_remote_loader` are the two halves, for benchmarks that time several
loaders against one server; `batchwire_row` is both in one call.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from batchwire.bench.baselines import Measured, RowLoop, time_batches
from batchwire.common.launcher import PipelineServer

if TYPE_CHECKING:
    from batchwire.wire.stats import Counters

#: How the benchmark's RemoteLoader reaches its server.
TRANSPORTS = ("ipc", "tcp")


@contextmanager
def pipeline_server(
    train: str,
    *,
    batch_size: int,
    image_size: int,
    threads: int | None,
    wire: str = "uint8",
    decoder: str = "auto",
    device: str = "cpu",
    producers: int | None = None,
    transport: str = "ipc",
    start_timeout: float = 120,
    keys: str | None = None,
) -> Iterator[str]:
    """Run `pipeline-server --train train` as a subprocess; yields its endpoint once it serves,
    stops it after (SIGTERM, SIGKILL after 15 s).

    ``transport`` "ipc" (a Unix socket, what a trainer on the server's host uses: measured 4-6 %
    faster end to end here than loopback TCP, whose stack costs CPU that decode needs) or
    "tcp" (loopback, as a trainer on another host would connect). An exception raised inside
    the block comes out as a RuntimeError carrying the tail of the server's log, since the
    cause of a failed row is usually written there (a failed start says it the same way).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    args = [
        "--train", train,
        "--allow-outside-root",  # the bench's list files name the images where they are
        "--batch-size", str(batch_size),
        "--image-size", str(image_size),
        "--output-dtype", wire,
        "--decoder", decoder,
        "--device", device,
        "--log-level", "WARNING",
    ]  # fmt: skip
    if threads is not None:  # else the server's default (see ServerConfig.decode_threads)
        args += ["--workers", str(threads)]
    if producers is not None:
        args += ["--producers", str(producers)]
    if keys is not None:
        args += ["--keys", keys]
    with tempfile.TemporaryDirectory(prefix="bw-bench-") as tmp:
        endpoint = None if transport == "tcp" else f"ipc://{tmp}/server.sock"  # None: picked
        server = PipelineServer(args, endpoint, log_path=Path(tmp) / "server.log")
        server.start(start_timeout)
        try:
            yield server.endpoint
        except Exception as e:
            tail = server.log(tail_chars=2000)
            raise RuntimeError(f"{e}\n--- pipeline-server log (tail) ---\n{tail}") from e
        finally:
            server.stop(grace=15.0)


def time_remote_loader(
    endpoint: str | Sequence[str],
    *,
    device: str,
    normalize_on_device: bool,
    measure_images: int,
    warmup: int = 10,
    max_seconds: float = 60,
    prefetch: int = 4,
    start_timeout: float = 120,
    keys: str | None = None,
) -> tuple[Measured, dict[str, Any]]:
    """Time the train batches a RemoteLoader receives from `endpoint` (or several servers'
    endpoints, one fleet), epoch after epoch.

    Returns the rate and the loader's own figures (`LoaderStats.as_dict()`, e.g. how much of
    the time the consumer waited for data).
    """
    from batchwire.client import RemoteLoader

    with RemoteLoader(
        endpoint,
        split="train",
        rank=0,
        world_size=1,
        device=device,
        normalize_on_device=normalize_on_device,
        timeout=start_timeout,
        prefetch=prefetch,
        keys=keys,
    ) as loader:

        def batches() -> Iterator[int]:
            for epoch in itertools.count():
                loader.set_epoch(epoch)
                for images, _labels in loader:
                    yield int(images.shape[0])

        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        measured = time_batches(batches(), warmup, measure_images, max_seconds, sync)
        return measured, loader.stats() or {}


def batchwire_row(
    train: str,
    loop: RowLoop,
    *,
    device: str,
    threads: int | None,
    decoder: str,
    wire: str = "uint8",
    transport: str = "ipc",
    start_timeout: float = 120,
    keys: str | None = None,
) -> Measured:
    """Start the server on `train`, time RemoteLoader batches, stop the server; with ``keys``
    (a `pipeline-keys` folder) both sides use them: every byte CURVE-encrypted."""
    with pipeline_server(
        train,
        batch_size=loop.batch_size,
        image_size=loop.image_size,
        threads=threads,
        wire=wire,
        decoder=decoder,
        device=device,
        transport=transport,
        start_timeout=start_timeout,
        keys=keys,
    ) as endpoint:
        measured, _stats = time_remote_loader(
            endpoint,
            device=device,
            # The trainer's float normalize runs where its model does: on a GPU it is GPU work,
            # on a CPU device the row yields the wire's raw uint8, as the decode-only row does.
            normalize_on_device=wire == "uint8" and torch.device(device).type != "cpu",
            measure_images=loop.measure_images,
            warmup=loop.warmup,
            max_seconds=loop.max_seconds,
            start_timeout=start_timeout,
            keys=keys,
        )
        fallbacks = server_fallbacks(endpoint, keys)
    return dataclasses.replace(measured, fallbacks=fallbacks)


def server_counters(endpoint: str, keys: str | None = None) -> Counters | None:
    """The server's totals (`wire.stats.Counters`), None where it does not answer."""
    from batchwire.wire.keys import ClientKeys
    from batchwire.wire.stats_client import StatsUnavailable, fetch_stats

    try:
        stats = fetch_stats(endpoint, keys=None if keys is None else ClientKeys.load(keys))
    except StatsUnavailable:
        return None
    return stats.counters


def server_fallbacks(endpoint: str, keys: str | None = None) -> int | None:
    """The server's `decode_fallbacks_total` (images its GPU decoder sent to the CPU decoder),
    None where the stats do not say (an older server, or no answer)."""
    counters = server_counters(endpoint, keys)
    return None if counters is None else counters.decode_fallbacks_total
