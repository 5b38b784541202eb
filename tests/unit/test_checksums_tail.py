"""Issue 32: never verify twice. Originals with a `--checksums-only` manifest: bytes that match a
record of a file that passed the strict full decode take the region path without its tail check
(the rule the restart path already follows), and serve the pixels the verified read serves.
Any other file is still verified whole: one with no record, one whose bytes no longer match its
record (refused before any decode), one recorded as not intact. Each damaged file's damage lies
below its crop, so only the tail check can catch it: a manifest that vouches for such bytes
(edited to say intact) gets them served, which shows the skip is taken and what it trusts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from batchwire import native
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder, decode_for_crop, read_header
from batchwire.pipeline.samples import LoadedSample, SampleLoader
from batchwire.prepare.run import Options, run
from corrupt_corpus import seed_jpeg, strict_rejects
from tail_damage import tail_damaged

if not native.jpeg_roi_available():
    pytest.skip("the native ROI decoder does not build here", allow_module_level=True)

OUT = (24, 24)  # val centre crop of a 256x64 file: rows ~100-156, the damage from row ~230


def tall(seed: int) -> bytes:
    """A noisy baseline 4:2:0 original (no restart markers), taller than its val crop."""
    return seed_jpeg("base420", 256, 64, seed=seed)


def write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def load_all(
    root: Path, cache: Path, verify: str = "auto"
) -> tuple[SampleLoader, dict[str, LoadedSample]]:
    """Every sample of the tree once (val centre crops, one decode thread), by file name."""
    ds = open_dataset(root, cache_dir=cache, verify_checksums=verify)
    with CpuBatchDecoder(threads=1) as decoder:
        loader = SampleLoader(ds, AugmentConfig(OUT, train=False), 0, decoder, retry_delays=())
        got = loader.load(0, list(range(len(ds))))
    return loader, {Path(ds.paths[s.requested]).name: s for s in got}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """Six sound originals and four tail-damaged files, checksummed as the module doc says;
    returns the root and each damaged file's undamaged original."""
    root = tmp_path_factory.mktemp("tail") / "data"
    good = {f"{'ab'[k % 2]}/good{k}.jpg": tall(k) for k in range(6)}
    originals = {
        name: tall(10 + k)
        for k, name in enumerate(["norecord", "mismatch", "notintact", "vouched"])
    }
    damaged = {name: tail_damaged(data) for name, data in originals.items()}
    assert all(strict_rejects(data) is not None for data in damaged.values())
    write(root, good)
    write(root, {"a/mismatch.jpg": originals["mismatch"]})
    write(root, {"b/notintact.jpg": damaged["notintact"], "b/vouched.jpg": damaged["vouched"]})
    run(Options(str(root), None, jobs=1, quiet=True, checksums_only=True))
    manifest = root / CHECKSUMS_MANIFEST
    records = [json.loads(text) for text in manifest.read_text().splitlines()]
    for record in records:
        if record.get("path") == "b/vouched.jpg":
            assert record["intact"] is False
            record["intact"] = True  # a manifest vouching for bytes that are not intact
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    write(root, {"a/norecord.jpg": damaged["norecord"], "a/mismatch.jpg": damaged["mismatch"]})
    return root, originals


def test_intact_originals_skip_the_tail_and_serve_the_verified_pixels(tree, tmp_path) -> None:
    root, _ = tree
    _, trusted = load_all(root, tmp_path / "c1")
    _, verified = load_all(root, tmp_path / "c2", verify="off")  # nothing known intact
    for k in range(6):
        a, b = trusted[f"good{k}.jpg"], verified[f"good{k}.jpg"]
        assert (a.route, b.route) == ("restart", "region") and not a.replaced
        assert a.box == b.box
        assert np.array_equal(a.image.numpy(), b.image.numpy())


def test_files_without_a_matching_intact_record_are_verified_whole(tree, tmp_path) -> None:
    root, originals = tree
    loader, got = load_all(root, tmp_path / "cache")
    reasons = {Path(loader.dataset.paths[i]).name: why for i, why in loader.known_bad.items()}
    assert set(reasons) == {"norecord.jpg", "mismatch.jpg", "notintact.jpg"}
    assert all(got[name].replaced for name in reasons)
    assert "checksum mismatch" in reasons["mismatch.jpg"]  # refused before any decode
    for name in ("norecord.jpg", "notintact.jpg"):  # refused by the tail check
        assert "checksum" not in reasons[name] and "JPEG" in reasons[name], reasons[name]
    # The vouched file shows the damage lies below the crop: trusted, its tail is not read.
    vouched = got["vouched.jpg"]
    assert not vouched.replaced and vouched.route == "restart"
    data = originals["vouched"]
    want = decode_for_crop(data, read_header(data), vouched.plan.box, OUT, intact=False)
    assert np.array_equal(vouched.image.numpy(), want.pixels)
