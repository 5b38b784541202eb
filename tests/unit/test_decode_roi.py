"""`decode_roi`: the native region decoder as the CPU decoder calls it. Its pixels are the
reference decoder's (PIL, libjpeg) over everything the crop's resize reads, for real photos, the
embedded dataset, every EXIF orientation and every DCT scale; the region it returns covers the
filter's reach and its box lands on the same content; it steps aside (None) where it cannot
help; and it refuses damaged bytes (DecodeError) as the strict full decode does."""

from __future__ import annotations

import io
import subprocess

import numpy as np
import pytest
from batchwire.pipeline.decode import DecodeError, read_header
from batchwire.pipeline.decode.contract import ROUTE_REGION, ROUTE_RESTART, ImageHeader
from batchwire.pipeline.decode.region import reach_region
from batchwire.pipeline.decode.roi import decode_roi
from batchwire.pipeline.synthetic import SyntheticSpec, render_jpeg
from jpegchecks import HAS_DJPEG, djpeg_pixels, pil_rgb, sample_photos
from oddfiles import (
    corrupt_jpeg,
    exif_orientation_block,
    jpeg_bytes,
    noise_image,
    odd_file_bytes,
    pil_restart_jpeg,
    smooth_image,
)
from PIL import Image

# A grey-and-colour handful: 4:2:0 photos of several sizes, the sample's one EXIF-rotated file.
SAMPLES = ("n01440764_tench.JPEG", "n01443537_goldfish.JPEG", "n02951585_can_opener.JPEG")


def samples() -> list[bytes]:
    return sample_photos(SAMPLES)


