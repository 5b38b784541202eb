"""DaliBatchDecoder on DALI's CPU backend (device_id=None): real JPEGs, real odd and bad files.

The CUDA ('mixed') backend runs the same code with a different DALI device; its test skips
without CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (extra batchwire[dali])")

from batchwire.native.reference import augment_batch_reference
from batchwire.pipeline.augment_plan import AugmentConfig, plan_sample
from batchwire.pipeline.decode import CpuBatchDecoder, DecodeRequest, decode_full, read_header
from batchwire.pipeline.decode.dali import DaliBatchDecoder, decode_region
from batchwire.pipeline.decode.restart import narrow_request
from batchwire.pipeline.synthetic import default_dataset
from oddfiles import exif_jpeg, exif_orientation_block, jpeg_bytes, odd_file_bytes, smooth_image

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"


def full_request(index: int, data: bytes) -> DecodeRequest:
    """A request for the whole image at full size (so the CPU decoder does not DCT-scale)."""
    h = read_header(data)
    return DecodeRequest(
        index, data, h, (0.0, 0.0, float(h.height), float(h.width)), (h.height, h.width)
    )


def assert_close_to_cpu(results, requests, tolerance: int = 1) -> None:
    expected = CpuBatchDecoder(1).decode_batch(requests)
    for res, exp, req in zip(results, expected, requests, strict=True):
        assert res.error is None and res.image is not None, (req.index, res.error)
        assert res.image.dtype == torch.uint8 and res.image.shape == exp.image.shape, req.index
        diff = (res.image.int() - exp.image.int()).abs().max().item()
        assert diff <= tolerance, f"image {req.index}: max abs diff {diff}"
        assert res.box == req.box


@pytest.fixture
def dali_sees_bad_files(monkeypatch):
    """Switch off `GpuDecoderBase`'s strict check and its end-of-image check (they refuse
    truncated files before DALI runs) so that DALI itself meets them: these tests pin DALI's
    own failure handling (rebuilds, naming, bisection), the net under what the checks cannot
    see."""
    monkeypatch.setattr("batchwire.pipeline.decode.fallback._strict_verdict", lambda data: None)
    monkeypatch.setattr("batchwire.pipeline.decode.fallback.has_end_of_image", lambda data: True)


def test_a_truncated_file_never_reaches_dali(monkeypatch, caplog):
    """The end-of-image check is the base class's, so DALI has it as nvJPEG does (issue 25,
    defect 5): with the strict check off (as for a request known `intact`), a truncated file
    goes to the CPU decoder with that reason and DALI never runs on it (no failed run, no
    rebuild); the CPU decoder refuses it. On the GPU, DALI's mixed backend may decode such a
    file grey without an error, which is why the check exists; here DALI's CPU backend runs
    the same decoder code."""
    monkeypatch.setattr("batchwire.pipeline.decode.fallback._strict_verdict", lambda data: None)
    dec = DaliBatchDecoder("cpu", threads=1, max_batch=8)
    try:
        good = [full_request(i, odd_file_bytes("rgb", seed=i)) for i in range(3)]
        truncated = full_request(7, odd_file_bytes("truncated", seed=3))
        padded = odd_file_bytes("rgb", seed=5) + b"\0" * 100  # zero padding after EOI: fine
        batch = [good[0], truncated, good[1], full_request(8, padded), good[2]]
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            results = dec.decode_batch(batch)
        assert results[1].image is None and results[1].error
        assert_close_to_cpu(
            [r for i, r in enumerate(results) if i != 1], [q for i, q in enumerate(batch) if i != 1]
        )
        assert dec.rebuilds == 0  # DALI never failed: it never saw the truncated file
        assert dec.fallbacks == 1 and dec.failures == 1
        said = [r.getMessage() for r in caplog.records if "image 7" in r.getMessage()]
        assert len(said) == 1 and "no end-of-image marker" in said[0], said
    finally:
        dec.close()


@pytest.fixture(scope="module")
def decoder():
    dec = DaliBatchDecoder("cpu", threads=2, max_batch=16)
    yield dec
    dec.close()


def test_imagenet_sample_matches_cpu_decoder(decoder):
    if not SAMPLE.is_dir():
        pytest.skip(f"{SAMPLE} is absent (the shared ImageNet sample)")
    files = sorted(SAMPLE.glob("*.JPEG"))[::50]  # 20 files, greyscale ones included by spread
    requests = [full_request(i, f.read_bytes()) for i, f in enumerate(files)]
    results = decoder.decode_batch(requests)  # 20 > max_batch: two DALI runs
    assert_close_to_cpu(results, requests)
    assert decoder.device == torch.device("cpu") and decoder.name == "dali"


def test_embedded_dataset_matches_cpu_decoder(decoder):
    root = default_dataset().train_root
    files = sorted(p for p in root.rglob("*") if p.is_file())[::97][:12]
    assert files, f"no files in {root}"
    requests = [full_request(i, f.read_bytes()) for i, f in enumerate(files)]
    before = decoder.fallbacks
    assert_close_to_cpu(decoder.decode_batch(requests), requests)
    # Progressive and greyscale JPEGs are plain JPEGs to DALI: nothing fell back.
    assert decoder.fallbacks == before


def test_exif_orientation_matches_cpu_decoder(decoder):
    pixels = smooth_image(48, 80, seed=3)
    requests = [full_request(o, exif_jpeg(pixels, o)) for o in range(1, 9)]
    before = decoder.fallbacks
    results = decoder.decode_batch(requests)
    assert_close_to_cpu(results, requests)
    assert results[5].image.shape[:2] == (80, 48)  # orientation 6 turns the image
    assert decoder.fallbacks == before  # DALI oriented them itself


def test_bad_files_fall_back_never_fail_the_batch(dali_sees_bad_files, decoder, caplog):
    good = [full_request(i, odd_file_bytes("rgb", seed=i)) for i in range(6)]
    truncated = full_request(100, odd_file_bytes("truncated"))
    cmyk = full_request(101, odd_file_bytes("cmyk"))  # not a plain JPEG: straight to the CPU
    png = full_request(102, odd_file_bytes("png_as_jpg"))
    batch = [*good[:2], truncated, *good[2:4], cmyk, png, *good[4:]]
    before = (decoder.fallbacks, decoder.failures, decoder.rebuilds)
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        results = decoder.decode_batch(batch)
        decoder.decode_batch([truncated])  # the same bad image again: not logged again
    assert results[2].image is None and "truncated" in results[2].error
    ok = [r for i, r in enumerate(results) if i != 2]
    assert_close_to_cpu(ok, [q for i, q in enumerate(batch) if i != 2])
    assert decoder.fallbacks - before[0] == 4  # truncated twice, CMYK, PNG
    assert decoder.failures - before[1] == 2
    assert decoder.rebuilds > before[2]
    logged = [r.getMessage() for r in caplog.records if "image 100" in r.getMessage()]
    assert len(logged) == 1, logged


def test_bisection_isolates_bad_files_without_dali_naming_them(dali_sees_bad_files):
    dec = DaliBatchDecoder("cpu", threads=1, max_batch=8)
    dec.use_error_hint = False
    try:
        batch = [full_request(i, odd_file_bytes("rgb", seed=i)) for i in range(7)]
        batch.insert(5, full_request(50, odd_file_bytes("truncated", seed=1)))
        batch.insert(1, full_request(51, odd_file_bytes("truncated", seed=2)))
        results = dec.decode_batch(batch)
        bad = [i for i, r in enumerate(results) if r.image is None]
        assert bad == [1, 6]
        assert_close_to_cpu(
            [r for r in results if r.image is not None],
            [q for q, r in zip(batch, results, strict=True) if r.image is not None],
        )
        assert dec.fallbacks == 2 and dec.failures == 2
    finally:
        dec.close()


def crop_requests(files: list[bytes], size: int) -> list[DecodeRequest]:
    config = AugmentConfig(image_size=size, train=True)
    out = []
    for i, data in enumerate(files):
        h = read_header(data)
        box = plan_sample(config, 7, 0, i, h.height, h.width).box
        out.append(DecodeRequest(i, data, h, box, (size, size)))
    return out


def test_crops_decode_a_region_that_augments_like_the_full_image(decoder):
    """The region DALI decodes (crop + filter margin) gives the augment op's exact output."""
    pixels = smooth_image(300, 420, seed=11)
    files = [jpeg_bytes(pixels)] + [exif_jpeg(pixels, o) for o in (3, 6, 8)]
    if SAMPLE.is_dir():
        files += [f.read_bytes() for f in sorted(SAMPLE.glob("*.JPEG"))[3:400:50]]
    requests = crop_requests(files, 32) + crop_requests(files, 160)  # shrink and enlarge
    results = decoder.decode_batch(requests)

    def augment(images, boxes, size):
        n = len(images)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8)
        flips = torch.zeros(n, dtype=torch.bool)
        jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * n)
        mean, std = torch.zeros(3), torch.ones(3)
        boxes = torch.tensor(boxes, dtype=torch.float32)
        return augment_batch_reference(images, boxes, flips, jitter, mean, std, out)

    smaller = 0
    for size, lo in ((32, 0), (160, len(files))):
        reqs, res = requests[lo : lo + len(files)], results[lo : lo + len(files)]
        assert all(r.error is None for r in res)
        for req, r in zip(reqs, res, strict=True):
            region = decode_region(req)
            assert tuple(r.image.shape) == (region[2] - region[0], region[3] - region[1], 3)
            smaller += r.image.shape[0] * r.image.shape[1] < req.header.pixels
        full = [torch.from_numpy(decode_full(q.data)) for q in reqs]
        expected = augment(full, [q.box for q in reqs], size)
        got = augment([r.image for r in res], [r.box for r in res], size)
        assert (got.int() - expected.int()).abs().max().item() <= 1
    assert smaller >= len(requests) // 2  # it really decoded less than the whole image


