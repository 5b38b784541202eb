"""Issue 20, item 1: a JPEG the strict full decode rejects is rejected by every decode path.

The corpus (tests/corrupt_corpus.py) damages one byte of PIL-written files in every layout the
decoders treat differently. The reference is the native strict full decode (`check_jpeg`). For
each file it rejects, in-process:
- the TurboJPEG whole-image path (`decode_for_crop(roi=False)`, full size and DCT-scaled),
- the region path (`decode_for_crop(roi=True)`, every request not known intact, restart-marked
  files included: the rows below the crop are entropy decoded too), for a val (centre) crop and
  train crops,
- intact requests on files without a restart layout (issue 32): read without their tail, the
  same pixels as the verified read; the one rule of `intact` the restart path follows too,
- the restart path (`intact=True` on restart-marked files): on this corpus it rejects the file
  or serves exactly the intact file's pixels: only the crop's intervals are decoded there, by
  design, but its structure is checked whole. A damaged Huffman table can defeat it (wrong
  pixels, `dht_damaged`), which is why only bytes known intact (checksum of a file recorded as
  passing the strict decode) take it,
- DALI's CPU backend, through `GpuDecoderBase`'s strict check, where DALI is installed, and that
  check's rule (whole file, unless intact) with a lenient stand-in decoder.
Header checks (`read_header`) count as the path's rejection: they run first on every path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchwire import native
from batchwire.pipeline.decode import (
    CpuBatchDecoder,
    DecodeError,
    DecodeRequest,
    decode_for_crop,
    read_header,
)
from batchwire.pipeline.decode.backends import arithmetic_frame
from batchwire.pipeline.decode.contract import DecodeResult
from batchwire.pipeline.decode.fallback import GpuBatch, GpuDecoderBase
from batchwire.pipeline.decode.restart import narrow_request
from corrupt_corpus import corpus, seed_jpeg, strict_rejects
from decodepaths import OUT, crops, served
from dht_damage import CORNER, dht_damaged
from tail_damage import tail_damaged

if not native.jpeg_roi_available():
    pytest.skip("the native strict decoder does not build here", allow_module_level=True)


@pytest.fixture(scope="module")
def files():
    return corpus()


@pytest.fixture(scope="module")
def rejected(files):
    return [f for f in files if strict_rejects(f.data) is not None]


def test_the_corpus_is_big_enough_and_holds_the_known_holes(files, rejected):
    assert len(files) >= 300 and len(rejected) >= 150
    layouts = {f.layout for f in rejected}
    assert layouts == {"base420", "base422", "base444", "grey", "prog420", "rst420", "rst422"}
    assert any(arithmetic_frame(f.data) for f in rejected)  # SOF0 -> SOF9 is refused


@pytest.mark.parametrize("out_hw", [OUT, (6, 6)])  # (6, 6): DCT-scaled decodes
def test_whole_image_path_rejects_every_file_the_strict_decode_rejects(rejected, out_hw):
    accepted = [
        f.name for f in rejected for box in crops(48, 64)[:2] if served(f.data, box, False, out_hw)
    ]
    assert accepted == []


def test_region_path_rejects_every_rejected_file_for_every_crop(rejected):
    """Requests not known intact (every layout, restart-marked ones included): rejected for
    every crop."""
    accepted = []
    for f in rejected:
        header = read_header(f.intact)
        for box in crops(header.height, header.width):
            if served(f.data, box, True) is not None:
                accepted.append((f.name, box))
    assert accepted == []


def test_restart_path_never_serves_this_corpus_wrong_pixels(rejected):
    """Restart path (intact requests): rejected, or exactly the intact file's pixels (the damage
    lies in intervals the crop does not read)."""
    wrong = []
    for f in (f for f in rejected if f.layout.startswith("rst")):
        header = read_header(f.intact)
        for box in crops(header.height, header.width):
            got = served(f.data, box, True, intact=True)
            if got is None:
                continue
            assert got.route == "restart"
            want = decode_for_crop(f.intact, header, box, OUT, roi=True, intact=True)
            if got.box != want.box or not np.array_equal(got.pixels, want.pixels):
                wrong.append((f.name, box))
    assert wrong == []


def test_restart_path_rejects_structural_damage_and_damage_it_reads(rejected):
    """Every rejected restart-marked file fails the whole-image crop (all intervals read) and,
    when its damage breaks the scan's structure, every crop."""
    for f in (f for f in rejected if f.layout.startswith("rst")):
        header = read_header(f.intact)
        whole = (0.0, 0.0, header.height, header.width)
        assert served(f.data, whole, True, intact=True) is None, f.name
        if native.jpeg_roi.restart_layout(f.data)[0] is None and "restart" in (
            strict_rejects(f.data) or ""
        ):
            for box in crops(header.height, header.width):
                assert served(f.data, box, True, intact=True) is None, (f.name, box)