def reference(data: bytes, denom: int = 1) -> np.ndarray:
    """`pil_rgb` at 1/denom, checked to be the scale asked (PIL's `draft` may choose another)."""
    if denom > 1:
        assert -(-read_stored_width(data) // denom) == _drafted_width(data, denom), "PIL scale"
    return pil_rgb(data, reduce=denom)


def _drafted_width(data: bytes, denom: int) -> int:
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (img.width // denom, img.height // denom))
        return img.width


def read_stored_width(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as img:
        return img.width


def boxes(h: int, w: int) -> list[tuple[float, float, float, float]]:
    """A centre crop, a train-like off-centre crop with fractional edges, a corner and a thin
    strip at the bottom right (the crop's region touches two image edges)."""
    return [
        (h * 0.125, w * 0.125, h * 0.875, w * 0.875),
        (h * 0.31 + 0.4, w * 0.07 + 0.3, h * 0.77, w * 0.64 + 0.6),
        (0.0, 0.0, h * 0.4, w * 0.45),
        (h * 0.9, w * 0.5, float(h), float(w)),
    ]


def check_region(data: bytes, box, denom: int, out_hw=(32, 32), expected=None) -> np.ndarray:
    """Decode `box` at 1/denom and check it against the reference: the region covers the
    filter's reach and, inside it, equals the reference pixel for pixel. libjpeg's crop edge
    (one column where the region stops short of the image's edge, chroma upsampled without
    its outer neighbour) is kept out of reach by design (`region.filter_reach`): excluded."""
    header = read_header(data)
    got = decode_roi(data, header, box, (1, denom), out_hw)
    assert got is not None and got.route == ROUTE_REGION
    full = reference(data, denom) if expected is None else expected
    fh, fw = full.shape[:2]
    sy, sx = fh / header.height, fw / header.width
    scaled = (box[0] * sy, box[1] * sx, box[2] * sy, box[3] * sx)
    oy, ox = scaled[0] - got.box[0], scaled[1] - got.box[1]  # where the region sits
    assert (oy, ox) == (round(oy), round(ox)), "the region starts between pixels"
    oy, ox = round(oy), round(ox)
    np.testing.assert_allclose(got.box[2:], (scaled[2] - oy, scaled[3] - ox))
    ph, pw = got.pixels.shape[:2]
    assert got.pixels.dtype == np.uint8 and got.pixels.shape[2] == 3
    assert oy >= 0 and ox >= 0 and oy + ph <= fh and ox + pw <= fw
    ry0, rx0, ry1, rx1 = reach_region(scaled, out_hw, (fh, fw))
    assert oy <= ry0 and ox <= rx0 and ry1 <= oy + ph and rx1 <= ox + pw, "reach not covered"
    top = 1 if oy > 0 else 0
    left = 1 if ox > 0 else 0
    bottom = ph - (1 if oy + ph < fh else 0)
    right = pw - (1 if ox + pw < fw else 0)
    want = full[oy + top : oy + bottom, ox + left : ox + right]
    np.testing.assert_array_equal(got.pixels[top:bottom, left:right], want)
    return got.pixels


@pytest.mark.parametrize("denom", [1, 2, 4, 8])
def test_photo_regions_equal_pils_pixels_at_every_dct_scale(denom: int) -> None:
    for data in samples():
        header = read_header(data)
        full = reference(data, denom)
        for box in boxes(header.height, header.width):
            check_region(data, box, denom, expected=full)


def test_the_exif_rotated_photo_is_oriented_as_pil_shows_it() -> None:
    data = samples()[2]
    header = read_header(data)
    assert header.orientation != 1 and (header.height, header.width) == reference(data).shape[:2]
    check_region(data, boxes(header.height, header.width)[1], 1)


def test_embedded_dataset_images_equal_djpegs_pixels() -> None:
    """The embedded dataset's JPEGs (as written to disk: `render_jpeg`), against djpeg."""
    if not HAS_DJPEG:
        pytest.skip("djpeg not installed")
    spec = SyntheticSpec()
    for class_id in (0, 4, 9):
        data = render_jpeg(spec, "val", class_id, class_id)
        with Image.open(io.BytesIO(djpeg_pixels(data))) as ppm:
            expected = np.asarray(ppm.convert("RGB"))
        h, w = expected.shape[:2]
        check_region(data, (h * 0.2, w * 0.1, h * 0.8, w * 0.7), 1, expected=expected)


@pytest.mark.parametrize("subsampling", [0, 2])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation(orientation: int, subsampling: int) -> None:
    """Odd sizes (partial MCUs on both axes), 4:4:4 and 4:2:0, at full size and 1/2."""
    pixels = smooth_image(101, 147, seed=orientation)
    data = jpeg_bytes(pixels, subsampling=subsampling, exif=exif_orientation_block(orientation))
    header = read_header(data)
    assert header.orientation == orientation
    for denom in (1, 2):
        full = reference(data, denom)
        for box in boxes(header.height, header.width)[:3]:
            check_region(data, box, denom, out_hw=(24, 40), expected=full)


def test_route_says_whether_the_bytes_were_trusted() -> None:
    data = samples()[0]
    header = read_header(data)
    box = boxes(header.height, header.width)[0]
    verified = decode_roi(data, header, box, (1, 1), (32, 32))
    trusted = decode_roi(data, header, box, (1, 1), (32, 32), intact=True)
    assert verified.route == ROUTE_REGION and trusted.route == ROUTE_RESTART
    np.testing.assert_array_equal(verified.pixels, trusted.pixels)
    assert verified.box == trusted.box


# ---- where it steps aside ---------------------------------------------------------------------


def test_switched_off_it_returns_none_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    data = samples()[0]
    header = read_header(data)
    box = boxes(header.height, header.width)[0]
    monkeypatch.setenv("BATCHWIRE_JPEG_ROI", " 0 ")
    assert decode_roi(data, header, box, (1, 1), (32, 32)) is None
    monkeypatch.setenv("BATCHWIRE_JPEG_ROI", "1")
    assert decode_roi(data, header, box, (1, 1), (32, 32)) is not None


def test_a_box_outside_the_image_is_left_to_the_whole_image_path() -> None:
    data = samples()[0]
    header = read_header(data)
    h, w = header.height, header.width
    # The last box's reach is empty, not inverted: its filter reaches exactly to the edge.
    for box in [(h + 50.0, 0.0, h + 90.0, w), (0.0, -90.0, h, -50.0), (h + 2.0, 0.0, h + 10.0, w)]:
        assert decode_roi(data, header, box, (1, 1), (8, 8)) is None


def test_cmyk_is_left_to_the_whole_image_path() -> None:
    data = odd_file_bytes("cmyk", height=64, width=80)
    assert decode_roi(data, read_header(data), (8.0, 8.0, 56.0, 72.0), (1, 1), (16, 16)) is None


def test_a_header_whose_size_disagrees_with_the_file_is_decoded_whole() -> None:
    data = samples()[0]
    header = read_header(data)
    box = (10.0, 10.0, 100.0, 100.0)
    for h, w in [(header.height + 16, header.width), (header.height, header.width - 8)]:
        lying = ImageHeader(h, w, header.orientation, header.kind)
        assert decode_roi(data, lying, box, (1, 1), (16, 16)) is None


# ---- damaged bytes ----------------------------------------------------------------------------


def _damaged(good: bytes) -> dict[str, bytes]:
    """Each kind of damage, EOI kept where the kind allows; djpeg refuses or warns on every
    one (checked in the test)."""
    sos = good.find(b"\xff\xda")
    flipped = bytearray(good)
    for at in range(sos + 300, len(good) - 300, 997):  # bits flipped across the scan
        flipped[at] ^= 0x5A
    return {
        "truncated": good[: len(good) * 2 // 3],
        "truncated in the header": good[: sos // 2],
        "half then EOI": corrupt_jpeg("half_then_eoi", good),
        "middle zeroed": corrupt_jpeg("middle_zeroed", good),
        "bits flipped": bytes(flipped),
        "empty": b"",
        "not a JPEG": b"this is not an image\n" * 40,
        "SOI then garbage": odd_file_bytes("garbage_after_soi"),
    }


def test_damaged_bytes_are_refused_for_every_crop_never_served() -> None:
    good = samples()[0]
    header = read_header(good)
    for bad in _damaged(good).values():
        for box in boxes(header.height, header.width):
            with pytest.raises(DecodeError, match=r"^(corrupt|truncated) JPEG: "):
                decode_roi(bad, header, box, (1, 1), (32, 32))
        if HAS_DJPEG:  # the reference decoder refuses it too (an error or a warning)
            with pytest.raises(subprocess.CalledProcessError):
                djpeg_pixels(bad)


def test_truncation_is_named_as_such() -> None:
    good = samples()[1]
    header = read_header(good)
    with pytest.raises(DecodeError, match=r"^truncated JPEG: .*Premature end"):
        decode_roi(good[: len(good) // 2], header, (0.0, 0.0, 20.0, 20.0), (1, 1), (8, 8))


def test_damage_below_the_crop_is_refused_unless_the_bytes_are_known_intact() -> None:
    """The tail is verified (`ROI_VERIFY_TAIL`): damage in rows the crop never shows still
    fails the file, as the strict full decode fails it; bytes known intact skip that check."""
    good = samples()[0]
    header = read_header(good)
    cut = good[: len(good) - len(good) // 5] + b"\xff\xd9"  # the bottom rows gone
    top = (0.0, 0.0, header.height * 0.25, float(header.width))
    with pytest.raises(DecodeError):
        decode_roi(cut, header, top, (1, 1), (32, 32))
    served = decode_roi(cut, header, top, (1, 1), (32, 32), intact=True)
    want = decode_roi(good, header, top, (1, 1), (32, 32))
    np.testing.assert_array_equal(served.pixels, want.pixels)


def test_restart_marked_intact_bytes_are_entered_at_the_markers() -> None:
    """Bytes known intact, with restart markers: only the intervals under the crop are decoded,
    so damage in an interval far above it goes unseen (what `intact` must only be given for),
    while a request not known intact reads the file itself and refuses it."""
    good = pil_restart_jpeg(noise_image(128, 64, seed=3), "444")
    header = read_header(good)
    sos = good.find(b"\xff\xda")
    damaged = bytearray(good)
    damaged[sos + 40 : sos + 60] = bytes(20)  # inside the first MCU row's intervals
    bottom = (96.0, 8.0, 128.0, 56.0)
    with pytest.raises(DecodeError):
        decode_roi(bytes(damaged), header, bottom, (1, 1), (16, 16))
    served = decode_roi(bytes(damaged), header, bottom, (1, 1), (16, 16), intact=True)
    want = decode_roi(good, header, bottom, (1, 1), (16, 16))
    np.testing.assert_array_equal(served.pixels, want.pixels)
    check_region(good, bottom, 1, out_hw=(16, 16))


def test_a_header_claiming_a_huge_image_is_refused_not_allocated() -> None:
    """81 Mpx claimed by a 2 kB file: the decoder runs out of data at once."""
    data = odd_file_bytes("claims_9000")
    header = ImageHeader(9000, 9000, 1, "jpeg")  # as if the plausibility bound let it through
    box = (4000.0, 4000.0, 4224.0, 4224.0)
    with pytest.raises(DecodeError, match=r"^(corrupt|truncated) JPEG"):
        decode_roi(data, header, box, (1, 1), (224, 224))
