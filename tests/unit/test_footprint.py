"""The whole expected resident memory said at start (server/footprint.py), with real numbers.

`resident_mib` against this process's own memory as it grows by a block the test writes;
`median_pixels` on real datasets of small PNGs of known sizes (files in tmp_path, and a
dataset read through a `reader`, as tar shards and buckets are), with unreadable samples among
them and at most `sample` read from each; `expected_rss_statement` on the module doc's own
measured configuration (batch 64 at 224 px, 3 producers, 70 and 16 buffers), without a sampled
image, with read-ahead, and its total against its parts from tiny to huge inputs.
"""

from __future__ import annotations

import io
import itertools
import math
import mmap
import re
import resource
from pathlib import Path

import pytest
from batchwire.pipeline.decode.headers import DEFAULT_MAX_PIXELS
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.server import footprint
from batchwire.server.footprint import (
    READ_AHEAD_RSS_FACTOR,
    SLACK_MIB,
    expected_rss_statement,
    median_pixels,
    resident_mib,
)
from PIL import Image

MIB = 2**20
# The module doc's measured server: batch 64 at 224 px (uint8 images, int64 labels), 3 producers,
# ImageNet's median image (500 x 375), the process at rest.
BATCH, SIDE, PRODUCERS, MEDIAN_PX, AT_REST_MIB = 64, 224, 3, 500 * 375, 331.8
BATCH_BYTES = BATCH * 3 * SIDE * SIDE + BATCH * 8


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    """A real image file (PNG: its header is read in Python; a JPEG's first read would load the
    native extension, a second of CPU for nothing this module does differently)."""
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, "PNG")
    return buf.getvalue()


def claiming(data: bytes, side: int) -> bytes:
    """A PNG whose header (IHDR: width, height at bytes 16-24) says it is ``side`` x ``side``."""
    return data[:16] + side.to_bytes(4, "big") * 2 + data[24:]


def folder(
    tmp_path: Path, name: str, files: dict[str, bytes], more: tuple[Path, ...] = ()
) -> ImageDataset:
    """A dataset of files written under tmp_path/name, and the paths ``more`` (a list of paths,
    as a list file gives)."""
    root = tmp_path / name
    root.mkdir()
    for file, data in files.items():
        (root / file).write_bytes(data)
    paths = [str(root / file) for file in files] + [str(path) for path in more]
    return ImageDataset(paths, [0] * len(paths), ["c"], root=root, kind="list")


def test_resident_mib_is_this_processs_rss_and_follows_what_it_holds() -> None:
    before = resident_mib()
    assert before is not None and 10 < before < 64 * 1024
    with open("/proc/self/statm") as fh:  # resident pages: the same figure, another file
        statm_mib = int(fh.read().split()[1]) * resource.getpagesize() / MIB
    assert abs(before - statm_mib) < 1
    # Fresh pages of its own (an anonymous mapping), written so resident: a heap block could
    # reuse memory that earlier tests of this worker freed and that is resident already.
    block = mmap.mmap(-1, 64 * MIB)
    block.write(b"\x01" * (64 * MIB))
    held = resident_mib()
    block.close()  # unmapped: given back at once
    after = resident_mib()
    assert held is not None and after is not None
    assert 63.5 < held - before < 65  # MiB of 2**20 bytes
    assert held - after > 60  # given back: a figure of now, not the peak


def test_resident_mib_is_none_where_there_is_no_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: str, *args: object, **kwargs: object) -> object:
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(footprint, "open", no_proc, raising=False)  # a system without /proc
    assert resident_mib() is None


def test_median_pixels_is_the_median_of_the_headers_over_all_datasets(tmp_path: Path) -> None:
    one = folder(tmp_path, "one", {"a.png": png(8, 8), "b.png": png(16, 8), "c.png": png(32, 32)})
    two = folder(tmp_path, "two", {"d.png": png(16, 16), "e.png": png(64, 32)})
    assert median_pixels([one]) == 128  # 64, 128, 1024
    assert median_pixels([one, two]) == 256  # 64, 128, 256, 1024, 2048
    assert median_pixels([two]) == (256 + 2048) // 2  # an even count: the middle two's mean


def test_unreadable_samples_are_skipped(tmp_path: Path) -> None:
    good = png(40, 30)
    bad = {
        "empty.png": b"",
        "text.png": b"not an image at all\n",
        "truncated.png": good[:20],  # cut inside its header
        "liar.png": claiming(png(4, 3), 60_000),  # more pixels than its bytes could hold
    }
    (tmp_path / "a-dir").mkdir()
    gone = (tmp_path / "missing.png", tmp_path / "a-dir")
    mixed = folder(tmp_path, "mixed", {**bad, "good.png": good}, more=gone)
    assert median_pixels([mixed]) == 40 * 30
    assert median_pixels([folder(tmp_path, "all-bad", bad)]) is None
    assert median_pixels([folder(tmp_path, "empty", {})]) is None
    assert median_pixels([]) is None


