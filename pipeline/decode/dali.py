"""Batch decoding with an NVIDIA DALI pipeline: the GPU (hardware JPEG decoder + nvJPEG) or CPU.

Why it looks like this:
- The encoded bytes come from our own reader (the server's `read` stage), so the pipeline is just
  `fn.external_source -> fn.decoders.image`; sampling, cropping and augmenting stay ours. The
  outputs reach torch through DLPack without a copy (on the GPU, `torch.from_dlpack` makes the
  consumer's stream wait on DALI's).
- DALI fails a whole batch when one file is corrupt, and may leave the pipeline unusable. We beat
  that: only requests whose header parsed as a plain JPEG go to DALI; when a run still fails, the
  pipeline is rebuilt (about 10 ms), the sample DALI names in its error (or, failing that, a
  bisection) is set aside and the rest retried, and every set-aside image is decoded by the CPU
  decoder alone (`fallbacks`), so one bad image never fails the batch.
- DALI has no DCT scaling, but it decodes a region of interest (`decoders.image_slice`,
  libjpeg-turbo skipping rows and columns outside it): each image is decoded only over its crop
  box plus a margin as wide as the resampling filter's support, so the augmented output equals
  the one from a full decode, and each result's box is re-expressed in that region. DALI applies
  EXIF orientation itself, with the region in oriented coordinates (checked against PIL in the
  tests); a result whose shape is not the expected one goes to the CPU instead.
- GPU memory is bounded: images over `max_image_pixels` decode on the CPU, and the bound
  (batch x largest image x 3 bytes) is logged when the decoder starts.
"""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import torch
from batchwire.pipeline.decode.contract import DecodeRequest, DecodeResult
from batchwire.pipeline.decode.fallback import (
    DEFAULT_MAX_GPU_IMAGE_PIXELS,
    GpuBatch,
    GpuDecoderBase,
    parse_device,
)
from batchwire.pipeline.decode.region import Region, reach_region

log = logging.getLogger("batchwire.pipeline")

_SAMPLE_IN_ERROR = re.compile(r"sample #(\d+)")


#: The oldest DALI this decoder runs on: `pipeline_def(..., exec_dynamic=True)` came in 1.44.
MIN_DALI = (1, 44)
#: What to install, in the messages that say DALI is missing or too old.
DALI_INSTALL = (
    "pip install 'batchwire[dali-cuda13]' (nvidia-dali-cuda130, for a CUDA 13 torch) or "
    "'batchwire[dali]' (nvidia-dali-cuda120, CUDA 12)"
)


def dali_available() -> bool:
    """True when `nvidia.dali` imports (it is an optional extra: `batchwire[dali]`)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def dali_version_problem(version: str) -> str | None:
    """Why DALI `version` ('1.43.0', '2.4.0') is too old for this decoder, or None."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    if len(parts) == 2 and tuple(parts) >= MIN_DALI:
        return None
    floor = ".".join(map(str, MIN_DALI))
    return f"NVIDIA DALI {version} is installed, this decoder needs >= {floor}: {DALI_INSTALL}"


def dali_decode_missing(device: str | torch.device) -> str | None:
    """Why the DALI decoder cannot be used on `device`, or None when it can: DALI imports, is
    new enough, and a decoder built there decoded a tiny embedded JPEG right (once per device
    and process). What `auto` asks before it picks DALI: importing proves little (an old
    release stops the pipeline's construction; a DALI for another CUDA major fails on the
    GPU)."""
    try:
        import nvidia.dali
    except ImportError as e:
        return f"NVIDIA DALI is not installed ({e}): {DALI_INSTALL}"
    problem = dali_version_problem(str(getattr(nvidia.dali, "__version__", "0")))
    if problem is not None:
        return problem
    return _probe_once(str(parse_device(device)))


@functools.cache
def _probe_once(device: str) -> str | None:
    return probe_dali(device)


