"""NvjpegBatchDecoder: the EXIF orientation it applies on the device (checked here on CPU
tensors against the CPU decoder's convention), its clear errors without CUDA/torchvision, and
CUDA-only decode tests that skip without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchwire.bench.gpu_check import mean_diff_to_closer_reference, replicated_chroma_reference
from batchwire.pipeline.decode import CpuBatchDecoder, DecodeRequest, read_header
from batchwire.pipeline.decode.nvjpeg import (
    PROBE_JPEG,
    PROBE_RGB,
    PROBE_SHAPE,
    NvjpegBatchDecoder,
    nvjpeg_decode_missing,
    probe_decode,
    torchvision_gpu_decode_missing,
)
from batchwire.pipeline.decode.orientation import apply_orientation_tensor as orient
from oddfiles import exif_jpeg, odd_file_bytes, smooth_image
from PIL import Image, ImageOps

MISSING = torchvision_gpu_decode_missing()


def full_request(index: int, data: bytes) -> DecodeRequest:
    h = read_header(data)
    return DecodeRequest(
        index, data, h, (0.0, 0.0, float(h.height), float(h.width)), (h.height, h.width)
    )


@pytest.mark.parametrize("orientation", range(0, 10))
def test_orient_matches_pil_exif_transpose(orientation):
    pixels = smooth_image(5, 7, seed=orientation)
    image = Image.fromarray(pixels)
    if 1 <= orientation <= 8:
        image.getexif()[0x0112] = orientation  # the EXIF Orientation tag
        expected = np.asarray(ImageOps.exif_transpose(image))
    else:  # outside the EXIF range: left as it is
        expected = pixels
    got = orient(torch.from_numpy(pixels), orientation)
    assert torch.equal(got.contiguous(), torch.from_numpy(np.array(expected)))


def test_needs_a_cuda_device_argument():
    with pytest.raises(ValueError, match="CUDA device"):
        NvjpegBatchDecoder("cpu")


@pytest.mark.skipif(MISSING is None, reason="CUDA and torchvision are both present")
def test_says_what_is_missing():
    with pytest.raises(RuntimeError, match="needs CUDA and torchvision") as info:
        NvjpegBatchDecoder("cuda:0")
    assert MISSING in str(info.value)


def test_probe_image_is_a_tiny_baseline_jpeg_of_its_colour():
    header = read_header(PROBE_JPEG)
    assert header.kind == "jpeg" and (header.height, header.width) == PROBE_SHAPE[1:]
    assert b"\xff\xc0" in PROBE_JPEG and b"\xff\xc2" not in PROBE_JPEG  # baseline, not progressive
    (res,) = CpuBatchDecoder(1).decode_batch([full_request(0, PROBE_JPEG)])
    assert res.image is not None and tuple(res.image.shape) == (*PROBE_SHAPE[1:], 3)
    mean = res.image.float().mean(dim=(0, 1))
    assert (mean - torch.tensor(PROBE_RGB, dtype=torch.float32)).abs().max() < 3


@pytest.mark.skipif(MISSING is None, reason="CUDA and torchvision are both present")
def test_probe_says_why_gpu_decode_is_unusable():
    """Without CUDA (or torchvision) the probe reports a reason rather than raising."""
    assert nvjpeg_decode_missing("cuda:0") == MISSING
    reason = probe_decode("cuda:0")
    assert isinstance(reason, str) and reason


def gpu_decode_missing() -> str | None:
    return MISSING if MISSING is not None else nvjpeg_decode_missing("cuda:0")


def record_fallbacks(dec) -> list[int]:
    """The dataset indices `dec` hands to its CPU safety net, in order: a GPU test asserts
    exactly which images fell back, so the CPU decoder cannot make it pass in nvJPEG's place
    (its images are moved to the GPU and compare equal)."""
    fell: list[int] = []
    decode = dec._fallback.decode

    def recording(requests, *args, **kwargs):
        fell.extend(r.index for r in requests)
        return decode(requests, *args, **kwargs)

    dec._fallback.decode = recording
    return fell


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_decides_whether_the_decoder_can_be_built():
    """A torchvision that imports but cannot decode on the GPU (built without nvJPEG) is
    refused at construction with the probe's reason, not discovered image by image."""
    missing = gpu_decode_missing()
    if missing is None:
        assert probe_decode("cuda:0") is None
        NvjpegBatchDecoder("cuda:0", threads=1).close()
    else:
        with pytest.raises(RuntimeError, match="needs CUDA and torchvision") as info:
            NvjpegBatchDecoder("cuda:0", threads=1)
        assert missing in str(info.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_frees_each_chw_output_once_copied():
    """The peak GPU memory of a batch's decode is its HWC outputs plus about one image, not
    the CHW outputs and the HWC copies together (twice the bound the start-up log states)."""
    if (missing := gpu_decode_missing()) is not None:
        pytest.skip(f"nvJPEG decode unavailable: {missing}")
    dec = NvjpegBatchDecoder("cuda:0", threads=1, max_batch=8)
    batch = [full_request(i, odd_file_bytes("rgb", height=600, width=800)) for i in range(8)]
    dec.decode_batch(batch[:1])  # warm up nvJPEG and the stream
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    results = dec.decode_batch(batch)
    torch.cuda.synchronize()
    outputs = sum(r.image.numel() for r in results)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1.5 * outputs, (peak, outputs)
    dec.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_matches_cpu_with_fallbacks():
    if (missing := gpu_decode_missing()) is not None:
        pytest.skip(f"nvJPEG decode unavailable: {missing}")
    dec = NvjpegBatchDecoder("cuda:0", threads=2, max_batch=4, max_image_pixels=200_000)
    pixels = smooth_image(64, 96, seed=5)
    batch = [full_request(o, exif_jpeg(pixels, o)) for o in (1, 2, 3, 5, 6, 7, 8)]
    batch.append(full_request(20, odd_file_bytes("truncated")))
    batch.append(full_request(21, odd_file_bytes("cmyk")))
    batch.append(full_request(22, odd_file_bytes("rgb", height=600, width=400)))  # over the bound
    batch.append(full_request(23, odd_file_bytes("grey")))
    batch.append(full_request(24, odd_file_bytes("progressive")))
    fell = record_fallbacks(dec)
    results = dec.decode_batch(batch)
    expected = CpuBatchDecoder(1).decode_batch(batch)
    assert results[7].image is None and results[7].error
    # The EXIF-oriented and grey JPEGs decode on nvJPEG; progressive ones nvJPEG may refuse.
    assert {20, 21, 22} <= set(fell) <= {20, 21, 22, 24}, fell
    for res, exp, req in zip(results, expected, batch, strict=True):
        if exp.image is None:
            continue
        assert res.image is not None and res.image.device.type == "cuda", req.index
        # nvJPEG replicates chroma samples where libjpeg-turbo smooths them by default (2.44 grey
        # levels apart on average on this picture, on an H200): measured against the closer of
        # libjpeg-turbo's two upsamplings, only the IDCTs differ, by under a level. An
        # orientation or colour mistake would move the mean by tens.
        mean, most = mean_diff_to_closer_reference(
            res.image, exp.image, replicated_chroma_reference(req.data)
        )
        assert mean < 1.0 and most <= 96, (req.index, mean, most)
    assert dec.fallbacks == len(fell)  # truncated, CMYK, oversize (progressive, if refused)
    assert dec.failures == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decodes_prepared_files_through_the_crops_restart_intervals():
    """A file with a restart marker after every MCU (what pipeline-prepare writes) reaches
    nvJPEG as the small JPEG of its crop's intervals, and decodes like the CPU's decode of that
    small JPEG (equal to the whole file's pixels over the crop's reach: test_jpeg_restart), for
    every EXIF orientation (nvJPEG does not orient: the decoder does, from the header the cut
    keeps)."""
    import io

    from batchwire.pipeline.decode.restart import narrow_request
    from batchwire.pipeline.decode.whole import decode_pixels
    from oddfiles import exif_orientation_block

    if (missing := gpu_decode_missing()) is not None:
        pytest.skip(f"nvJPEG decode unavailable: {missing}")
    pixels = smooth_image(320, 480, seed=9)
    batch = []
    for o in range(1, 9):
        out = io.BytesIO()
        exif = exif_orientation_block(o)
        Image.fromarray(pixels).save(out, "JPEG", quality=90, exif=exif, restart_marker_blocks=1)
        data = out.getvalue()
        h = read_header(data)
        box = (h.height * 0.3, h.width * 0.4, h.height * 0.8, h.width * 0.9)
        batch.append(DecodeRequest(o, data, h, box, (64, 64)))
    assert all(narrow_request(r) is not r for r in batch)
    dec = NvjpegBatchDecoder("cuda:0", threads=1, max_batch=8)
    fell = record_fallbacks(dec)
    results = dec.decode_batch(batch)
    # nvJPEG decoded every small JPEG itself: a refusal would be decoded by the CPU, moved to
    # the GPU and pass the comparison below, so this is the line that can fail.
    assert fell == [] and dec.fallbacks == 0, fell
    for res, req in zip(results, batch, strict=True):
        cut = narrow_request(req)
        assert res.error is None and res.image is not None and res.image.device.type == "cuda"
        assert res.box == cut.box, req.index  # in the small JPEG's coordinates
        expected = torch.from_numpy(decode_pixels(cut.data, cut.header, (1, 1)))  # oriented
        assert res.image.shape == expected.shape and expected.numel() < 3 * req.header.pixels
        diff = (res.image.cpu().int() - expected.int()).abs().float()
        assert diff.mean().item() < 2.0 and diff.max().item() <= 96, req.index
    dec.close()