def test_an_image_above_the_decode_limit_still_counts(tmp_path: Path) -> None:
    """The estimate is about what the images are: one over --max-pixels (which a producer
    would refuse) still tells how large the dataset's images are."""
    side = math.isqrt(DEFAULT_MAX_PIXELS) + 100
    # one bit a pixel, padded to a plausible size for its scanlines (2064 bytes a byte at most)
    big = claiming(png(4, 3, mode="1"), side) + bytes(side * side // 8 // 1024)
    assert median_pixels([folder(tmp_path, "big", {"big.png": big})]) == side * side


@pytest.mark.parametrize("n", [1, 3, 15, 16, 17, 31, 32, 33, 1000, 10_007])
@pytest.mark.parametrize("sample", [16, 4, 1])
def test_at_most_sample_images_are_read_spread_over_each_dataset(n: int, sample: int) -> None:
    """The estimate reads a few samples (from a bucket, each a request) however large the
    dataset, from all over it rather than its first few (often one class)."""
    image = png(4, 3)
    read: list[int] = []

    def reader(i: int) -> bytes:
        read.append(i)
        return image

    names = [f"shard-0.tar/{i}.png" for i in range(n)]
    dataset = ImageDataset(names, [0] * n, ["c"], root="s3://b/shards", kind="tar", reader=reader)
    assert median_pixels([dataset, dataset], sample=sample) == 12
    first, second = read[: len(read) // 2], read[len(read) // 2 :]
    assert first == second  # each dataset on its own
    count = min(n, sample)
    assert len(first) == count and len(set(first)) == count
    gap = math.ceil(n / count)
    assert first[0] == 0 and n - first[-1] <= gap
    assert all(0 < b - a <= gap for a, b in itertools.pairwise(first))


def parts(statement: str) -> tuple[float, list[float]]:
    """The stated total and the MiB figures it says it is the sum of."""
    total, rest = re.fullmatch(
        r"expected resident memory: up to about (\d+) MiB = (.*)", statement
    ).groups()
    return float(total), [float(x) for x in re.findall(r"(?:^|\+ )(\d+) MiB", rest)]


def test_the_module_docs_measured_server_is_stated_as_the_doc_says() -> None:
    """'332 + 643 + 103 + 64 = 1142 MiB stated', and 646 with --max-buffers 16."""
    statement = expected_rss_statement(
        AT_REST_MIB, 70 * BATCH_BYTES / MIB, PRODUCERS, BATCH, MEDIAN_PX, SIDE * SIDE
    )
    assert statement == (
        "expected resident memory: up to about 1142 MiB = 332 MiB the process now (Python, "
        "torch, the datasets) + 643 MiB batch buffers at most + 103 MiB decoded images (3 "
        "producers x 64 images x the median sampled image's 0.19 Mpx x 3 bytes; larger images "
        "take more) + 64 MiB allocator slack"
    )
    sixteen = expected_rss_statement(
        AT_REST_MIB, 16 * BATCH_BYTES / MIB, PRODUCERS, BATCH, MEDIAN_PX, SIDE * SIDE
    )
    assert parts(sixteen) == (646, [332, 147, 103, SLACK_MIB])


def test_without_a_sampled_image_a_crop_of_twice_the_output_side_is_assumed() -> None:
    statement = expected_rss_statement(AT_REST_MIB, 0, PRODUCERS, BATCH, None, SIDE * SIDE)
    # 3 producers x 64 images x (448 x 448) px x 3 bytes = 110.25 MiB
    assert (
        "+ 110 MiB decoded images (3 producers x 64 images x 0.20 Mpx (no image sampled) x 3 bytes"
        in statement
    )
    assert parts(statement) == (332 + 0 + 110 + SLACK_MIB, [332, 0, 110, SLACK_MIB])


def test_read_ahead_is_stated_only_where_there_is_some_and_counts_its_factor() -> None:
    args = (AT_REST_MIB, 643.2, PRODUCERS, BATCH, MEDIAN_PX, SIDE * SIDE)
    assert "read-ahead" not in expected_rss_statement(*args, read_ahead_bytes=0)
    budget = 2 * 64 * MIB  # two splits of tar shards in a bucket, 64 MiB each
    statement = expected_rss_statement(*args, read_ahead_bytes=budget)
    ahead = READ_AHEAD_RSS_FACTOR * 128
    assert (
        f"+ {ahead} MiB read-ahead (tar shards in a bucket) + {SLACK_MIB} MiB allocator slack"
        in statement
    )
    assert parts(statement) == (1142 + ahead, [332, 643, 103, ahead, SLACK_MIB])


@pytest.mark.parametrize(
    ("base", "buffers", "producers", "batch", "pixels", "ahead"),
    [
        (0.0, 0.0, 1, 1, 1, 0),  # the smallest
        (0.4, 0.4, 1, 1, None, 1),  # parts that round to nothing
        (331.8, 643.2, 3, 64, 187_500, 3 * 64 * MIB),
        (2_000.5, 150_000.5, 64, 1024, 100_000_000, 64 * 2**30),  # a 100 Mpx median, huge
    ],
)
def test_the_total_is_the_sum_of_the_parts(
    base: float, buffers: float, producers: int, batch: int, pixels: int | None, ahead: int
) -> None:
    statement = expected_rss_statement(base, buffers, producers, batch, pixels, 50_176, ahead)
    total, figures = parts(statement)
    decode = producers * batch * (pixels if pixels is not None else 4 * 50_176) * 3 / MIB
    exact = base + buffers + decode + READ_AHEAD_RSS_FACTOR * ahead / MIB + SLACK_MIB
    assert total == round(exact)
    assert abs(total - sum(figures)) <= 0.5 * len(figures)  # each part rounded on its own
    assert figures[2] == round(decode)
