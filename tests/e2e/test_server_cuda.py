"""pipeline-server with `--device cuda`, end to end: a real server process on the GPU, a real
RemoteLoader, compared with the same server on the CPU (skipped without CUDA).

With the CPU decoder, only the augment kernel differs between the two runs (CUDA against C++),
so the batches match to the kernel tolerance (1 grey level). With a GPU decoder (DALI or nvJPEG)
the decoded pixels differ from libjpeg-turbo's (other IDCT and chroma upsampling, no DCT-domain
shrinking), so the sampling (indices, labels) is exact and the images' mean colours are close.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.decode.dali import dali_decode_missing
from batchwire.pipeline.decode.nvjpeg import nvjpeg_decode_missing
from batchwire.server.memory import gpu_memory_statement
from serverproc import running_server, small_server_args

CUDA = torch.cuda.is_available()


def epoch(endpoint: str) -> list[tuple[torch.Tensor, ...]]:
    with RemoteLoader(
        endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True,
        normalize_on_device=False,  # the servers' uint8 pixels, compared to a grey level
    ) as loader:  # fmt: skip
        return [tuple(t.clone() for t in batch) for batch in loader]


@pytest.fixture(scope="module")
def cpu_epoch():
    with running_server(*small_server_args(seed=11)) as srv:
        return epoch(srv.endpoint)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("decoder", ["cpu", "auto"])
def test_cuda_server_serves_the_cpu_servers_epoch(cpu_epoch, decoder):
    args = (*small_server_args(seed=11), "--device", "cuda", "--decoder", decoder)
    with running_server(*args, "--log-level", "INFO") as srv:
        got = epoch(srv.endpoint)
        log = srv.log()
    assert "GPU memory bound:" in log, log[-2000:]
    if decoder == "auto":  # a GPU decoder where one decodes here: not a silent CPU fallback
        chosen = re.search(r"decoder: (\w+) on cuda", log)
        assert chosen is not None, log[-2000:]
        gpu_decodes = dali_decode_missing("cuda") is None or nvjpeg_decode_missing("cuda") is None
        assert (chosen.group(1) != "cpu") == gpu_decodes, log[-2000:]
    assert len(got) == len(cpu_epoch) > 0
    colour_diffs = []
    for (images, labels, indices), (ref_images, ref_labels, ref_indices) in zip(
        got, cpu_epoch, strict=True
    ):
        assert torch.equal(indices, ref_indices) and torch.equal(labels, ref_labels)
        assert images.shape == ref_images.shape and images.dtype == torch.uint8
        if decoder == "cpu":
            diff = (images.int() - ref_images.int()).abs()
            assert diff.max() <= 1, "the CUDA kernel must match the CPU kernel to 1 grey level"
        colour = images.float().mean((2, 3)) - ref_images.float().mean((2, 3))
        colour_diffs.append(colour.abs().flatten())
    # A GPU decoder decodes at full size where the CPU decoder shrinks in the DCT domain, so
    # sharp edges differ; each image's mean colour barely moves (measured on this dataset with a
    # full libjpeg decode standing in for the GPU's: 0.43 grey levels on average, 3.5 at worst),
    # while a wrong channel order or a garbled decode would move it by tens.
    diffs = torch.cat(colour_diffs)
    assert diffs.mean() < 1.5 and diffs.max() < 12, (diffs.mean(), diffs.max())


def test_gpu_memory_statement_adds_each_producers_decode_output_and_batch():
    line = gpu_memory_statement(3, 64, 16 * 2**20, 64 * 3 * 224 * 224)
    assert "3 producers x (decode output 3072 MiB + batch 9 MiB) = 9244 MiB" in line, line
    # A decoder with no pixel bound (DALI on the CPU) holds no device decode output.
    assert "decode output 0 MiB" in gpu_memory_statement(2, 64, None, 2**20)


_PIN_ON_SECOND_GPU = """
import os, subprocess
from batchwire.server.bufpool import BufferPool
from batchwire.wire import BatchSpec

spec = BatchSpec(batch_size=4, height=8, width=8, dtype="uint8")
pool = BufferPool(spec, 8, pin=True, flat=True, device="cuda:1")
assert pool.acquire().tensor.is_pinned()


def rows(*query):
    out = subprocess.check_output(["nvidia-smi", *query, "--format=csv,noheader"], text=True)
    return [line.split(", ") for line in out.splitlines() if ", " in line]


index_of = {uuid: index for index, uuid in rows("--query-gpu=index,uuid")}
mine = [index_of[uuid] for pid, uuid in rows("--query-compute-apps=pid,gpu_uuid")
        if int(pid) == os.getpid()]
print(",".join(sorted(mine)))
"""


@pytest.mark.cuda
@pytest.mark.multi_gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or shutil.which("nvidia-smi") is None,
    reason="needs two CUDA devices and nvidia-smi",
)
def test_pinned_buffers_for_the_second_gpu_open_no_context_on_the_first() -> None:
    """--device cuda:1 with the CPU decoder: the buffer pool's first pinned block is the
    process's first CUDA call. torch's pinned allocator opens a context on the thread's
    current device when none exists, so without `BufferPool._allocating_on` GPU 0 got one."""
    run = subprocess.run(
        [sys.executable, "-c", _PIN_ON_SECOND_GPU], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    gpus = run.stdout.strip()
    if not gpus:
        pytest.skip("nvidia-smi lists no process of this container (another PID namespace)")
    assert gpus == "1", f"the process holds contexts on GPUs {gpus}"
