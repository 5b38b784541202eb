"""`pipeline-prepare` stopped by SIGTERM or SIGKILL midway: what DST holds then, and the rerun.

test_prepare.py reruns a SIGKILLed run to a complete DST. This looks at DST between the kill and
the rerun, as a server started on it then would see it, and with SIGTERM too (what `kill`, a
container stop or a batch scheduler's preemption sends): every file under its real name is
whole (passes the strict full decode, carries its restart layout, and decodes to exactly its
source's pixels), every manifest record names a file that is there with the checksum it
records, and the server's scan of DST lists only such files (a temporary is hidden). The rerun
then skips exactly what the manifest recorded and finishes DST.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from batchwire.native import jpeg_transcode
from batchwire.native.jpeg_roi import check_jpeg, restart_layout
from batchwire.pipeline.checksums import checksum
from batchwire.pipeline.dataset import open_dataset
from batchwire.prepare.checksum_manifest import MANIFEST_NAME, TMP_PREFIX
from corrupt_corpus import noisy_pixels
from jpegchecks import pil_pixels
from oddfiles import pil_jpeg

PREPARE = Path(sys.executable).with_name("pipeline-prepare")
FILES = 120

if not jpeg_transcode.transcode_available():
    pytest.skip("the JPEG transcoder does not build here", allow_module_level=True)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source tree both tests prepare (SRC is never written)."""
    root = tmp_path_factory.mktemp("src")
    for k in range(FILES):
        folder = root / f"class{k % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{k:03d}.jpg").write_bytes(pil_jpeg(noisy_pixels(240, 320, seed=k)))
    return root


def records(manifest: Path) -> dict[str, dict]:
    """The manifest's file records by path (a line cut short by the kill is no record)."""
    out = {}
    for line in manifest.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "path" in data:
            out[data["path"]] = data
    return out


def interrupted(src: Path, dst: Path, sig: signal.Signals) -> int:
    """Runs prepare on one thread and sends `sig` once 10 files are recorded; its exit status."""
    proc = subprocess.Popen(
        [str(PREPARE), str(src), str(dst), "--jobs", "1", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    manifest = dst / MANIFEST_NAME
    deadline = time.monotonic() + 60
    try:
        while not manifest.exists() or manifest.read_text().count('"path"') < 10:
            assert proc.poll() is None, "prepare ended before it could be interrupted"
            assert time.monotonic() < deadline, "no progress within 60 s"
            time.sleep(0.005)
    finally:
        proc.send_signal(sig)
        status = proc.wait()
    return status


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_run_leaves_only_whole_files_and_a_rerun_finishes(
    src: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    dst = tmp_path / "dst"
    assert interrupted(src, dst, sig) != 0
    done = records(dst / MANIFEST_NAME)
    written = sorted(p for p in dst.rglob("*.jpg") if not p.name.startswith(TMP_PREFIX))
    assert 10 <= len(done) <= len(written) < FILES  # midway: some files not yet written
    for path in written:
        rel = path.relative_to(dst).as_posix()
        data = path.read_bytes()
        check_jpeg(data)  # whole: passes the strict full decode
        assert restart_layout(data)[0] is not None, rel
        np.testing.assert_array_equal(pil_pixels(data), pil_pixels((src / rel).read_bytes()))
        if rel in done:
            assert done[rel]["checksum"] == checksum(data) and done[rel]["intact"] is True, rel
    assert all((dst / rel).is_file() for rel in done)
    listed = [Path(p).relative_to(dst) for p in open_dataset(dst).paths]
    assert listed == [p.relative_to(dst) for p in written]

    report = tmp_path / "report.json"
    rerun = subprocess.run(
        [str(PREPARE), str(src), str(dst), "--quiet", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    summary = json.loads(report.read_text())
    assert (summary["rewritten"], summary["skipped"]) == (FILES, len(done)), summary
    assert not list(dst.rglob(f"{TMP_PREFIX}*"))
    final = records(dst / MANIFEST_NAME)
    assert len(final) == FILES
    for rel, record in final.items():
        assert record["checksum"] == checksum((dst / rel).read_bytes()), rel
