"""The batchwire row of `pipeline-bench`: a real `pipeline-server` process feeding a
RemoteLoader in this process, as a training job would use them.

By default the server decodes and augments into uint8 batches (4x fewer wire bytes than
float32) and the loader normalises them to float32 on its device; with `wire="float32"` the
server's fused op normalises and the loader takes the batches as they come. Either way a
training loop receives normalised float32 images, like the DataLoader's and DALI's rows.
The server's start-up and the first batches fall into the warm-up.
"""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from batchwire.bench.baselines import Measured, time_batches


def free_tcp_endpoint() -> str:
    """A loopback endpoint whose port was free a moment ago (the server binds it right away)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def batchwire_row(
    train: str,
    *,
    device: str,
    threads: int,
    decoder: str,
    batch_size: int,
    image_size: int,
    measure_images: int,
    wire: str = "uint8",
    warmup: int = 10,
    max_seconds: float = 60,
    start_timeout: float = 120,
) -> Measured:
    """Start the server on `train`, time RemoteLoader batches, stop the server."""
    from batchwire.client import RemoteLoader

    endpoint = free_tcp_endpoint()
    command = [
        sys.executable,
        "-m",
        "batchwire.server",
        "--bind",
        endpoint,
        "--train",
        train,
        "--batch-size",
        str(batch_size),
        "--image-size",
        str(image_size),
        "--output-dtype",
        wire,
        "--workers",
        str(threads),
        "--decoder",
        decoder,
        "--device",
        device,
        "--log-level",
        "WARNING",
    ]
    with tempfile.TemporaryDirectory(prefix="bw-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        loader = None
        try:
            loader = RemoteLoader(
                endpoint,
                split="train",
                rank=0,
                world_size=1,
                device=device,
                normalize_on_device=wire == "uint8",
                timeout=start_timeout,
                prefetch=4,
            )

            def batches() -> Iterator[int]:
                for epoch in itertools.count():
                    loader.set_epoch(epoch)
                    for images, _labels in loader:
                        yield int(images.shape[0])

            sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
            return time_batches(batches(), warmup, measure_images, max_seconds, sync)
        except Exception as e:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{e}\n--- pipeline-server log (tail) ---\n{tail}") from e
        finally:
            if loader is not None:
                loader.close()
            _stop(proc)
