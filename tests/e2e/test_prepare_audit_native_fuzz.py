"""Damaged `pipeline-prepare`d JPEGs through every native entry point, in a child process.

Prepared files (restart markers and the interval index, as `prepare.job.rewrite` writes them:
4:2:0, 4:2:2 with an EXIF rotation, 4:4:4, greyscale and CMYK) get one of several kinds of
damage (a byte in the header, in the entropy-coded data, on a restart marker, in the last bytes,
in a segment's length field; many bytes; a cut), and go through `jpeg_header`, `restart_layout`,
`index_agrees`, `has_interval_index`, `with_interval_index`, `check_jpeg`, `crop_bitstream` and
`decode_jpeg_roi` on both of its paths at every DCT scale.

What must hold: the process never crashes (a child, so that a segfault is seen as its signal,
not as a dead test run); the verified region path never hands out pixels for bytes the strict
full decode refuses; and where damaged bytes still pass the strict full decode (what prepare or
`--checksums-only` would record as intact, letting the server enter the file at its markers),
the restart path gives exactly the region path's pixels and region.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire import native

TESTS = Path(__file__).resolve().parents[1]

if not native.jpeg_roi_available():
    pytest.skip("the ROI JPEG decoder does not build here", allow_module_level=True)

CHILD = r"""
import json, random, sys
import numpy as np
from batchwire.native import jpeg_roi as J
from batchwire.native.jpeg_transcode import transcode_restart
from batchwire.prepare.job import rewrite
from corrupt_corpus import noisy_pixels, segments
from oddfiles import exif_orientation_block, pil_jpeg

rng = random.Random(int(sys.argv[1]))
count = int(sys.argv[2])
pic = noisy_pixels(72, 88, seed=1)
sources = [
    pil_jpeg(pic),
    pil_jpeg(pic, subsampling=1, exif=exif_orientation_block(6)),
    pil_jpeg(pic, subsampling=0),
    pil_jpeg(pic, mode="L"),
    pil_jpeg(pic, mode="CMYK"),
]
prepared = []
for data in sources:
    out, outcome, error = rewrite(data, 0)
    assert outcome == "rewritten", (outcome, error)
    prepared.append(out)


def mutate(data):
    b = bytearray(data)
    segs, scan = segments(data)
    kind = rng.choice(["header", "scan", "rst", "tail", "length", "many", "cut"])
    if kind == "cut":
        return kind, bytes(b[: rng.randrange(2, len(b))])
    if kind == "many":
        for _ in range(rng.randrange(2, 12)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return kind, bytes(b)
    rst = [i for i in range(scan, len(b) - 1) if b[i] == 0xFF and 0xD0 <= b[i + 1] <= 0xD7]
    at = {
        "header": lambda: rng.randrange(2, scan),
        "scan": lambda: rng.randrange(scan, len(b)),
        "rst": lambda: rng.choice(rst) + rng.randrange(2) if rst else scan,
        "tail": lambda: rng.randrange(len(b) - 6, len(b)),
        "length": lambda: rng.choice(segs)[1] + rng.randrange(2),
    }[kind]()
    new = rng.choice([b[at] ^ (1 << rng.randrange(8)), rng.randrange(256), 0, 0xFF])
    b[at] = new if new != b[at] else b[at] ^ 1
    return kind, bytes(b)


def attempt(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (J.JpegRoiError, ValueError):
        return None


stats = {"files": 0, "strict_ok": 0, "decoded": 0, "refused": 0, "compared": 0, "wrong": []}
for k in range(count):
    what, data = mutate(prepared[k % len(prepared)])
    stats["files"] += 1
    attempt(J.jpeg_header, data)
    attempt(J.restart_layout, data)
    attempt(J.index_agrees, data)
    attempt(J.has_interval_index, data)
    attempt(J.with_interval_index, data)
    try:
        J.check_jpeg(data)
        strict_ok = True
    except J.JpegRoiError:
        strict_ok = False
    stats["strict_ok"] += strict_ok
    for _ in range(2):
        y0, x0 = rng.randrange(0, 80), rng.randrange(0, 96)
        region = (y0, x0, y0 + rng.randrange(1, 60), x0 + rng.randrange(1, 60))
        attempt(J.crop_bitstream, data, *region)
        denom = rng.choice([1, 1, 2, 4, 8])
        got = {}
        for restarts in (False, True):
            found = attempt(
                J.decode_jpeg_roi, data, *region, denom,
                restarts=restarts, fast_entropy=rng.random() < 0.8,
            )
            stats["decoded" if found is not None else "refused"] += 1
            if found is not None:
                got[restarts] = found
        if False in got and not strict_ok:
            stats["wrong"].append((k, what, "region path served bytes the strict decode refuses"))
        if strict_ok and len(got) == 2:
            stats["compared"] += 1
            (a, ra, fa), (b, rb, fb) = got[False], got[True]
            if (ra, fa) != (rb, fb) or not np.array_equal(a, b):
                stats["wrong"].append((k, what, "restart path differs from the region path"))
print(json.dumps(stats))
"""


def fuzz(seed: int, count: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(seed), str(count)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, f"the child died (status {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_damaged_prepared_files_never_crash_and_never_give_other_pixels() -> None:
    stats = fuzz(seed=7, count=1500)
    assert stats["wrong"] == []
    # The run did what it says: files refused and decoded, and damaged bytes that still pass
    # the strict decode compared on both paths.
    assert stats["refused"] > 1000 and stats["decoded"] > 300, stats
    assert stats["strict_ok"] > 150 and stats["compared"] > 100, stats
