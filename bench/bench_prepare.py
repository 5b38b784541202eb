"""What `pipeline-prepare` costs and what its restart interval buys, in one run.

    python -m batchwire.bench.bench_prepare [--dir ../shared/imagenet-sample] [--limit 0]

For each restart setting "up to N" (per file, the largest interval of at most N MCUs that divides
its MCU rows, so that the decoder can enter every file at its markers; N = 4 is pipeline-prepare's
`auto`, N = 1 a marker after every MCU) the files are rewritten in memory with the transcoder
pipeline-prepare uses, then:
- size: bytes after / bytes before;
- decode: CPU ms per image of the server's crop decode (`decode_for_crop`, train crops to
  `--size`, one thread), against the same crops on the original files (today's region decode);
- rewrite speed: files per CPU-second of the rewrite with verification (what pipeline-prepare
  does per file, reading and writing aside), per core.
The rows take turns and the best of `--repeats` is kept, as in bench_decode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from batchwire.bench.bench_decode import DEFAULT_DIR, IMAGE_SUFFIXES, _timed
from batchwire.native.jpeg_transcode import transcode_restart
from batchwire.pipeline.augment_plan import AugmentConfig, plan_sample
from batchwire.pipeline.decode import decode_for_crop, read_header
from batchwire.prepare.restarts import AUTO_MOST

SETTINGS = (1, 2, AUTO_MOST, 8)


def label(most: int) -> str:
    return f"up to {most}" + (" (auto)" if most == AUTO_MOST else "")


def bench_prepare(files: list[Path], size: int, repeats: int) -> dict:
    originals = [f.read_bytes() for f in files]
    headers = [read_header(b) for b in originals]
    config = AugmentConfig(image_size=size, train=True)
    plans = [plan_sample(config, 0, 0, i, h.height, h.width) for i, h in enumerate(headers)]

    rewritten: dict[str, list[bytes]] = {}
    rewrite_cpu: dict[str, float] = {}
    for most in SETTINGS:
        c0 = time.process_time()
        rewritten[label(most)] = [transcode_restart(b, most, fit_rows=True) for b in originals]
        rewrite_cpu[label(most)] = time.process_time() - c0

    def crops(blobs: list[bytes], intact: bool):
        # Rewritten files were verified by the transcoder: intact, as a prepared dataset's
        # checksums make them for the server (the restart path); originals take the region path.
        def run() -> None:
            for b, h, p in zip(blobs, headers, plans, strict=True):
                decode_for_crop(b, h, p.box, (size, size), intact=intact)

        return run

    fns = {"original": crops(originals, False)} | {s: crops(b, True) for s, b in rewritten.items()}
    timed = _timed(fns, repeats)
    n, before = len(originals), sum(map(len, originals))
    base_cpu = timed["original"][1]
    rows: dict = {"original": {"cpu_ms_per_image": 1e3 * base_cpu / n, "size_ratio": 1.0}}
    for s in rewritten:
        cpu = timed[s][1]
        rows[s] = {
            "cpu_ms_per_image": 1e3 * cpu / n,
            "decode_speedup_cpu": base_cpu / cpu,
            "size_ratio": sum(map(len, rewritten[s])) / before,
            "rewrite_files_per_cpu_s": n / rewrite_cpu[s],
        }
    return {"images": n, "mean_bytes": before / n, "size": size, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="folder of JPEGs")
    p.add_argument("--limit", type=int, default=0, help="use only the first N files (0 = all)")
    p.add_argument("--size", type=int, default=224, help="output size of the crop plan")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (best is reported)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    files = sorted(f for f in args.dir.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    files = [f for f in files if f.read_bytes()[:2] == b"\xff\xd8"]
    if args.limit:
        files = files[: args.limit]
    if not files:
        raise SystemExit(f"bench_prepare: no JPEGs in {args.dir}")
    result = bench_prepare(files, args.size, args.repeats)
    print(
        f"{result['images']} JPEGs ({result['mean_bytes'] / 1e3:.0f} kB mean), train crops to "
        f"{args.size} px, one thread; decode = the server's crop decode"
    )
    print(
        f"  {'restart interval':<18}{'bytes':>9}{'decode CPU ms':>15}{'vs original':>13}"
        f"{'rewrite files/CPU-s':>21}"
    )
    for name, row in result["rows"].items():
        speed = row.get("decode_speedup_cpu")
        rate = row.get("rewrite_files_per_cpu_s")
        print(
            f"  {name:<18}{100 * (row['size_ratio'] - 1):>+8.2f}%"
            f"{row['cpu_ms_per_image']:>15.3f}"
            f"{'' if speed is None else f'{speed:.2f}x':>13}"
            f"{'' if rate is None else f'{rate:.0f}':>21}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