def test_region_decoder_refuses_arithmetic_frames_for_a_crop_covering_everything(files):
    arith = [f for f in files if "sofc0->c9" in f.name]
    assert arith
    for f in arith:
        with pytest.raises(native.JpegRoiError, match="arithmetic"):
            native.decode_jpeg_roi(f.data, 0, 0, 10_000, 10_000, 1, restarts=False)


def test_turbojpeg_judges_files_whose_first_warning_was_benign(files):
    """A DQT/DHT length one too long: libjpeg's first warning is "extraneous bytes before
    marker 0xc4/0xdb" (benign), and the damage after it is what the strict check reports."""
    longer = [f for f in files if "-length+1" in f.name and strict_rejects(f.data)]
    assert longer
    for f in longer:
        assert served(f.data, (0.0, 0.0, 48.0, 64.0), False) is None, f.name


def test_intact_seeds_decode_on_every_path(files):
    for intact in {f.intact for f in files}:
        assert strict_rejects(intact) is None
        header = read_header(intact)
        for box in crops(header.height, header.width):
            for roi in (False, True):
                assert served(intact, box, roi) is not None


def test_intact_requests_skip_the_tail_and_serve_the_same_pixels(files):
    """Issue 32: bytes known intact passed the strict full decode, so the region path does not
    verify their tail again (the rule the restart path follows). For every seed without a
    restart layout and every crop: the same pixels and box as the tail-verified read."""
    seeds = {f.intact for f in files if native.jpeg_roi.restart_layout(f.intact)[0] is None}
    assert len(seeds) >= 10
    for data in seeds:
        header = read_header(data)
        for box in crops(header.height, header.width):
            verified = decode_for_crop(data, header, box, OUT)
            trusted = decode_for_crop(data, header, box, OUT, intact=True)
            assert (verified.route, trusted.route) == ("region", "restart")
            assert trusted.box == verified.box
            np.testing.assert_array_equal(trusted.pixels, verified.pixels)


def test_damage_below_the_crop_is_refused_unless_intact():
    """What the skip gives up, pinned: damage below the crop is read only by the tail check,
    so a request not known intact is refused, and one called intact (which only bytes matching
    a checksum recorded for a file that passed the strict decode are) serves the crop, whose
    pixels are the undamaged file's."""
    good = seed_jpeg("base420", 160, 64, seed=3)
    bad = tail_damaged(good)
    assert strict_rejects(bad) is not None
    header = read_header(bad)
    top = (0.0, 0.0, 48.0, 64.0)
    with pytest.raises(DecodeError, match="JPEG"):
        decode_for_crop(bad, header, top, OUT)
    served_ = decode_for_crop(bad, header, top, OUT, intact=True)
    want = decode_for_crop(good, header, top, OUT)
    np.testing.assert_array_equal(served_.pixels, want.pixels)
    with CpuBatchDecoder(threads=1) as decoder:
        refused, trusted = decoder.decode_batch(
            [DecodeRequest(0, bad, header, top, OUT), DecodeRequest(1, bad, header, top, OUT, True)]
        )
    assert refused.image is None and "JPEG" in (refused.error or "")
    assert trusted.image is not None


def dali_requests(rejected) -> list[DecodeRequest]:
    requests = []
    for i, f in enumerate(rejected):
        try:
            header = read_header(f.data)
        except (DecodeError, ValueError):
            continue  # refused before any decoder sees it
        box = (0.0, 0.0, float(header.height), float(header.width))
        requests.append(DecodeRequest(i, f.data, header, box, OUT))
    return requests


