"""What the GPU-side decoders (DALI, nvJPEG) share: the CPU safety net and the batch skeleton.

A GPU decoder hands every image it could not or would not decode (not a JPEG, too large for the
GPU memory bound, rejected by the library, a corrupt file that made a whole batch fail) to the
CPU decoder, one image at a time, so one bad file never fails a batch. Each such image is
counted and logged once per dataset index, so a dataset with a few odd files says so without
flooding the log every epoch.

`GpuDecoderBase.decode_batch` is that routine once for both decoders: route, check, decode the
rest in chunks of `max_batch` under one lock, send what is left to `CpuFallback`. A decoder
supplies only `_decode_group` (and may add reasons to `_skip_reason`).

Strictness: nvJPEG and DALI (CPU and mixed) decode many damaged JPEGs without an error (DALI's
CPU backend returned pixels for damaged files the strict decode rejects, see
tests/unit/test_decode_strict.py), so every JPEG request that is not `intact` passes
`backends.check_jpeg_data`, the strict full entropy decode, on the CPU decode threads, on its
whole file, before it is cut down to its crop's restart intervals or decoded: a cut file is
checked only in the intervals it keeps, and a damaged table can leave those decodable (see
contract.py). A refused file goes to the CPU decoder as it was, which refuses it too and says
why. That check costs a full entropy decode per image on the CPU (~0.7 ms for an ImageNet
photo, so one core checks ~1,400 images/s), which is why `intact` requests (bytes matching a
checksum recorded for a file that passed the strict decode) skip it: on a prepared dataset
with its manifest the GPU decodes with no CPU pass over the data.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from batchwire.common import devices
from batchwire.common.cores import available_cores
from batchwire.pipeline.decode.backends import check_jpeg_data
from batchwire.pipeline.decode.contract import DecodeError, DecodeRequest, DecodeResult
from batchwire.pipeline.decode.cpu import CpuBatchDecoder
from batchwire.pipeline.decode.restart import narrow_request

log = logging.getLogger("batchwire.pipeline")

DEFAULT_MAX_GPU_IMAGE_PIXELS = 16 * 1024 * 1024


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N'; a decoder's index-less 'cuda' is GPU 0."""
    return devices.parse_device(device, default_index=0)


def has_end_of_image(data: bytes) -> bool:
    """Whether the JPEG `data` ends with its EOI marker (FF D9), past any zero padding some
    writers append. Both GPU decoders check it (`GpuDecoderBase._skip_reason`): neither reliably
    reports a truncated file, whose strict check a request marked `intact` skips. The plain
    ending is tried first: it needs no copy of the file's tail."""
    return data.endswith(b"\xff\xd9") or data[-4096:].rstrip(b"\0").endswith(b"\xff\xd9")


