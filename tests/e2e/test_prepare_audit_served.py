"""A `pipeline-prepare`d tree of odd files served by a real server, intact and then damaged.

Four trees, four servers with the same seed and arguments: the original tree (odd JPEGs:
CMYK, greyscale, progressive, 4:4:4, 4:2:2 in every EXIF orientation, a 9 x 17 one, a PNG named
.jpg, an empty file, a truncated JPEG, a header over the pixel cap, among noisy photos), the
tree `pipeline-prepare` made of it, one made with `--restart-interval 3`, and a copy of the
first with one byte changed in ten rewritten files, each at another kind of place (SOI, DQT,
DHT, SOF, DRI, the interval index, SOS, a restart marker, the entropy-coded data, EOI).

What must hold (docs/performance.md, "Faster CPU crops"): the prepared tree's batches are the
original's, byte for byte, odd files included, with the same bad samples counted; and in the
damaged copy every changed file is caught by its checksum whatever the change, counted once,
logged by name and replaced in every slot, while every other slot is exactly the intact
prepared tree's: never a sample with silently wrong pixels. The batches carry their sampler
indices (`with_indices=True`), so each slot is compared with the same sample of the intact tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batchwire import native
from batchwire.native.jpeg_roi import restart_layout
from batchwire.pipeline.dataset import open_dataset
from corrupt_corpus import noisy_pixels, segments
from loaderchecks import counted_batches
from oddfiles import exif_orientation_block, huge_header_jpeg, pil_jpeg, png_bytes, smooth_image
from serverproc import running_server

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
# Files the server counts bad in every tree: prepare copies them as they were.
BAD = ("a/empty.jpg", "a/truncated.jpg", "a/huge.jpg")
# Where each damaged photo gets its changed byte: (name, marker of the segment or None).
PLACES = (
    ("soi", None),
    ("dqt", 0xDB),
    ("dht", 0xC4),
    ("sof", 0xC0),
    ("dri", 0xDD),
    ("index", 0xE9),
    ("sos", 0xDA),
    ("rst", None),
    ("scan", None),
    ("eoi", None),
)

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)


def odd_tree(root: Path) -> Path:
    """Two classes of odd files and noisy photos (see the module doc)."""
    pic = smooth_image(120, 96, seed=3)
    files = {
        "a/cmyk.jpg": pil_jpeg(pic, mode="CMYK"),
        "a/grey.jpg": pil_jpeg(pic, mode="L"),
        "a/progressive.jpg": pil_jpeg(pic, progressive=True),
        "a/444.jpg": pil_jpeg(pic, subsampling=0),
        "a/tiny.jpg": pil_jpeg(smooth_image(9, 17, seed=4)),
        "a/png_named.jpg": png_bytes(pic),
        "a/empty.jpg": b"",
        "a/truncated.jpg": pil_jpeg(pic)[:1500],
        "a/huge.jpg": huge_header_jpeg(smooth_image(16, 16)),
    }
    for o in range(1, 9):
        files[f"b/exif{o}.jpg"] = pil_jpeg(pic, subsampling=1, exif=exif_orientation_block(o))
    for k in range(12):
        files[f"{'ab'[k % 2]}/photo{k:02d}.jpg"] = pil_jpeg(
            noisy_pixels(96 + 8 * k, 130 + 16 * (k % 2), seed=k)
        )
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def place(data: bytes, name: str, marker: int | None) -> int:
    """The offset of one byte of `data` at the kind of place `name` says."""
    segs, scan = segments(data)
    if marker is not None:
        _m, start, end = next(s for s in segs if s[0] == marker)
        return (start + end) // 2 if name != "sof" else start + 3  # SOF: the height's high byte
    if name == "soi":
        return 1
    if name == "eoi":
        return len(data) - 1
    if name == "rst":
        return data.index(b"\xff\xd0", scan) + 1
    return (scan + len(data)) // 2


def damage(prepared: Path, out: Path) -> dict[str, str]:
    """A copy of `prepared` with one byte changed in each of ten photos: {rel: where}."""
    shutil.copytree(prepared, out)
    where = {}
    for k, (name, marker) in enumerate(PLACES):
        rel = f"{'ab'[k % 2]}/photo{k:02d}.jpg"
        data = bytearray((out / rel).read_bytes())
        at = place(bytes(data), name, marker)
        data[at] ^= 0x01 if name != "rst" else 0x07  # RSTn -> another RSTn: still a marker
        (out / rel).write_bytes(bytes(data))
        where[rel] = f"{name}@{at}"
    return where


def prepare(original: Path, prepared: Path, *args: str) -> Path:
    done = subprocess.run(
        [str(PREPARE), str(original), str(prepared), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the truncated JPEG: corrupt
    return prepared


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("audit")
    original = odd_tree(root / "original")
    prepared = prepare(original, root / "prepared")
    for k in range(len(PLACES)):  # every photo to damage is entered at its markers
        data = (prepared / f"{'ab'[k % 2]}/photo{k:02d}.jpg").read_bytes()
        assert restart_layout(data)[0] is not None
    trees = {
        "original": original,
        "prepared": prepared,
        # A marker every 3 MCUs: photos 130 px wide (9 MCUs a row) are entered at their
        # markers, those 146 px wide (10) decoded as before (no layout).
        "every3": prepare(original, root / "every3", "--restart-interval", "3"),
        "damaged": root / "damaged",
    }
    where = damage(prepared, trees["damaged"])
    paths = [Path(p).relative_to(prepared).as_posix() for p in open_dataset(prepared).paths]
    out: dict = {"where": where, "paths": paths}
    common = (
        *("--batch-size", "8", "--image-size", "32", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "9"),
    )
    for name, tree in trees.items():
        with running_server("--train", str(tree), "--val", str(tree), *common) as srv:
            out[name] = {
                s: counted_batches(srv.endpoint, s, 2 if s == "train" else 1) for s in SPLITS
            }
            out[f"{name}_counters"] = srv.stats()["counters"]
            out[f"{name}_log"] = srv.log()
    entered = [restart_layout(p.read_bytes())[0] is not None for p in trees["every3"].rglob("ph*")]
    out["every3_entered"] = sum(entered), len(entered)
    return out


SPLITS = ("train", "val")


def slots(served: dict, a: str, b: str):
    """(split, dataset index, same pixels) for every real slot of trees a and b."""
    for split in SPLITS:
        for (xa, ia), (xb, ib) in zip(served[a][split], served[b][split], strict=True):
            assert ia == ib  # the same plan: batches are a function of the seed
            for slot, index in enumerate(ia):
                if index >= 0:  # a padding slot (-1) repeats a real sample, maybe a replaced one
                    yield split, index, torch.equal(xa[slot], xb[slot])


@pytest.mark.parametrize("tree", ["prepared", "every3"])
def test_prepared_odd_files_serve_the_originals_batches(served: dict, tree: str) -> None:
    paths = served["paths"]
    differ = [(split, paths[i]) for split, i, same in slots(served, "original", tree) if not same]
    assert not differ
    want, got = served["original_counters"], served[f"{tree}_counters"]
    assert want["bad_total"] == got["bad_total"] == len(BAD), (want, got)
    assert want["replaced_total"] == got["replaced_total"] > 0
    entered, photos = served["every3_entered"]
    assert 0 < entered < photos, (entered, photos)  # 3 MCUs tile some photos' rows, not all


def test_every_damaged_byte_is_counted_logged_and_replaced(served: dict) -> None:
    where, paths = served["where"], served["paths"]
    wrong, replaced = [], 0
    for split, index, same in slots(served, "prepared", "damaged"):
        rel = paths[index]
        if rel in where:
            replaced += 1
            if same:
                wrong.append((split, rel, where[rel], "served, not replaced"))
        elif not same:
            wrong.append((split, rel, "intact file", "pixels changed"))
    assert not wrong
    intact, damaged = served["prepared_counters"], served["damaged_counters"]
    assert damaged["bad_total"] == intact["bad_total"] + len(where), damaged
    assert damaged["replaced_total"] == intact["replaced_total"] + replaced, damaged
    log = served["damaged_log"]
    assert all(rel.split("/")[1] in log for rel in where), log[-2000:]
