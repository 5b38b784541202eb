"""The embedded dataset: layout, JPEG variety, determinism, safe concurrent generation."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.synthetic import (
    CLASSES,
    VERSION,
    SyntheticSpec,
    default_dataset,
    ensure_dataset,
    file_name,
    library_versions,
    render_jpeg,
)
from PIL import Image, JpegImagePlugin

TINY = SyntheticSpec(train_per_class=3, val_per_class=2, max_side=160)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.jpg"))
    }


@pytest.fixture(scope="module")
def default():
    return default_dataset()


def test_default_dataset_layout(default) -> None:
    assert default.train_root.parent.name == f"synthetic-v{VERSION}"
    assert default.num_classes == len(CLASSES) >= 10
    train = open_dataset(default.train_root)
    val = open_dataset(default.val_root)
    assert train.classes == val.classes == sorted(CLASSES)
    assert train.class_counts().tolist() == [150] * 10
    assert val.class_counts().tolist() == [40] * 10
    total = sum(Path(p).stat().st_size for p in train.paths + val.paths)
    assert total < 40e6, f"{total / 1e6:.1f} MB is too big for an embedded dataset"


def test_default_dataset_jpeg_variety(default) -> None:
    val = open_dataset(default.val_root)
    train = open_dataset(default.train_root)
    modes, samplings, progressive, sides = set(), set(), 0, []
    checked = (train.paths + val.paths)[::4]
    for path in checked:
        with Image.open(path) as im:
            assert im.format == "JPEG"
            modes.add(im.mode)
            if im.mode == "RGB":
                samplings.add(JpegImagePlugin.get_sampling(im))
            progressive += bool(im.info.get("progressive"))
            sides.extend(im.size)
            im.load()  # every checked file fully decodes
    assert modes == {"L", "RGB"}, "both greyscale and colour"
    assert samplings == {0, 1, 2}, "4:4:4, 4:2:2 and 4:2:0 all present"
    assert 0.1 < progressive / len(checked) < 0.35
    assert min(sides) >= 100 and max(sides) <= 600 and max(sides) > 400
    assert sorted(sides)[len(sides) // 2] < 200, "mostly small, so decoding stays cheap"


def test_regenerated_images_are_identical(default) -> None:
    """Byte-identical when the cached copy was made with today's libraries; after a library
    upgrade the bytes may legitimately differ, but never what the images show."""
    spec = SyntheticSpec()
    manifest = json.loads((default.train_root.parent / "manifest.json").read_text())
    same_libraries = manifest.get("libraries") == library_versions()
    for split, root in (("train", default.train_root), ("val", default.val_root)):
        for class_id, name in enumerate(CLASSES):
            for number in (0, spec.count(split) - 1):
                on_disk = (root / name / file_name(number)).read_bytes()
                fresh = render_jpeg(spec, split, class_id, number)
                assert fresh == render_jpeg(spec, split, class_id, number)
                if same_libraries:
                    assert fresh == on_disk
                a = np.asarray(Image.open(io.BytesIO(fresh)), dtype=np.float32)
                b = np.asarray(Image.open(io.BytesIO(on_disk)), dtype=np.float32)
                assert a.shape == b.shape and np.abs(a - b).mean() < 3.0


def test_generation_is_deterministic_and_versioned(tmp_path: Path) -> None:
    a = ensure_dataset(TINY, tmp_path / "a")
    b = ensure_dataset(TINY, tmp_path / "b")
    assert a.train_root.parent.name.startswith(f"synthetic-v{VERSION}-"), (
        "non-default specs get their own"
    )
    ha, hb = _hashes(a.train_root.parent), _hashes(b.train_root.parent)
    assert ha == hb and len(ha) == 10 * (3 + 2)
    other = ensure_dataset(
        SyntheticSpec(seed=1, train_per_class=3, val_per_class=2), tmp_path / "a"
    )
    assert other.train_root != a.train_root
    assert _hashes(other.train_root.parent) != ha
    manifest = json.loads((a.train_root.parent / "manifest.json").read_text())
    assert manifest["version"] == VERSION and manifest["spec"]["train_per_class"] == 3


def test_existing_dataset_is_reused_not_regenerated(tmp_path: Path) -> None:
    first = ensure_dataset(TINY, tmp_path)
    marker = first.train_root / CLASSES[0] / file_name(0)
    before = marker.stat().st_mtime_ns
    assert ensure_dataset(TINY, tmp_path) == first
    assert marker.stat().st_mtime_ns == before


def test_half_built_tree_is_replaced(tmp_path: Path) -> None:
    final = tmp_path / TINY.folder_name()
    (final / "train" / "circle").mkdir(parents=True)  # no manifest: an interrupted copy
    ds = ensure_dataset(TINY, tmp_path)
    assert len(open_dataset(ds.train_root, cache_dir=tmp_path / "idx")) == 30
    assert list(tmp_path.glob(f"{final.name}.broken-*")), "the odd tree is moved aside, not lost"


_RACE = """
import sys
from batchwire.pipeline.synthetic import SyntheticSpec, ensure_dataset
ds = ensure_dataset(SyntheticSpec(train_per_class=3, val_per_class=2, max_side=160), sys.argv[1])
print(ds.train_root)
"""


@pytest.mark.timeout(120)
def test_concurrent_first_use_generates_once(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=100)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == [TINY.folder_name()], f"leftover temporary folders: {folders}"
    assert _hashes(Path(outs[0]).parent) == _hashes(
        ensure_dataset(TINY, tmp_path / "ref").train_root.parent
    )


def test_module_prints_roots(default) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "batchwire.pipeline.synthetic"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert f"train: {default.train_root}" in res.stdout
    assert f"val:   {default.val_root}" in res.stdout