def upload(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU-decoded `image` on `device`, queued on the current stream without making this
    thread wait for the GPU. A plain `.to(device)` from pageable memory synchronises with the
    stream first (CUDA's rule for pageable host-to-device copies), i.e. the host waits for all
    the consumer's queued work; from a pinned copy the upload is only queued. Torch's pinned
    allocator records an event on the stream for that copy and reuses the staging block only
    once it has run, so dropping `staging` here is safe."""
    if device.type != "cuda":
        return image.to(device)
    staging = torch.empty(image.shape, dtype=image.dtype, pin_memory=True)
    staging.copy_(image)
    return staging.to(device, non_blocking=True)


class CpuFallback:
    """Decodes requests on a `CpuBatchDecoder` and moves the pixels to `device` (`upload`).

    `fallbacks` counts images handed over; `failures` counts those the CPU could not decode
    either (their results carry `image=None` and the error).
    """

    def __init__(self, owner: str, device: torch.device, threads: int) -> None:
        self.owner = owner
        self.device = device
        self.threads = max(1, int(threads))
        self._cpu: CpuBatchDecoder | None = None
        self._lock = threading.Lock()
        self._logged: set[int] = set()
        self.fallbacks = 0
        self.failures = 0

    def _decoder(self) -> CpuBatchDecoder:
        with self._lock:
            if self._cpu is None:
                self._cpu = CpuBatchDecoder(self.threads)
            return self._cpu

    @property
    def pool(self) -> ThreadPoolExecutor | None:
        """The CPU decoder's threads (None with one thread)."""
        return self._decoder().pool

    def decode(
        self,
        requests: Sequence[DecodeRequest],
        reasons: Sequence[str],
        routine: Sequence[bool] | None = None,
    ) -> list[DecodeResult]:
        """CPU-decode `requests` (why each one is here: `reasons`), results in request order.

        `routine[i]` marks an image sent here by design (not a JPEG, over the GPU bound): it is
        logged at DEBUG unless the CPU fails too; the rest (rejected by the GPU decoder) at
        WARNING, once per dataset index.
        """
        if not requests:
            return []
        results: list[DecodeResult | None] = list(self._decoder().decode_batch(requests))
        out: list[DecodeResult] = []
        with self._lock:
            self.fallbacks += len(requests)
            flags = routine if routine is not None else [False] * len(requests)
            for req, reason, quiet, res in zip(requests, reasons, flags, results, strict=True):
                if res.image is None:
                    self.failures += 1
                if req.index not in self._logged:
                    self._logged.add(req.index)
                    outcome = "decoded on the CPU" if res.image is not None else res.error
                    level = logging.DEBUG if quiet and res.image is not None else logging.WARNING
                    log.log(
                        level,
                        "%s decoder: image %d (%s): %s",
                        self.owner,
                        req.index,
                        reason,
                        outcome,
                    )
        for j, res in enumerate(results):
            results[j] = None  # each CPU image is freed once moved to the device
            assert res is not None
            if res.image is not None and res.image.device != self.device:
                res = DecodeResult(upload(res.image, self.device), res.box, None, route=res.route)
            out.append(res)
        return out

    def map(self, fn, items: Sequence) -> list:
        """`fn` over `items` on the CPU decoder's threads (the strict checks run there)."""
        return self._decoder().map(fn, items)

    def close(self) -> None:
        with self._lock:
            if self._cpu is not None:
                self._cpu.close()
                self._cpu = None


@dataclasses.dataclass
class GpuBatch:
    """One `decode_batch` call as a GPU decoder's `_decode_group` sees it: the requests (strictly
    checked and cut to their restart intervals) and, per position, what became of each: its
    `results[i]`, or the reason the GPU decoder gave it up, `rejected[i]` (the CPU decoder then
    decodes it). One object because every group of the call writes into the same two."""

    requests: Sequence[DecodeRequest]
    results: list[DecodeResult | None]
    rejected: dict[int, str]

    @classmethod
    def of(cls, requests: Sequence[DecodeRequest]) -> GpuBatch:
        """Nothing decoded or rejected yet."""
        return cls(requests, [None] * len(requests), {})


class GpuDecoderBase:
    """The `BatchDecoder` skeleton of a GPU-side decoder with the CPU decoder as safety net.

    A subclass sets `name`, `device`, `max_batch` and `max_image_pixels` (None: no bound), calls
    `_start_fallback(threads)`, and implements `_decode_group`. Requests for files with restart
    markers are cut down to their crop's restart intervals (`restart.narrow_request`) once
    their bytes are known sound (`intact`, or the strict check passed): the GPU decoder, and
    the CPU fallback too, then decode only that much of the bitstream.
    `orientation_from_bitstream`: the decoder applies EXIF orientation itself (DALI), so
    oriented images keep their whole file (the small JPEG carries no EXIF).
    """

    orientation_from_bitstream = False

    name: str
    device: torch.device
    max_batch: int
    max_image_pixels: int | None
    threads: int

    def _start_fallback(self, threads: int | None) -> None:
        self.threads = max(1, int(threads if threads is not None else available_cores()))
        self._fallback = CpuFallback(self.name, self.device, self.threads)
        self._lock = threading.Lock()

    def _log_output_bound(self, extra: str = "") -> None:
        """Say at start how much GPU memory one batch's decode output can take at most."""
        assert self.max_image_pixels is not None
        log.info(
            "%s decoder on %s: output bound %d images x %.1f MP x 3 B = %.0f MiB "
            "(larger images decode on the CPU)%s",
            self.name,
            self.device,
            self.max_batch,
            self.max_image_pixels / 1e6,
            self.max_batch * self.max_image_pixels * 3 / 2**20,
            extra,
        )

    @property
    def pool(self) -> ThreadPoolExecutor | None:
        """The CPU fallback's threads: the sample loader reads and checks a batch's files on
        them (`SampleLoader._each`), as it does on a CPU decoder's, instead of one file at a
        time on the producer thread."""
        return self._fallback.pool

    @property
    def fallbacks(self) -> int:
        """Images decoded by the CPU decoder instead (skipped or rejected by the GPU decoder)."""
        return self._fallback.fallbacks

    @property
    def failures(self) -> int:
        """Images neither decoder could decode (returned with `error` set)."""
        return self._fallback.failures

    def _skip_reason(self, req: DecodeRequest) -> str | None:
        """Why `req` goes straight to the CPU decoder, or None to try it on the GPU."""
        if req.header.kind != "jpeg":
            return "not a plain JPEG"
        if self.max_image_pixels is not None and req.header.pixels > self.max_image_pixels:
            return f"{req.header.pixels} pixels over the {self.max_image_pixels} GPU bound"
        if not req.data:
            return "empty"
        if not has_end_of_image(req.data):
            # nvJPEG and DALI's mixed backend may return a truncated file's missing part as
            # grey without a word; the CPU decoder refuses it (or says why it decoded it).
            return "no end-of-image marker (truncated?)"
        return None

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        """Decode `batch.requests[i]` for i in `items` (<= max_batch) into `batch.results[i]`, or
        put the reason it failed into `batch.rejected[i]`. Called under the decoder's lock."""
        raise NotImplementedError

    def _routine(self, reason: str) -> bool:
        """True for a GPU-side rejection already reported otherwise (no warning per image)."""
        return False

    def decode_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        rejected: dict[int, str] = {}
        work = self._strictly_checked(requests, rejected)
        batch = GpuBatch(work, [None] * len(work), rejected)
        routed: set[int] = set()
        eligible: list[int] = []
        upright_only = self.orientation_from_bitstream
        for i, req in enumerate(work):
            if i in rejected:
                continue  # refused by the strict check: the CPU decoder gets the whole file
            work[i] = req = narrow_request(req, upright_only=upright_only)
            reason = self._skip_reason(req)
            if reason is None:
                eligible.append(i)
            else:
                rejected[i] = reason
                routed.add(i)
        with self._lock:
            for start in range(0, len(eligible), self.max_batch):
                chunk = eligible[start : start + self.max_batch]
                self._decode_group(chunk, batch)
        if rejected:
            order = sorted(rejected)
            redone = self._fallback.decode(
                [work[i] for i in order],
                [rejected[i] for i in order],
                [i in routed or self._routine(rejected[i]) for i in order],
            )
            for i, res in zip(order, redone, strict=True):
                batch.results[i] = res
        return batch.results  # type: ignore[return-value]  # every slot is filled above

    def _strictly_checked(
        self, requests: Sequence[DecodeRequest], rejected: dict[int, str]
    ) -> list[DecodeRequest]:
        """`requests` with each JPEG that is not `intact` strictly checked whole (see the module
        doc) on the CPU threads: one that passes comes back `intact` (its bytes are now known
        to pass the strict full decode, so it may be cut down), one that fails as it was, with
        its reason in `rejected` (not routine: warned once per index). Other requests (intact,
        not a plain JPEG, empty) come back as they were."""
        work = list(requests)
        todo = [
            i
            for i, req in enumerate(requests)
            if not req.intact and req.header.kind == "jpeg" and req.data
        ]
        verdicts = self._fallback.map(_strict_verdict, [requests[i].data for i in todo])
        for i, verdict in zip(todo, verdicts, strict=True):
            if verdict is None:
                work[i] = dataclasses.replace(requests[i], intact=True)
            else:
                rejected[i] = f"refused by the strict check: {verdict}"
        return work

    def close(self) -> None:
        self._fallback.close()


def _strict_verdict(data: bytes) -> str | None:
    """None when `data` passes `check_jpeg_data`, else why not."""
    try:
        check_jpeg_data(data)
    except DecodeError as e:
        return str(e)
    return None