def probe_dali(device: str | torch.device) -> str | None:
    """Build a `DaliBatchDecoder` on `device` and decode `nvjpeg.PROBE_JPEG` with it: None when
    the pixels are right, else why not (any failure counts)."""
    from batchwire.pipeline.decode.headers import read_header
    from batchwire.pipeline.decode.nvjpeg import PROBE_JPEG, PROBE_RGB, PROBE_SHAPE

    header = read_header(PROBE_JPEG)
    box = (0.0, 0.0, float(header.height), float(header.width))
    request = DecodeRequest(0, PROBE_JPEG, header, box, (header.height, header.width))
    try:
        decoder = DaliBatchDecoder(device, threads=1, max_batch=1, roi=False)
        try:
            (result,) = decoder._decode_probe(request)
        finally:
            decoder.close()
    except Exception as e:  # an old or mismatched DALI fails in many ways: not usable here
        return f"DALI on {device} failed on a test image: {type(e).__name__}: {_short(e)}"
    if result is None or result.image is None:
        return f"DALI on {device} could not decode a test image"
    got = result.image.cpu()
    want = (PROBE_SHAPE[1], PROBE_SHAPE[2], PROBE_SHAPE[0])
    if tuple(got.shape) != want:
        return f"DALI on {device} decoded a test image as {tuple(got.shape)}, not {want}"
    mean = got.float().mean(dim=(0, 1))
    if (mean - torch.tensor(PROBE_RGB, dtype=torch.float32)).abs().max() > 8.0:
        colour = tuple(round(v, 1) for v in mean.tolist())
        return f"DALI on {device} decoded a test image of colour {PROBE_RGB} as {colour}"
    return None


def decode_region(req: DecodeRequest) -> Region:
    """(y0, x0, y1, x1) integer region of the oriented image to decode for `req`'s crop.

    The crop box grows by the resize filter's reach (`region.reach_region`, the same margin the
    CPU region decoder uses), so pixels just outside the box that the filter reads are decoded
    too. The region is never empty: DALI refuses a zero-sized slice.
    """
    h, w = req.header.height, req.header.width
    box = tuple(float(v) for v in req.box)
    out_hw = (max(1, int(req.out_hw[0])), max(1, int(req.out_hw[1])))
    ry0, rx0, ry1, rx1 = reach_region(box, out_hw, (h, w))
    ry0, rx0 = min(ry0, h - 1), min(rx0, w - 1)
    return ry0, rx0, max(ry1, ry0 + 1), max(rx1, rx0 + 1)


