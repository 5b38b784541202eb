"""Rerun of the one-byte-damage corpus at a larger size, for the figures of issue 20 (not a test).

    .venv/bin/python tests/fuzz_rerun.py [--seeds 4] [--per-seed 60]

For every damaged file: does the strict full decode reject it; does each CPU path (whole image,
region with a verified tail, and the restart path as the server uses it: only for bytes known
intact) serve it for five crops; and for every crop served, do its pixels differ from the intact
file's. "served wrong" counts crops of strictly rejected files served with other pixels than the
intact file's: the target is 0. Damage the strict decode accepts (a flipped bit that decodes) is
what checksums are for: counted apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batchwire.pipeline.decode import decode_for_crop, read_header
from corrupt_corpus import corpus, strict_rejects
from decodepaths import OUT, crops, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--per-seed", type=int, default=60)
    args = parser.parse_args()
    t0 = time.monotonic()
    files = corpus(seeds=args.seeds, per_seed=args.per_seed)
    counts = dict.fromkeys(
        (
            "files",
            "strict_rejects",
            "whole_served",
            "region_crops",
            "region_served",
            "restart_crops",
            "restart_served",
            "served_wrong",
            "accepted_but_different",
        ),
        0,
    )
    counts["files"] = len(files)
    for f in files:
        rejected = strict_rejects(f.data) is not None
        counts["strict_rejects"] += rejected
        header = read_header(f.intact)
        boxes = crops(header.height, header.width)
        paths = [("whole", False, False), ("region", True, False)]
        if f.layout.startswith("rst") and not rejected:
            paths.append(("restart", True, True))  # only bytes known intact take it
        for name, roi, intact in paths:
            for box in boxes if name != "whole" else boxes[:2]:
                counts[f"{name}_crops"] = counts.get(f"{name}_crops", 0) + 1
                got = served(f.data, box, roi, intact=intact)
                if got is None:
                    continue
                counts[f"{name}_served"] += 1
                want = decode_for_crop(f.intact, header, box, OUT, roi=roi, intact=True)
                differs = got.box != want.box or not np.array_equal(got.pixels, want.pixels)
                if differs and rejected:
                    counts["served_wrong"] += 1
                elif differs:
                    counts["accepted_but_different"] += 1
    counts["seconds"] = round(time.monotonic() - t0, 1)
    for key, value in counts.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
