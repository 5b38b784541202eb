"""prepare/job.py's `rewrite`, one file's bytes at a time (whole runs: tests/e2e/test_prepare*)."""

from __future__ import annotations

import io
import subprocess

import numpy as np
from batchwire.pipeline.decode.backends import arithmetic_frame
from batchwire.prepare.checksum_manifest import REWRITTEN, UNVERIFIED
from batchwire.prepare.job import rewrite
from batchwire.prepare.restarts import AUTO
from PIL import Image


def _jpeg(*cjpeg_options: str) -> bytes:
    pixels = (np.arange(48 * 64 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    args = ["cjpeg", "-quality", "85", *cjpeg_options]
    return subprocess.run(args, input=ppm.getvalue(), capture_output=True, check=True).stdout


def test_an_arithmetic_coded_jpeg_is_kept_as_it_is() -> None:
    """The server refuses arithmetic coding: a Huffman rewrite would be served from the prepared
    tree while the original's is refused, and the two trees' batches would differ."""
    original = _jpeg("-arithmetic")
    assert arithmetic_frame(original)
    data, outcome, error = rewrite(original, AUTO)
    assert (data, outcome) == (original, UNVERIFIED)
    assert "arithmetic-coded" in error


def test_a_huffman_jpeg_is_rewritten() -> None:
    original = _jpeg()
    data, outcome, error = rewrite(original, AUTO)
    assert outcome == REWRITTEN and error == "" and data != original