def _short(error: BaseException) -> str:
    """DALI errors repeat the pipeline traceback; the informative line is the last non-blank."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    keep = [line for line in lines if "sample #" in line or "decode" in line.lower()]
    return (keep or lines or [type(error).__name__])[-1][:200]


class DaliBatchDecoder(GpuDecoderBase):
    """A `BatchDecoder` over a DALI decoding pipeline (device 'mixed' on CUDA, CPU else).

    `roi` (default: on for CPU, off for CUDA) decodes only each crop's region.
    """

    orientation_from_bitstream = True  # adjust_orientation: DALI reads the EXIF itself

    name = "dali"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        hw_decoder_load: float = 0.65,
        max_batch: int = 256,
        max_image_pixels: int | None = None,
        roi: bool | None = None,
    ) -> None:
        try:
            import nvidia.dali
        except ImportError as e:
            raise RuntimeError(
                f"the DALI decoder needs NVIDIA DALI: {DALI_INSTALL} ({e})"
            ) from None
        too_old = dali_version_problem(str(getattr(nvidia.dali, "__version__", "0")))
        if too_old is not None:
            raise RuntimeError(too_old)
        self.device = parse_device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"DALI on {self.device} needs CUDA, and torch sees no CUDA device")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {hw_decoder_load}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.hw_decoder_load = float(hw_decoder_load)
        self.max_batch = int(max_batch)
        if max_image_pixels is None and self.device.type == "cuda":
            max_image_pixels = DEFAULT_MAX_GPU_IMAGE_PIXELS
        self.max_image_pixels = max_image_pixels
        # Region decoding is a measured CPU win; on the GPU the hardware decoder's fast path is
        # the full image, so there it is opt-in until measured on a GPU machine.
        self.roi = (self.device.type == "cpu") if roi is None else bool(roi)
        self._start_fallback(threads)
        self.rebuilds = 0
        # Set aside the sample DALI's error names; without a name (or with this off) bisect.
        self.use_error_hint = True
        self._broken: str | None = None
        self._pipe = self._build()
        if self.device.type == "cuda":
            self._log_output_bound(f", hw_decoder_load={self.hw_decoder_load:.2f}")

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        on_gpu = self.device.type == "cuda"
        extra = {}
        if on_gpu:
            # Same chroma upsampling as libjpeg-turbo, so GPU and CPU fallback pixels agree.
            extra = {"hw_decoder_load": self.hw_decoder_load, "jpeg_fancy_upsampling": True}

        common = {
            "device": "mixed" if on_gpu else "cpu",
            "output_type": types.RGB,
            "adjust_orientation": True,
            **extra,
        }

        @pipeline_def
        def graph():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            if not self.roi:
                return fn.decoders.image(encoded, **common)
            start = fn.external_source(name="start", dtype=types.INT32, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
            return fn.decoders.image_slice(
                encoded,
                start,
                shape,
                axis_names="HW",
                normalized_anchor=False,
                normalized_shape=False,
                **common,
            )

        pipe = graph(
            batch_size=self.max_batch,
            num_threads=self.threads,
            device_id=self.device.index if on_gpu else None,
            prefetch_queue_depth=1,
            exec_dynamic=True,
        )
        pipe.build()
        return pipe

    def _run(self, datas: list[np.ndarray], regions: list[Region]) -> list[torch.Tensor]:
        """One DALI run over `datas` (<= max_batch); raises whatever DALI raises."""
        self._pipe.feed_input("encoded", datas)
        if self.roi:
            self._pipe.feed_input("start", [np.array(r[:2], np.int32) for r in regions])
            sizes = [np.array((r[2] - r[0], r[3] - r[1]), np.int32) for r in regions]
            self._pipe.feed_input("shape", sizes)
        if self.device.type == "cuda":
            # Outputs ordered on the caller's stream: DALI then also returns their memory to its
            # pool in that order, not while the caller's kernels may still read it.
            (out,) = self._pipe.run(torch.cuda.current_stream(self.device).cuda_stream)
        else:
            (out,) = self._pipe.run()
        # DLPack: a zero-copy view that keeps DALI's buffer alive; on CUDA torch makes its
        # current stream wait for DALI's before anything reads the pixels.
        return [torch.from_dlpack(out[i]) for i in range(len(datas))]

    def _region(self, req: DecodeRequest) -> Region:
        if self.roi:
            return decode_region(req)
        return 0, 0, req.header.height, req.header.width

    def _rebuild(self) -> None:
        """A fresh pipeline after a failed run; if even that fails, DALI is done for and every
        later image goes to the CPU decoder (logged once), rather than failing batches."""
        self._pipe = None
        self.rebuilds += 1
        try:
            self._pipe = self._build()
        except Exception as e:
            self._broken = f"DALI pipeline could not be rebuilt: {_short(e)}"
            log.error("dali decoder: %s; decoding everything on the CPU from now on", self._broken)

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        """Decode `items` (request positions) on DALI, setting aside what makes DALI fail."""
        requests, results, rejected = batch.requests, batch.results, batch.rejected
        pending = list(items)
        while pending:
            if self._broken is not None:
                rejected.update(dict.fromkeys(pending, self._broken))
                return
            regions = [self._region(requests[i]) for i in pending]
            try:
                images = self._run(
                    [np.frombuffer(requests[i].data, np.uint8) for i in pending], regions
                )
            except Exception as e:  # DALI raises RuntimeError; anything else is just as fatal
                self._rebuild()
                reason = f"DALI: {_short(e)}"
                if len(pending) == 1:
                    rejected[pending[0]] = reason
                    return
                match = _SAMPLE_IN_ERROR.search(str(e))
                culprit = int(match.group(1)) if match else -1
                if self.use_error_hint and 0 <= culprit < len(pending):
                    rejected[pending.pop(culprit)] = reason
                    continue
                mid = len(pending) // 2
                self._decode_group(pending[:mid], batch)
                pending = pending[mid:]
                continue
            for i, image, (ry0, rx0, ry1, rx1) in zip(pending, images, regions, strict=True):
                if tuple(image.shape) != (ry1 - ry0, rx1 - rx0, 3):
                    rejected[i] = (
                        f"DALI decoded shape {tuple(image.shape)} for the region "
                        f"{(ry0, rx0, ry1, rx1)} of a {requests[i].header}"
                    )
                    continue
                y0, x0, y1, x1 = (float(v) for v in requests[i].box)
                box = (y0 - ry0, x0 - rx0, y1 - ry0, x1 - rx0)
                results[i] = DecodeResult(image=image, box=box)
            return

    def _decode_probe(self, request: DecodeRequest) -> list[DecodeResult | None]:
        """`request` decoded by DALI alone (no CPU safety net, no strict check): the probe
        must see what DALI does, not what the fallback hides."""
        batch = GpuBatch.of([request])
        with self._lock:
            self._decode_group([0], batch)
        if batch.rejected:
            raise RuntimeError(batch.rejected[0])
        return batch.results

    def _routine(self, reason: str) -> bool:
        # A pipeline that cannot be rebuilt was logged as an error once: no warning per image.
        return self._broken is not None and reason == self._broken

    def close(self) -> None:
        with self._lock:
            self._pipe = None
        super().close()

    def __repr__(self) -> str:
        return (
            f"DaliBatchDecoder(device={self.device}, threads={self.threads}, "
            f"max_batch={self.max_batch})"
        )
