"""`decode_for_crop` and `CpuBatchDecoder`: which route and DCT scale a crop gets, that the box
comes back on the same content whichever route decoded it (pixels checked against PIL), and the
batch decoder's contract: results in request order, a bad image an error result (never an
exception, never pixels), its threads and their lifetime."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from batchwire.common.cores import available_cores
from batchwire.pipeline.decode import DecodeError, DecodeRequest, read_header
from batchwire.pipeline.decode.contract import ROUTE_REGION, ROUTE_RESTART, ROUTE_WHOLE, ImageHeader
from batchwire.pipeline.decode.cpu import CpuBatchDecoder, chunked, decode_for_crop
from batchwire.pipeline.synthetic import SyntheticSpec, render_jpeg
from jpegchecks import pil_rgb, sample_photos
from oddfiles import exif_orientation_block, jpeg_bytes, odd_file_bytes, smooth_image

SAMPLES = ("n01443537_goldfish.JPEG", "n01530575_brambling.JPEG", "n02951585_can_opener.JPEG")


def samples() -> list[bytes]:
    return sample_photos(SAMPLES)


def inside(box, shape, margin: int = 2) -> tuple[slice, slice]:
    """The pixels of `box` (in a decoded image of `shape`) shrunk by `margin`: what any route
    must agree on (a region's own edge, outside the filter's reach, is excluded)."""
    y0, x0, y1, x1 = box
    assert y0 >= -1e-6 and x0 >= -1e-6 and y1 <= shape[0] + 1e-6 and x1 <= shape[1] + 1e-6
    return (
        slice(int(np.ceil(y0)) + margin, int(y1) - margin),
        slice(int(np.ceil(x0)) + margin, int(x1) - margin),
    )


def crop_of(decoded, reference: np.ndarray, scaled_box) -> None:
    """`decoded`'s box holds the same pixels as `scaled_box` of the reference image."""
    ys, xs = inside(decoded.box, decoded.pixels.shape)
    oy = round(scaled_box[0] - decoded.box[0])
    ox = round(scaled_box[1] - decoded.box[1])
    np.testing.assert_allclose(np.add(decoded.box, (oy, ox, oy, ox)), scaled_box, rtol=0, atol=1e-6)
    want = reference[ys.start + oy : ys.stop + oy, xs.start + ox : xs.stop + ox]
    np.testing.assert_array_equal(decoded.pixels[ys, xs], want)


