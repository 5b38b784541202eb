"""Batch JPEG decoding on a CUDA GPU with nvJPEG, through `torchvision.io.decode_jpeg`.

This is the GPU decode path for machines with torch + torchvision but no DALI: one batched call
decodes every eligible JPEG of the batch on the device. Why the rest:
- nvJPEG handles baseline colour and greyscale JPEGs well; everything else (PNG, CMYK/YCCK,
  files over the GPU memory bound, files without an end-of-image marker, which nvJPEG may decode
  grey without a word: `GpuDecoderBase`'s check, shared with DALI, anything nvJPEG rejects) is
  decoded by the CPU decoder for that image alone, counted in `fallbacks`. A failed batched
  call is retried image by image so one bad file costs only itself.
- GPU memory is bounded: images over `max_image_pixels` never reach the GPU, so the decode
  output of one batch is at most `max_batch x max_image_pixels x 3` bytes, logged at start.
- torchvision does not apply EXIF orientation on CUDA, so `apply_orientation_tensor` does it here
  on the device, from the same table as the CPU decoder (PIL's `ImageOps.exif_transpose`).
- torchvision is imported lazily: it is optional, and absent on CPU-only installs. That it
  imports proves little (a build without nvJPEG imports fine and fails every GPU decode), so
  `nvjpeg_decode_missing` decodes a tiny embedded JPEG on the device before this decoder is
  built or chosen by "auto".
- Each decoded CHW image is freed as soon as its HWC copy is queued, so the decode output of a
  batch takes the bound logged at start (plus one image), not twice that.
"""

from __future__ import annotations

import base64
import contextlib
import functools

import torch
from batchwire.pipeline.decode.contract import DecodeResult
from batchwire.pipeline.decode.fallback import (
    DEFAULT_MAX_GPU_IMAGE_PIXELS,
    GpuBatch,
    GpuDecoderBase,
    parse_device,
)
from batchwire.pipeline.decode.orientation import apply_orientation_tensor


def torchvision_gpu_decode_missing() -> str | None:
    """Why torchvision's CUDA `decode_jpeg` cannot be used here, or None when it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as e:
        return f"torchvision is not installed ({e})"
    return None


#: A 16 x 8 baseline 4:2:0 JPEG of one colour, `PROBE_RGB`: what `probe_decode` decodes.
PROBE_JPEG = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4R"
    "DgsLEBYQERMUFRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU"
    "FBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBT/wAARCAAIABADASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAA"
    "AAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAk"
    "M2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKT"
    "lJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QA"
    "HwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdh"
    "cRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hp"
    "anN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk"
    "5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwCpRRRX4ef0gf/Z"
)
PROBE_SHAPE = (3, 8, 16)  # as decode_jpeg returns it: CHW
PROBE_RGB = (200, 100, 50)
_PROBE_TOLERANCE = 8.0  # grey levels of the mean per channel (IDCT and colour rounding differ)


def probe_decode(device: str | torch.device) -> str | None:
    """Decode `PROBE_JPEG` with torchvision's `decode_jpeg` on ``device``, the batched way the
    decoder calls it: None when the result is right, else why not (any failure counts)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        return f"torchvision is not installed ({e})"
    dev = torch.device(device)
    where = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    try:
        with where:
            encoded = torch.frombuffer(bytearray(PROBE_JPEG), dtype=torch.uint8)
            (image,) = decode_jpeg([encoded], mode=ImageReadMode.RGB, device=dev)
            got = image.cpu()  # waits for the decode
    except Exception as e:  # e.g. torchvision built without nvJPEG: not usable, whatever it is
        return f"decode_jpeg on {dev} failed on a test image: {type(e).__name__}: {e}"[:300]
    if tuple(got.shape) != PROBE_SHAPE:
        return f"decode_jpeg on {dev} decoded a test image as {tuple(got.shape)}, not {PROBE_SHAPE}"
    mean = got.float().mean(dim=(1, 2))
    if (mean - torch.tensor(PROBE_RGB, dtype=torch.float32)).abs().max() > _PROBE_TOLERANCE:
        return (
            f"decode_jpeg on {dev} decoded a test image of colour {PROBE_RGB} as "
            f"{tuple(round(v, 1) for v in mean.tolist())}"
        )
    return None