def test_restart_marker_files_reach_dali_as_the_crops_intervals(decoder):
    """`pipeline-prepare`d files (a restart marker after every MCU) are cut to the crop's
    restart intervals before DALI sees them (`restart.narrow_request`), except oriented ones
    (DALI orients from the EXIF, which the cut leaves out); the augmented crops are the same
    as from the same coefficients without restart markers."""
    import io

    from PIL import Image

    def encode(pixels, **options) -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=90, **options)
        return out.getvalue()

    images = [smooth_image(300 + 16 * k, 420 - 24 * k, seed=k) for k in range(6)]
    plain = [encode(p) for p in images]
    marked = [encode(p, restart_marker_blocks=1) for p in images]
    marked.append(encode(images[0], exif=exif_orientation_block(6), restart_marker_blocks=1))
    plain.append(encode(images[0], exif=exif_orientation_block(6)))
    size = 64
    requests_plain, requests_marked = crop_requests(plain, size), crop_requests(marked, size)
    got_plain = decoder.decode_batch(requests_plain)
    got_marked = decoder.decode_batch(requests_marked)
    assert all(r.error is None for r in got_plain + got_marked)
    cut = [narrow_request(q, upright_only=True) is not q for q in requests_marked]
    assert cut == [True] * len(images) + [False]  # the oriented one goes whole
    moved = [r.box != q.box for r, q in zip(got_marked, requests_marked, strict=True)]
    assert sum(moved) >= 3  # boxes re-expressed in the small JPEGs DALI decoded

    def augment(results):
        n = len(results)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8)
        boxes = torch.tensor([r.box for r in results], dtype=torch.float32)
        jitter = torch.tensor([[1.0, 1.0, 1.0, 0.0]] * n)
        flips = torch.zeros(n, dtype=torch.bool)
        images = [r.image for r in results]
        return augment_batch_reference(
            images, boxes, flips, jitter, torch.zeros(3), torch.ones(3), out
        )

    assert (augment(got_marked).int() - augment(got_plain).int()).abs().max().item() <= 1