@pytest.mark.parametrize("denom", [1, 2, 4])
def test_both_routes_cut_the_box_from_pils_pixels_at_the_chosen_scale(denom: int) -> None:
    """A train-like crop of real photos: the region route (default) and the whole-image route
    decode at the smallest DCT scale covering the output, and both boxes hold PIL's pixels."""
    for data in samples():
        header = read_header(data)
        h, w = header.height, header.width
        box = (h * 0.1 + 0.3, w * 0.2 + 0.7, h * 0.9, w * 0.75)
        out_hw = (int((box[2] - box[0]) / denom), int((box[3] - box[1]) / denom))
        reference = pil_rgb(data, reduce=denom)
        fh, fw = reference.shape[:2]
        assert (fh, fw) == (-(-h // denom), -(-w // denom))
        scaled = (box[0] * fh / h, box[1] * fw / w, box[2] * fh / h, box[3] * fw / w)
        region = decode_for_crop(data, header, box, out_hw)
        whole = decode_for_crop(data, header, box, out_hw, roi=False)
        assert region.route == ROUTE_REGION and whole.route == ROUTE_WHOLE
        assert whole.pixels.shape == reference.shape
        assert region.pixels.shape[0] < fh or region.pixels.shape[1] < fw  # only a region
        crop_of(region, reference, scaled)
        crop_of(whole, reference, scaled)
        np.testing.assert_array_equal(whole.pixels, reference)


def test_whole_route_box_follows_turbojpegs_rounded_up_sizes() -> None:
    """101 x 147 at 1/8 decodes to 13 x 19 (sizes round up): the box is mapped by the actual
    ratio, so the full extent maps onto the full decoded extent."""
    data = jpeg_bytes(smooth_image(101, 147, seed=2))
    header = read_header(data)
    full = (0.0, 0.0, 101.0, 147.0)
    got = decode_for_crop(data, header, full, (12, 18), roi=False)
    assert got.pixels.shape == (13, 19, 3) == pil_rgb(data, reduce=8).shape
    assert got.box == pytest.approx((0.0, 0.0, 13.0, 19.0))
    np.testing.assert_array_equal(got.pixels, pil_rgb(data, reduce=8))


@pytest.mark.parametrize("orientation", [3, 6, 7])
def test_exif_orientation_on_both_routes(orientation: int) -> None:
    data = jpeg_bytes(
        smooth_image(120, 168, seed=orientation), exif=exif_orientation_block(orientation)
    )
    header = read_header(data)
    reference = pil_rgb(data, reduce=2)
    h, w = header.height, header.width
    fh, fw = reference.shape[:2]
    box = (h * 0.25, w * 0.1, h * 0.85, w * 0.6)
    scaled = (box[0] * fh / h, box[1] * fw / w, box[2] * fh / h, box[3] * fw / w)
    out = (int((box[2] - box[0]) / 2), int((box[3] - box[1]) / 2))  # selects 1/2
    for roi in (True, False):
        got = decode_for_crop(data, header, box, out, roi=roi)
        crop_of(got, reference, scaled)


def test_embedded_dataset_image_at_full_size() -> None:
    data = render_jpeg(SyntheticSpec(), "train", 3, 7)
    header = read_header(data)
    box = (3.5, 5.25, header.height - 9.0, header.width - 2.0)
    got = decode_for_crop(data, header, box, (header.height, header.width))
    assert got.route == ROUTE_REGION
    crop_of(got, pil_rgb(data), box)


def test_intact_bytes_take_the_restart_route_to_the_same_pixels() -> None:
    data = samples()[0]
    header = read_header(data)
    box = (20.0, 30.0, 200.0, 250.0)
    trusted = decode_for_crop(data, header, box, (64, 64), intact=True)
    verified = decode_for_crop(data, header, box, (64, 64))
    assert (trusted.route, verified.route) == (ROUTE_RESTART, ROUTE_REGION)
    np.testing.assert_array_equal(trusted.pixels, verified.pixels)


def test_without_the_region_decoder_the_whole_image_serves(monkeypatch) -> None:
    """Switched off (BATCHWIRE_JPEG_ROI=0): whole, at the DCT scale. CMYK JPEGs and files that
    are not JPEGs (OpenCV's): whole, at full size (OpenCV has no DCT scaling)."""
    monkeypatch.setenv("BATCHWIRE_JPEG_ROI", "0")
    data = samples()[1]
    header = read_header(data)
    box = (0.0, 0.0, float(header.height), float(header.width))
    got = decode_for_crop(data, header, box, (header.height // 4, header.width // 4))
    assert got.route == ROUTE_WHOLE
    np.testing.assert_array_equal(got.pixels, pil_rgb(data, reduce=4))
    monkeypatch.delenv("BATCHWIRE_JPEG_ROI")
    for kind in ("cmyk", "png_as_jpg"):
        data = odd_file_bytes(kind, height=96, width=128)
        header = read_header(data)
        got = decode_for_crop(data, header, (8.0, 8.0, 88.0, 120.0), (20, 28))
        assert got.route == ROUTE_WHOLE and got.box == pytest.approx((8.0, 8.0, 88.0, 120.0))
        assert header.kind == "other" and got.pixels.shape == (96, 128, 3)


def test_damaged_bytes_raise_decode_error_on_both_routes() -> None:
    good = samples()[0]
    header = read_header(good)
    box = (0.0, 0.0, 50.0, 50.0)
    for bad in (good[: len(good) // 2], good[: len(good) // 2] + b"\xff\xd9", b"", b"GIF89a" * 50):
        for roi in (True, False):
            with pytest.raises(DecodeError):
                decode_for_crop(bad, header, box, (16, 16), roi=roi)


# ---- the batch decoder ------------------------------------------------------------------------


def _requests(datas: list[bytes], good: bytes) -> list[DecodeRequest]:
    """One request per file; a file whose header cannot be read gets `good`'s header, as if it
    had passed an earlier check, so that the decoder itself has to notice."""
    out = []
    for i, data in enumerate(datas):
        try:
            header = read_header(data)
        except DecodeError:
            header = read_header(good)
        box = (header.height * 0.2, header.width * 0.1, header.height * 0.9, header.width * 0.8)
        out.append(DecodeRequest(i, data, header, box, (48, 48), intact=i == 1))
    return out


def test_a_batch_of_good_and_bad_images_comes_back_in_order_bad_ones_as_errors() -> None:
    good = samples()
    datas = [
        good[0],
        good[1],
        good[0][: len(good[0]) // 3],  # truncated
        b"",  # empty
        b"not a JPEG at all\n" * 30,
        good[2],
        odd_file_bytes("middle_zeroed", height=120, width=160),  # corrupt, EOI kept
        odd_file_bytes("claims_9000"),  # 81 Mpx declared by 2 kB (header read as declared)
        odd_file_bytes("png_as_jpg", height=50, width=70),
        odd_file_bytes("png_as_jpg", height=50, width=70)[:-200],  # a damaged PNG
    ]
    requests = _requests(datas, good[0])
    requests[7] = DecodeRequest(
        7, datas[7], ImageHeader(9000, 9000, 1, "jpeg"), requests[7].box, (48, 48)
    )
    with CpuBatchDecoder(threads=3) as decoder:
        results = decoder.decode_batch(requests)
    assert len(results) == len(requests)
    for req, res in zip(requests, results, strict=True):
        if req.index in (2, 3, 4, 6, 7, 9):
            assert res.image is None and res.box == req.box and not res.transient, req.index
            assert res.error and res.route == "", req.index
            continue
        assert res.error is None, (req.index, res.error)
        want = decode_for_crop(req.data, req.header, req.box, req.out_hw, intact=req.intact)
        assert isinstance(res.image, torch.Tensor) and res.image.dtype == torch.uint8
        np.testing.assert_array_equal(res.image.numpy(), want.pixels)
        assert res.box == want.box and res.route == want.route
    assert results[2].error.startswith("truncated JPEG")
    assert results[6].error.startswith("corrupt JPEG")
    assert [r.route for r in results[:2]] == [ROUTE_REGION, ROUTE_RESTART]
    assert results[8].route == ROUTE_WHOLE


def test_one_or_many_threads_give_bit_identical_results() -> None:
    requests = _requests(samples() * 3, samples()[0])
    with CpuBatchDecoder(threads=1) as one, CpuBatchDecoder(threads=4) as four:
        a, b = one.decode_batch(requests), four.decode_batch(requests)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.image, y.image) and x.box == y.box and x.route == y.route


def test_chunks_cover_the_items_in_order_about_four_per_thread() -> None:
    items = list(range(103))
    for threads in (0, 1, 2, 3, 16):
        parts = chunked(items, threads)
        assert [i for part in parts for i in part] == items
        assert len({len(p) for p in parts[:-1]}) <= 1 and 0 < len(parts[-1]) <= len(parts[0])
    assert len(chunked(items, 2)) == 8  # 103 / (2 * 4) -> chunks of 13
    assert len(chunked(items, 16)) == 52  # chunks of 2: never fewer than one item
    assert chunked([], 4) == [] and chunked([7], 4) == [[7]]


def test_map_runs_on_the_decode_threads_and_inline_when_it_cannot_help() -> None:
    def where(_: int) -> str:
        return threading.current_thread().name

    with CpuBatchDecoder(threads=2) as decoder:
        assert decoder.map(where, [0]) == [threading.current_thread().name]  # one item: inline
        names = decoder.map(where, list(range(40)))
        assert decoder.map(lambda v: -v, list(range(41))) == [-v for v in range(41)]
        assert decoder.map(where, []) == []
    assert len(names) == 40 and all(n.startswith("bw-decode") for n in names)
    with CpuBatchDecoder(threads=1) as single:
        assert single.pool is None
        assert set(single.map(where, list(range(10)))) == {threading.current_thread().name}


def test_threads_pool_and_close() -> None:
    decoder = CpuBatchDecoder()
    assert decoder.threads == available_cores() and decoder.name == "cpu"
    decoder.close()
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # this thread may use one CPU: one decode thread
    try:
        decoder = CpuBatchDecoder()
    finally:
        os.sched_setaffinity(0, cpus)
    assert decoder.threads == 1 and decoder.pool is None
    assert decoder.device == torch.device("cpu")
    decoder.close()
    assert decoder.pool is None
    decoder.close()  # twice is harmless
    assert CpuBatchDecoder(threads=0).threads == 1
    with CpuBatchDecoder(threads=3) as decoder:
        assert repr(decoder) == "CpuBatchDecoder(threads=3)"
        pool = decoder.pool
        assert pool is not None
    assert decoder.pool is None
    with pytest.raises(RuntimeError):  # the context's exit shut the pool down
        pool.submit(int)