@functools.cache
def _probe_once(device: str) -> str | None:
    return probe_decode(device)


def nvjpeg_decode_missing(device: str | torch.device = "cuda") -> str | None:
    """Why nvJPEG decoding cannot be used on ``device``, or None when it can: CUDA and
    torchvision present (`torchvision_gpu_decode_missing`) *and* a test image decoded right
    there (`probe_decode`, once per device and process)."""
    missing = torchvision_gpu_decode_missing()
    if missing is not None:
        return missing
    return _probe_once(str(parse_device(device)))


class NvjpegBatchDecoder(GpuDecoderBase):
    """A `BatchDecoder` that decodes JPEGs with nvJPEG on `device`, the rest on the CPU."""

    name = "nvjpeg"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        threads: int | None = None,
        max_batch: int = 256,
        max_image_pixels: int = DEFAULT_MAX_GPU_IMAGE_PIXELS,
    ) -> None:
        self.device = parse_device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the nvjpeg decoder runs on a CUDA device, got {self.device}")
        missing = nvjpeg_decode_missing(self.device)
        if missing is not None:
            raise RuntimeError(f"the nvjpeg decoder needs CUDA and torchvision: {missing}")
        if max_batch < 1 or max_image_pixels < 1:
            raise ValueError("max_batch and max_image_pixels must be >= 1")
        self.max_batch = int(max_batch)
        self.max_image_pixels = int(max_image_pixels)
        self._stream = torch.cuda.Stream(self.device)
        self._start_fallback(threads)
        self._log_output_bound()

    def _decode(self, datas: list[bytes]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        # torchvision allocates the outputs on the current stream (ours) but nvJPEG writes them
        # on a stream of its own that does not wait for ours: a block freed while our earlier
        # work still reads it must not come back here. Our stream carries only this decoder's
        # own short work, so waiting for it costs little.
        self._stream.synchronize()
        # bytearray: torch.frombuffer warns on read-only buffers; the copy is of encoded bytes.
        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        """Decode on the decoder's own stream; the caller's stream waits for the results."""
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._decode_items(items, batch)
        consumer.wait_stream(self._stream)
        for i in items:
            result = batch.results[i]
            if result is not None and result.image is not None:
                result.image.record_stream(consumer)  # freed only once the caller is done

    def _decode_items(self, items: list[int], batch: GpuBatch) -> None:
        requests, results, rejected = batch.requests, batch.results, batch.rejected
        try:
            images: list[torch.Tensor | None] = list(
                self._decode([requests[i].data for i in items])
            )
            if len(images) != len(items):
                raise RuntimeError(f"decoded {len(images)} images for {len(items)} files")
        except (RuntimeError, ValueError) as batch_error:
            if len(items) == 1:
                rejected[items[0]] = f"nvjpeg: {batch_error}"[:200]
                return
            for i in items:  # retry alone, so only the bad images leave the GPU path
                self._decode_items([i], batch)
            return
        for j, i in enumerate(items):
            # Taken out of the list and dropped once its HWC copy is queued: a freed block
            # goes back to the caching allocator on this stream, ordered after that copy, and
            # the next image's HWC copy may reuse it. Holding every CHW output until the loop
            # ends would double the batch's decode memory.
            chw, images[j] = images[j], None
            header = requests[i].header
            hwc = apply_orientation_tensor(chw.permute(1, 2, 0), header.orientation).contiguous()
            del chw
            if tuple(hwc.shape) != (header.height, header.width, 3):
                rejected[i] = f"nvjpeg decoded {tuple(hwc.shape)}, header says {header}"
            else:
                results[i] = DecodeResult(image=hwc, box=requests[i].box)

    def __repr__(self) -> str:
        return f"NvjpegBatchDecoder(device={self.device}, max_batch={self.max_batch})"