def test_without_roi_the_whole_image_is_decoded():
    dec = DaliBatchDecoder("cpu", threads=1, max_batch=8, roi=False)
    try:
        files = [exif_jpeg(smooth_image(90, 120, seed=4), o) for o in (1, 6)]
        requests = crop_requests(files, 32)
        requests.append(full_request(9, odd_file_bytes("truncated")))
        results = dec.decode_batch(requests)
        full = [full_request(i, f) for i, f in enumerate(files)]
        assert results[2].image is None and dec.fallbacks == 1
        assert [r.box for r in results[:2]] == [q.box for q in requests[:2]]
        whole = [type(r)(image=r.image, box=q.box) for r, q in zip(results, full, strict=False)]
        assert_close_to_cpu(whole, full)
    finally:
        dec.close()


def test_a_pipeline_that_cannot_be_rebuilt_sends_everything_to_the_cpu(dali_sees_bad_files, caplog):
    dec = DaliBatchDecoder("cpu", threads=1, max_batch=4)
    try:
        dec.threads = 0  # DALI refuses to build a runnable pipeline without threads
        bad, good = (
            full_request(0, odd_file_bytes("truncated")),
            full_request(1, odd_file_bytes("rgb")),
        )
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            first = dec.decode_batch([bad, good])
            later = dec.decode_batch(
                [full_request(i, odd_file_bytes("rgb", seed=i)) for i in (2, 3)]
            )
        assert first[0].image is None and first[1].image is not None
        assert all(r.image is not None for r in later) and dec.fallbacks == 4
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "could not be rebuilt" in errors[0].getMessage()
        assert not any("image 2" in r.getMessage() for r in caplog.records)  # no per-image flood
    finally:
        dec.close()


