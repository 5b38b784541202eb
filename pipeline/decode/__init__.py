"""Decoding: from an encoded file's bytes to oriented HWC uint8 pixels, on the CPU or a GPU.

Where to look (each module has one job):
- `contract`: the decoder interface every decoder keeps (`DecodeRequest`, `DecodeResult`,
  `BatchDecoder`, `DecodeError`, `DecodedImage`): one bad image never fails a batch.
- `files`: `read_file`, the one place a path becomes bytes (regular files only), and which read
  errors are transient (`is_transient`).
- `headers`: `read_header` (size, EXIF orientation, decoder route) without decoding pixels, and
  the pixel cap (`DEFAULT_MAX_PIXELS`, `ImageTooLarge`), and the refusal of headers that claim
  more pixels than their file can hold (`ImplausibleHeader`).
- `exif`: the Orientation tag read from JPEG/PNG/WebP bytes.
- `orientation`: the one table of what each EXIF orientation does, with its numpy and torch
  appliers.
- `region`: crop geometry: how far the resize filter reaches (`filter_reach`, shared by every
  region-of-interest decoder) and region mapping between stored and displayed images.
- `backends`: TurboJPEG and OpenCV access, their failures turned into errors; strict: any
  libjpeg warning about corrupt data fails the image, and OpenCV never passes a corrupt JPEG.
- `whole`: whole-image decode at a DCT scale (`choose_dct_scale`, `decode_full`).
- `roi`: region-of-interest decode through the native libjpeg-turbo extension (which enters
  `pipeline-prepare`d files at their restart markers by itself).
- `restart`: the same cut for GPU decoders (`narrow_request`: a request for the small JPEG of
  the crop's restart intervals) and `restart_share` (were a split's files prepared?).
- `cpu`: `decode_for_crop` and `CpuBatchDecoder`, the thread-pool decoder.
- GPU decoders: `fallback` (what they share: the CPU safety net), `nvjpeg`, `dali`, and
  `select.make_decoder`, which picks one for `--decoder`/`--device`. They are not imported here:
  import them from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Name -> the submodule defining it. Read lazily (PEP 562): a command line that needs only the
# pixel cap or the crop geometry (pipeline-server and pipeline-prepare parse their arguments with
# them) imports neither torch nor the decoders.
_WHERE = {
    "BatchDecoder": "contract",
    "DecodedImage": "contract",
    "DecodeError": "contract",
    "DecodeRequest": "contract",
    "DecodeResult": "contract",
    "CpuBatchDecoder": "cpu",
    "decode_for_crop": "cpu",
    "NotARegularFile": "files",
    "is_transient": "files",
    "read_file": "files",
    "DEFAULT_MAX_PIXELS": "headers",
    "ImageHeader": "contract",
    "ImageTooLarge": "headers",
    "ImplausibleHeader": "headers",
    "read_header": "headers",
    "Box": "region",
    "Region": "region",
    "displayed_region": "region",
    "stored_region": "region",
    "choose_dct_scale": "whole",
    "decode_full": "whole",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from batchwire.pipeline.decode.contract import (
        BatchDecoder,
        DecodedImage,
        DecodeError,
        DecodeRequest,
        DecodeResult,
        ImageHeader,
    )
    from batchwire.pipeline.decode.cpu import CpuBatchDecoder, decode_for_crop
    from batchwire.pipeline.decode.files import NotARegularFile, is_transient, read_file
    from batchwire.pipeline.decode.headers import (
        DEFAULT_MAX_PIXELS,
        ImageTooLarge,
        ImplausibleHeader,
        read_header,
    )
    from batchwire.pipeline.decode.region import Box, Region, displayed_region, stored_region
    from batchwire.pipeline.decode.whole import choose_dct_scale, decode_full

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "BatchDecoder",
    "Box",
    "CpuBatchDecoder",
    "DecodeError",
    "DecodeRequest",
    "DecodeResult",
    "DecodedImage",
    "ImageHeader",
    "ImageTooLarge",
    "ImplausibleHeader",
    "NotARegularFile",
    "Region",
    "choose_dct_scale",
    "decode_for_crop",
    "decode_full",
    "displayed_region",
    "is_transient",
    "read_file",
    "read_header",
    "stored_region",
]