def test_dali_cpu_backend_rejects_what_the_strict_decode_rejects(rejected):
    """DALI alone must never see these files: on this corpus its CPU backend decodes some
    without an error and crashes the process (SIGSEGV, DALI 1.x) on others. Through
    `decode_batch`, the strict check shared by every GPU-side decoder (`GpuDecoderBase`)
    refuses each one before DALI runs, and the CPU fallback reports it as a failure."""
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed")
    from batchwire.pipeline.decode.dali import DaliBatchDecoder

    requests = dali_requests(rejected)
    decoder = DaliBatchDecoder("cpu", threads=2, max_batch=64)
    try:
        results = decoder.decode_batch(requests)
        assert decoder.failures == len(requests)
    finally:
        decoder.close()
    served_anyway = [
        r.index for r, res in zip(requests, results, strict=True) if res.image is not None
    ]
    assert served_anyway == []


def requests(damaged: bytes, intact: bytes, header, box) -> list[DecodeRequest]:
    """Index 0 the damaged file, 1 the intact one, neither known intact."""
    return [DecodeRequest(0, damaged, header, box, OUT), DecodeRequest(1, intact, header, box, OUT)]


def test_dht_damage_that_the_restart_path_cannot_see_is_refused_unless_intact():
    """The restart path decodes only the crop's intervals: with a damaged table they can decode,
    to wrong pixels, where the full strict decode fails. So it is taken for `intact` requests
    only (bytes known to pass the strict decode); any other restart-marked file takes the region
    path, tail verified, which rejects what the strict decode rejects."""
    intact, damaged = dht_damaged()
    box = CORNER
    header = read_header(damaged)
    assert strict_rejects(damaged) is not None
    hole = decode_for_crop(damaged, header, box, OUT, intact=True)  # what `intact` must rule out
    assert hole.route == "restart"
    with pytest.raises(DecodeError):
        decode_for_crop(damaged, header, box, OUT)  # not intact: the region path
    good = decode_for_crop(intact, read_header(intact), box, OUT)
    assert good.route == "region"
    assert np.array_equal(
        good.pixels, decode_for_crop(intact, header, box, OUT, intact=True).pixels
    )
    with CpuBatchDecoder(threads=1) as decoder:
        refused, served_ = decoder.decode_batch(
            [
                DecodeRequest(0, damaged, header, box, OUT),
                DecodeRequest(1, intact, header, box, OUT),
            ]
        )
    assert refused.image is None and refused.error
    assert served_.image is not None and served_.route == "region"


class LenientGpu(GpuDecoderBase):
    """A stand-in for a GPU library behind `GpuDecoderBase`: it decodes whatever bytes it is
    handed without any strictness of its own (as nvJPEG and DALI do with much damage: here,
    the restart path on the bytes given) and keeps the requests it saw."""

    name = "lenient"
    device = torch.device("cpu")
    max_batch = 8
    max_image_pixels = None

    def __init__(self) -> None:
        self._start_fallback(1)
        self.seen: list[DecodeRequest] = []

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        for i in items:
            req = batch.requests[i]
            self.seen.append(req)
            got = decode_for_crop(req.data, req.header, req.box, req.out_hw, intact=True)
            batch.results[i] = DecodeResult(torch.from_numpy(got.pixels), got.box)


def test_gpu_decoders_strictly_check_the_whole_file_unless_intact():
    """Not intact: the whole file is strictly checked before it is cut to its crop's intervals
    (a damaged table passes a check of the cut file), and a refused one goes to the CPU decoder
    as it was, which refuses it. Intact: no CPU check at all (the GPU decoder sees even bytes
    falsely called intact: the flag is the only thing that skips the check)."""
    intact, damaged = dht_damaged()
    box = CORNER
    header = read_header(damaged)
    cut = narrow_request(DecodeRequest(0, damaged, header, box, OUT))
    assert len(cut.data) < len(damaged) and strict_rejects(cut.data) is None  # the old hole
    decoder = LenientGpu()
    try:
        bad, good = decoder.decode_batch(
            [
                DecodeRequest(0, damaged, header, box, OUT),
                DecodeRequest(1, intact, header, box, OUT),
            ]
        )
        assert bad.image is None and decoder.failures == 1
        assert good.image is not None
        (seen,) = decoder.seen  # the damaged file never reached the GPU decoder
        assert seen.index == 1 and seen.intact and len(seen.data) < len(intact)  # cut down
        decoder.seen.clear()
        (lied,) = decoder.decode_batch([DecodeRequest(0, damaged, header, box, OUT, intact=True)])
        assert lied.image is not None and [r.index for r in decoder.seen] == [0]
    finally:
        decoder.close()
