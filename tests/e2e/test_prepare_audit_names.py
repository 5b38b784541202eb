"""`pipeline-prepare` over file and folder names that are not UTF-8 (bytes a Linux file system
takes, e.g. Latin-1 names copied from an old archive): prepared, recorded, checked by the server
as any other, in both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.native import jpeg_transcode
from batchwire.pipeline.dataset import open_dataset
from batchwire.prepare.cli import main
from oddfiles import pil_jpeg, smooth_image

PREPARE = Path(sys.executable).with_name("pipeline-prepare")

if not jpeg_transcode.transcode_available():
    pytest.skip("the JPEG transcoder does not build here", allow_module_level=True)


def latin1_tree(root: Path) -> Path:
    """cls\\xff/ holding caf\\xe9.jpg and ok.jpg (sound) and half\\xe9.jpg (cut in half)."""
    folder = os.path.join(os.fsencode(root), b"cls\xff")
    os.makedirs(folder)
    good = pil_jpeg(smooth_image(40, 56))
    for name, data in ((b"caf\xe9.jpg", good), (b"half\xe9.jpg", good[:600]), (b"ok.jpg", good)):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return root


@pytest.mark.parametrize("checksums_only", [False, True], ids=["prepare", "checksums-only"])
def test_names_that_are_not_utf8_are_prepared_and_checked(
    tmp_path: Path, checksums_only: bool
) -> None:
    src = latin1_tree(tmp_path / "src")
    report = tmp_path / "report.json"
    args = [str(src), "--checksums-only"] if checksums_only else [str(src), str(tmp_path / "dst")]
    for run in range(2):  # the rerun skips what the first run recorded
        assert main([*args, "--quiet", "--report", str(report)]) == 1  # half\xe9.jpg: corrupt
        summary = json.loads(report.read_text())
        assert (summary["intact"], len(summary["problems"])) == (2, 1), summary
        assert summary["skipped"] == (3 if run else 0), summary
    served = src if checksums_only else tmp_path / "dst"
    ds = open_dataset(served, cache_dir=tmp_path / "cache")
    assert ds.checksums is not None and ds.checksums.count == 3
    intact = {os.path.basename(p): bool(ds.checksums.intact[i]) for i, p in enumerate(ds.paths)}
    assert intact == {"caf\udce9.jpg": True, "half\udce9.jpg": False, "ok.jpg": True}


def test_a_summary_naming_a_file_that_is_not_utf8_prints_on_a_strict_stdout(
    tmp_path: Path,
) -> None:
    """Python's stdout is strict in a UTF-8 locale such as en_US.UTF-8 (only C and C.UTF-8 get
    surrogateescape): the summary lists half\\xe9.jpg (corrupt) and must still print."""
    src = latin1_tree(tmp_path / "src")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # strict, as en_US.UTF-8 gives
    done = subprocess.run(
        [str(PREPARE), str(src), str(tmp_path / "dst"), "--quiet"],
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr.decode(errors="replace")[-2000:]
    assert b"corrupt: cls" in done.stdout and b"half" in done.stdout
