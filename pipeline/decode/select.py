"""Choosing a `BatchDecoder` for `--decoder {auto,cpu,nvjpeg,dali}` and `--device`.

`auto` on CUDA prefers DALI (hardware JPEG decoder plus nvJPEG, mature batching), then
torchvision's nvJPEG, then the CPU; each GPU decoder only once a tiny embedded JPEG decoded right
on that device (`dali.dali_decode_missing`: DALI >= 1.44 too; `nvjpeg.nvjpeg_decode_missing`),
so an old or mismatched DALI, or a torchvision without nvJPEG, is passed over with its reason
logged instead of stopping the server or failing every image. On a CPU-only server `auto` is
the CPU decoder (TurboJPEG with DCT scaling, OpenCV for the rest): no optional package, one
path for every format, and the cheapest: on ImageNet-sized JPEGs at 224 px the whole pipeline
cost 1.34 CPU ms per image with it against 1.62 with DALI's CPU backend (1.10 against 1.37 on a
`pipeline-prepare`d copy; `pipeline-bench --decoder dali|cpu --prepared`, 2026-11-23). DALI's
CPU backend stays an explicit choice (`--decoder dali`). The choice and its reason are logged
on "batchwire.pipeline", and a decoder asked for by name that cannot run here is a clear error
naming what is missing, never a silent substitute.

`make_decoder` is the one place decoders are made (the server's `--decoder`, `LocalLoader`'s
`decoder=` name), and `DECODERS` the one list of names (the server CLI's choices): a new decoder
is registered here only.
"""

from __future__ import annotations

import logging

import torch
from batchwire.common.cores import available_cores
from batchwire.pipeline.decode.contract import DECODERS, BatchDecoder
from batchwire.pipeline.decode.cpu import CpuBatchDecoder
from batchwire.pipeline.decode.dali import (
    DALI_INSTALL,
    DaliBatchDecoder,
    dali_available,
    dali_decode_missing,
)
from batchwire.pipeline.decode.fallback import DEFAULT_MAX_GPU_IMAGE_PIXELS, parse_device
from batchwire.pipeline.decode.nvjpeg import NvjpegBatchDecoder, nvjpeg_decode_missing

log = logging.getLogger("batchwire.pipeline")


def _cuda_missing(device: torch.device) -> str | None:
    if not torch.cuda.is_available():
        return f"--device {device} needs CUDA, and torch sees no CUDA device"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible"
    return None


def make_decoder(
    name: str,
    device: str | torch.device | None = None,
    threads: int | None = None,
    *,
    max_batch: int = 256,
    max_gpu_image_pixels: int = DEFAULT_MAX_GPU_IMAGE_PIXELS,
    hw_decoder_load: float = 0.65,
) -> BatchDecoder:
    """The decoder `name` on `device` ('cpu', 'cuda', 'cuda:N'); see the module doc for 'auto'.

    `device` None: 'cuda' where torch sees a GPU and `name` is not 'cpu', else 'cpu'. `threads`
    None (or < 1): one per available core (`common.cores.available_cores`). `max_batch`: the most
    images one `decode_batch` call gets (GPU decoders size their buffers for it).

    Raises ValueError for an unknown name or device and RuntimeError when the requested decoder
    cannot run here (the message says what is missing).
    """
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}: choose one of {', '.join(DECODERS)}")
    if device is None:
        device = "cuda" if name != "cpu" and torch.cuda.is_available() else "cpu"
    dev = parse_device(device)
    if threads is None or threads < 1:
        threads = available_cores()
    if dev.type == "cuda" and (missing := _cuda_missing(dev)) is not None:
        raise RuntimeError(missing)

    if name == "auto":
        name, why = _auto_choice(dev)
    else:
        why = "asked for by name"

    decoder: BatchDecoder
    if name == "cpu":
        decoder = CpuBatchDecoder(threads)
    elif name == "dali":
        if not dali_available():
            raise RuntimeError(
                f"--decoder dali needs NVIDIA DALI, which is not installed: {DALI_INSTALL}"
            )
        decoder = DaliBatchDecoder(
            dev,
            threads,
            hw_decoder_load=hw_decoder_load,
            max_batch=max_batch,
            max_image_pixels=max_gpu_image_pixels if dev.type == "cuda" else None,
        )
    else:
        if dev.type != "cuda":
            raise RuntimeError("--decoder nvjpeg decodes on a GPU: use it with --device cuda[:N]")
        missing = nvjpeg_decode_missing(dev)
        if missing is not None:
            raise RuntimeError(f"--decoder nvjpeg needs CUDA and torchvision: {missing}")
        decoder = NvjpegBatchDecoder(
            dev, threads, max_batch=max_batch, max_image_pixels=max_gpu_image_pixels
        )
    log.info("decoder: %s on %s, %d threads (%s)", decoder.name, decoder.device, threads, why)
    return decoder


def _auto_choice(dev: torch.device) -> tuple[str, str]:
    """(decoder name, reason) for `--decoder auto` on `dev`."""
    if dev.type == "cpu":
        return "cpu", "auto on CPU: TurboJPEG with DCT scaling, no optional package needed"
    # Not merely importable: DALI < 1.44 stops at the pipeline's construction, a DALI for
    # another CUDA fails on the GPU, and a torchvision built without nvJPEG imports fine, then
    # fails every image (each retried on the CPU). A test image must decode right on `dev`.
    no_dali = dali_decode_missing(dev)
    if no_dali is None:
        return "dali", "auto on CUDA: DALI decoded a test image (hardware JPEG decoder + nvJPEG)"
    if dali_available():
        log.warning("decoder: auto passes over DALI: %s", no_dali)
    missing = nvjpeg_decode_missing(dev)
    if missing is None:
        return (
            "nvjpeg",
            f"auto on CUDA: no DALI ({no_dali}); torchvision's nvJPEG decoded a test image",
        )
    return (
        "cpu",
        f"auto on CUDA: no DALI ({no_dali}) and no nvJPEG ({missing}); decoding on the CPU",
    )
