"""SIGTERM midway (what `kill`, `timeout`, a container stop or a scheduler's preemption sends)
ends `pipeline-prepare` as Ctrl-C does: exit status 3 ("the run was interrupted: DST is
incomplete, and rerunning the same command finishes it", prepare/cli.py), with its summary and
its --report written, so that a script or scheduler can tell an interrupted run from a crash."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchwire.native import jpeg_transcode
from batchwire.prepare.checksum_manifest import MANIFEST_NAME
from corrupt_corpus import noisy_pixels
from oddfiles import pil_jpeg

PREPARE = Path(sys.executable).with_name("pipeline-prepare")

if not jpeg_transcode.transcode_available():
    pytest.skip("the JPEG transcoder does not build here", allow_module_level=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path: Path, sig: signal.Signals) -> None:
    src, dst, report = tmp_path / "src", tmp_path / "dst", tmp_path / "report.json"
    src.mkdir()
    for k in range(100):
        (src / f"img{k:03d}.jpg").write_bytes(pil_jpeg(noisy_pixels(240, 320, seed=k)))
    proc = subprocess.Popen(
        [str(PREPARE), str(src), str(dst), "--jobs", "1", "--quiet", "--report", str(report)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    manifest, deadline = dst / MANIFEST_NAME, time.monotonic() + 60
    while not manifest.exists() or manifest.read_text().count('"path"') < 10:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (proc.returncode, err[-2000:])
    assert "files seen" in out and json.loads(report.read_text())["interrupted"] is True
