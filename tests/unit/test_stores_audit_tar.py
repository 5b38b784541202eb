"""Stores audit: a tar shard cut short is named, never served short in silence.

Written as a user's code: shards written by the `webdataset` library (the independent writer),
cut the way an interrupted copy or download cuts a file, and opened with `LocalLoader`. The
samples before the cut are served with the intact shard's pixels and labels; the cut is named
in a warning (docs/stores-and-shards.md: "a truncated tar (the samples before the damage are
served)"), so a user who lost most of a shard is told."""

from __future__ import annotations

import importlib
import io
import logging
import tarfile
from pathlib import Path

import pytest
import torch
import webdataset as wds
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR

SAMPLES = 8
_PHOTOS = sorted(SAMPLE_DIR.glob("*.JPEG"))


def _write_shard(path: Path, photos: list[bytes] | None = None, first: int = 0) -> None:
    if len(_PHOTOS) < 2 * SAMPLES:
        pytest.skip("the sample JPEGs are not here")
    if photos is None:
        photos = [p.read_bytes() for p in _PHOTOS[:SAMPLES]]
    with wds.TarWriter(str(path)) as sink:
        for k, data in enumerate(photos):
            sink.write({"__key__": f"s{first + k:04d}", "jpg": data, "cls": (first + k) % 3})


def _loader(path: Path | str) -> LocalLoader:
    return LocalLoader(
        str(path),
        split="val",
        batch_size=4,
        image_size=32,
        output_dtype="uint8",
        with_indices=True,
        verify_checksums="off",
    )


def _pass(loader: LocalLoader, epoch: int = 0) -> dict[str, tuple[torch.Tensor, int]]:
    """Each served sample's pixels and label, by its member name."""
    loader.set_epoch(epoch)
    names = loader.dataset.paths
    out = {}
    for images, labels, indices in loader:
        for image, label, i in zip(images, labels.tolist(), indices.tolist(), strict=True):
            if i >= 0:
                out[names[i].rpartition(":")[2]] = (image.clone(), label)
    return out


def _served(path: Path) -> dict[str, tuple[torch.Tensor, int]]:
    loader = _loader(path)
    try:
        return _pass(loader)
    finally:
        loader.close()


def _header_offset(path: Path, member: str) -> int:
    with tarfile.open(path) as tar:
        return next(m.offset for m in tar.getmembers() if m.name == member)


def test_whole_shards_of_every_writer_are_served_without_a_warning(tmp_path, caplog):
    """The end-of-archive check names no whole shard: `webdataset`'s writer, Python's
    `tarfile` in each format, and the same shard with its zero padding cut to one block."""
    shards = tmp_path / "shards"
    shards.mkdir()
    _write_shard(shards / "train-000000.tar")
    for k, fmt in enumerate((tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT), 1):
        with tarfile.open(shards / f"train-{k:06d}.tar", "w", format=fmt) as tar:
            for name in ("s.jpg", "s.cls"):
                data = _PHOTOS[k].read_bytes() if name.endswith("jpg") else b"1"
                info = tarfile.TarInfo(f"{k}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    whole = (shards / "train-000001.tar").read_bytes().rstrip(b"\0")
    (shards / "train-000004.tar").write_bytes(whole + bytes(-len(whole) % 512 + 512))
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        loader = _loader(shards)
        try:
            served = sum(int((indices >= 0).sum()) for _, _, indices in loader)
        finally:
            loader.close()
    assert served == SAMPLES + 4
    assert not caplog.records, caplog.text


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param(100, id="mid-header"),  # the copy stopped 100 bytes into a header
        pytest.param(0, id="at-a-header"),  # ... or right before one (a block boundary)
    ],
)
def test_a_tar_cut_at_a_header_is_named_and_its_first_samples_served(tmp_path, caplog, cut):
    intact = tmp_path / "intact" / "train-000000.tar"
    intact.parent.mkdir()
    _write_shard(intact)
    reference = _served(intact)
    assert len(reference) == SAMPLES

    at = _header_offset(intact, "s0003.cls") + cut  # the first header of sample 3
    shard = tmp_path / "cut" / "train-000000.tar"
    shard.parent.mkdir()
    shard.write_bytes(intact.read_bytes()[:at])
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        served = _served(shard)

    assert sorted(served) == ["s0000.jpg", "s0001.jpg", "s0002.jpg"]
    for name, (image, label) in served.items():
        assert label == reference[name][1]
        assert torch.equal(image, reference[name][0]), name
    named = [m for r in caplog.records if (m := r.getMessage()).startswith(f"skipped: {shard}: ")]
    assert any("truncated tar" in m for m in named), caplog.text


def test_a_local_shard_rewritten_mid_run_is_a_bad_sample_not_another_photo(tmp_path, caplog):
    """A shard copied over (same layout, one photo swapped for another of the same length)
    while a loader has it open: its indexed offsets now hold the other photo, which must not
    be served under the old sample's label."""
    photos = [p.read_bytes() for p in _PHOTOS[: 2 * SAMPLES]]
    _write_shard(tmp_path / "train-000000.tar", photos[:SAMPLES])
    _write_shard(tmp_path / "train-000001.tar", photos[SAMPLES:], SAMPLES)
    other = next(
        p.read_bytes() for p in _PHOTOS[2 * SAMPLES :] if p.stat().st_size <= len(photos[0])
    )
    changed = [other + bytes(len(photos[0]) - len(other)), *photos[1:SAMPLES]]
    rewritten = tmp_path / "rewritten" / "train-000000.tar"
    rewritten.parent.mkdir()
    _write_shard(rewritten, changed)
    (rewritten.parent / "train-000001.tar").symlink_to(tmp_path / "train-000001.tar")
    wrong = _served(rewritten.parent / "train-{000000..000001}.tar")["s0000.jpg"][0]

    loader = _loader(tmp_path / "train-{000000..000001}.tar")
    try:
        before = _pass(loader, 0)
        (tmp_path / "train-000000.tar").write_bytes(rewritten.read_bytes())
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            after = _pass(loader, 1)
        counts = loader.counts()
    finally:
        loader.close()

    assert not torch.equal(after["s0000.jpg"][0], wrong), "another photo served as s0000"
    assert counts["replaced_total"] >= 1, counts
    assert "changed since it was opened" in caplog.text, caplog.text
    for k in range(SAMPLES, 2 * SAMPLES):  # the shard left alone is served as it was
        name = f"s{k:04d}.jpg"
        assert torch.equal(after[name][0], before[name][0]) and after[name][1] == before[name][1]


@pytest.mark.parametrize("compress", ["gzip", "bz2", "lzma"])
def test_a_compressed_shard_under_a_tar_name_says_so(tmp_path, caplog, compress):
    """`tar czf train-000000.tar ...` (a compressed tar under a plain `.tar` name): named as
    compressed, with what to do, not as "a damaged tar header"."""
    plain = tmp_path / "plain.tar"
    _write_shard(plain)
    module = importlib.import_module(compress)
    shard = tmp_path / "train-000000.tar"
    shard.write_bytes(module.compress(plain.read_bytes()))
    with (
        caplog.at_level(logging.WARNING, logger="batchwire.pipeline"),
        pytest.raises(ValueError, match="no usable samples"),
    ):
        _loader(shard)
    said = {"gzip": "gzip", "bz2": "bzip2", "lzma": "xz"}[compress]
    assert f"{said}-compressed" in caplog.text and "decompress it" in caplog.text, caplog.text