def test_results_survive_later_batches_and_rebuilds(dali_sees_bad_files, decoder):
    first = [full_request(i, odd_file_bytes("rgb", seed=10 + i)) for i in range(4)]
    kept = decoder.decode_batch(first)
    snapshot = [r.image.clone() for r in kept]
    decoder.decode_batch([full_request(9, odd_file_bytes("truncated", seed=3))])  # rebuild
    decoder.decode_batch([full_request(i, odd_file_bytes("rgb", seed=20 + i)) for i in range(4)])
    assert all(torch.equal(r.image, s) for r, s in zip(kept, snapshot, strict=True))


def test_empty_batch(decoder):
    assert decoder.decode_batch([]) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (DALI 'mixed')")
@pytest.mark.parametrize("roi", [False, True])
def test_gpu_decode_matches_cpu_decoder(roi):
    dec = DaliBatchDecoder("cuda:0", threads=2, max_batch=8, max_image_pixels=200_000, roi=roi)
    try:
        pixels = smooth_image(64, 96, seed=5)
        batch = [full_request(o, exif_jpeg(pixels, o)) for o in (1, 3, 6, 8)]
        batch.append(full_request(20, odd_file_bytes("truncated")))
        batch.append(full_request(21, odd_file_bytes("rgb", height=600, width=400)))  # > bound
        fell: list[int] = []
        decode = dec._fallback.decode

        def recording(requests, *args, **kwargs):
            fell.extend(r.index for r in requests)
            return decode(requests, *args, **kwargs)

        dec._fallback.decode = recording
        results = dec.decode_batch(batch)
        # Exactly the truncated file (no end-of-image marker) and the one over the GPU bound
        # went to the CPU: the oriented JPEGs were DALI's, whatever the CPU could have done.
        assert sorted(fell) == [20, 21] and dec.fallbacks == 2, fell
        assert results[4].image is None
        good = [r for r in results if r.image is not None]
        assert all(r.image.device.type == "cuda" for r in good)
        moved = [type(r)(image=r.image.cpu(), box=r.box) for r in good]
        # nvJPEG's IDCT differs slightly from libjpeg-turbo's: allow a few grey levels.
        assert_close_to_cpu(moved, [q for i, q in enumerate(batch) if i != 4], tolerance=12)
    finally:
        dec.close()
