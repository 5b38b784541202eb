"""Decode throughput per core, full-size against DCT-scaled for a random-resized crop, against
decoding only the crop's region (ROI, where the native decoder builds), and the in-process
LocalLoader rate.

    python -m batchwire.bench.bench_decode [--dir ../shared/imagenet-sample] [--size 224]
        [--prepared .cache/prepared/imagenet-sample]

With `--prepared` (a `pipeline-prepare` copy of `--dir`: the same JPEGs with a restart marker
after every MCU) the row `roi_prepared` decodes the copy's files for the very same crops, and its
ratio to `roi` (the originals) is what the prepared layout saves in the decode stage.

All files are read into memory first, so this measures decoding, not the disk. The per-core
rows run on one thread; they report both wall-clock and CPU-time rates, because on a shared
machine the wall clock includes time other processes held the core, while CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from batchwire.pipeline.augment_plan import AugmentConfig, plan_sample
from batchwire.pipeline.decode import (
    choose_dct_scale,
    decode_for_crop,
    decode_full,
    read_header,
)
from batchwire.pipeline.decode import roi as decode
from batchwire.pipeline.decode.headers import ImageHeader

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "imagenet-sample"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def _timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (best wall seconds, best CPU seconds), each the minimum over the runs; the
    functions take turns, so background load on a shared machine hits them alike, and the
    minimum is the run it disturbed least (CPU time too grows under load: shared caches)."""
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best[name] = (min(wall, best[name][0]), min(cpu, best[name][1]))
    return best


def bench_decode(
    files: list[Path], size: int, repeats: int, prepared: list[Path] | None = None
) -> dict:
    """Per-core decode rates: full-size vs decode_for_crop for the train plan at `size`, whole
    image (DCT-scaled) and region of interest (ROI), with and without checking the tail; with
    `prepared` (the same images, rewritten by pipeline-prepare) also ROI on those, same crops."""
    blobs = [f.read_bytes() for f in files]
    config = AugmentConfig(image_size=size, train=True)
    headers = [read_header(b) for b in blobs]
    prepared_blobs = _prepared_blobs(prepared, headers) if prepared else None
    plans = [plan_sample(config, 0, 0, i, h.height, h.width) for i, h in enumerate(headers)]
    scales: dict[str, int] = {}
    for h, p in zip(headers, plans, strict=True):
        if h.kind == "jpeg":
            y0, x0, y1, x1 = p.box
            num, den = choose_dct_scale(y1 - y0, x1 - x0, size, size)
            scales[f"{num}/{den}"] = scales.get(f"{num}/{den}", 0) + 1

    def full() -> None:
        for b in blobs:
            decode_full(b)

    def scaled() -> None:
        # The pipeline's real per-sample work: header (size for the plan), then the decode.
        for b, p in zip(blobs, plans, strict=True):
            decode_for_crop(b, read_header(b), p.box, (size, size), roi=False)

    def roi(
        verify_tail: bool, files: list[bytes] = blobs, intact: bool = False
    ) -> Callable[[], None]:
        # The same with only the crop's region decoded (the pipeline's default where built);
        # `intact`: the files are known intact (a prepared dataset's checksums matched), which
        # lets the decoder enter restart-marked files at the crop's intervals.
        def run() -> None:
            saved, decode.ROI_VERIFY_TAIL = decode.ROI_VERIFY_TAIL, verify_tail
            try:
                for b, p in zip(files, plans, strict=True):
                    h = read_header(b)
                    decode_for_crop(b, h, p.box, (size, size), roi=True, intact=intact)
            finally:
                decode.ROI_VERIFY_TAIL = saved

        return run

    def forced(den: int) -> Callable[[], None]:
        # Every JPEG decoded at 1/den whatever the crop: what each DCT scale costs by itself.
        def run() -> None:
            for b, h in zip(blobs, headers, strict=True):
                box = (0.0, 0.0, float(h.height), float(h.width))
                decode_for_crop(b, h, box, (h.height // den, h.width // den), roi=False)

        return run

    n = len(blobs)
    rows: dict = {}
    fns = {"full": full, "dct_scaled": scaled} | {f"all_at_1/{d}": forced(d) for d in (2, 4, 8)}
    roi_built = decode._roi_decoder() is not None  # builds it (once) before any timing
    if roi_built:
        fns |= {"roi": roi(False), "roi_verify_tail": roi(True)}
    if roi_built and prepared_blobs is not None:
        # What the server does on a prepared dataset: checksums matched, restart path.
        fns["roi_prepared"] = roi(True, prepared_blobs, intact=True)
    for name, (wall, cpu) in _timed(fns, repeats).items():
        rows[name] = {"images_per_s_wall": n / wall, "images_per_cpu_s": n / cpu}
    full_r, dct_r = rows["full"], rows["dct_scaled"]
    rows["speedup_wall"] = dct_r["images_per_s_wall"] / full_r["images_per_s_wall"]
    rows["speedup_cpu"] = dct_r["images_per_cpu_s"] / full_r["images_per_cpu_s"]
    rows["roi_available"] = roi_built
    if roi_built:
        for name in ("roi", "roi_verify_tail"):
            rows[f"{name}_speedup_cpu_vs_dct_scaled"] = (
                rows[name]["images_per_cpu_s"] / dct_r["images_per_cpu_s"]
            )
    if "roi_prepared" in rows:
        # Against what the server does on the originals (region decode, tail verified).
        prep_r, roi_r = rows["roi_prepared"], rows["roi_verify_tail"]
        rows["roi_prepared_speedup_cpu"] = prep_r["images_per_cpu_s"] / roi_r["images_per_cpu_s"]
        rows["roi_prepared_speedup_wall"] = prep_r["images_per_s_wall"] / roi_r["images_per_s_wall"]
    if prepared_blobs is not None:
        rows["restart_layouts"] = _restart_layouts(prepared_blobs)
    rows["dct_scales_chosen"] = dict(sorted(scales.items()))
    rows["images"] = n
    rows["mean_bytes"] = sum(map(len, blobs)) / n
    return rows


def _prepared_blobs(prepared: list[Path], headers: list[ImageHeader]) -> list[bytes]:
    """The prepared files' bytes, refused (SystemExit) where a file's size differs from its
    original's: the originals' crop plans would not fit it, and the rows would not compare."""
    blobs = [f.read_bytes() for f in prepared]
    for f, b, h in zip(prepared, blobs, headers, strict=True):
        got = read_header(b)
        if (got.height, got.width) != (h.height, h.width):
            raise SystemExit(
                f"bench_decode: {f} is {got.width}x{got.height}, its original "
                f"{h.width}x{h.height}: --prepared must be a pipeline-prepare copy of --dir"
            )
    return blobs


def _restart_layouts(blobs: list[bytes]) -> dict | None:
    """How many of `blobs` the ROI decoder enters at their restart markers (its prepared-file
    path), and why it does not for the others: the reader sees the fast path is taken. None
    where the decoder is unavailable."""
    from batchwire.native.jpeg_roi import restart_layout

    try:
        found = [restart_layout(b) for b in blobs]
    except RuntimeError:  # the extension is unavailable here
        return None
    others = Counter(why for layout, why in found if layout is None)
    return {
        "recognised": len(blobs) - sum(others.values()),
        "files": len(blobs),
        "not_recognised": dict(others.most_common(3)),  # reason -> files, the commonest
    }


def bench_local(files: list[Path], size: int, batch: int, threads: int, epochs: int) -> dict:
    """LocalLoader images/s (train split, uint8 and float32 out) over whole epochs."""
    from batchwire.pipeline.dataset import open_dataset
    from batchwire.pipeline.local import LocalLoader

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "list.txt"
        listing.write_text("".join(f"{f} {i}\n" for i, f in enumerate(files)))
        dataset = open_dataset(listing, allow_outside_root=True)  # our own list of the files
        for dtype in ("uint8", "float32"):
            with LocalLoader(
                dataset,
                batch_size=batch,
                image_size=size,
                threads=threads,
                output_dtype=dtype,
                copy=False,
            ) as loader:
                next(iter(loader))  # warm-up: thread pool, op load, page cache
                images = 0
                t0, c0 = time.perf_counter(), time.process_time()
                for epoch in range(epochs):
                    loader.set_epoch(epoch)
                    for x, _ in loader:
                        images += x.shape[0]
                seconds = time.perf_counter() - t0
                cpu = time.process_time() - c0
                out[dtype] = {
                    "images_per_s": images / seconds,
                    "images_per_cpu_s": images / cpu,
                    "images": images,
                    "augment": loader.producer.augment_name,
                }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m batchwire.bench.bench_decode", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="folder of images")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N files (0 = all)")
    ap.add_argument("--size", type=int, default=224, help="output size of the crop plan")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (best is reported)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="LocalLoader decode threads")
    ap.add_argument("--epochs", type=int, default=1, help="LocalLoader epochs timed")
    ap.add_argument("--no-loader", action="store_true", help="skip the LocalLoader row")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--prepared",
        type=Path,
        help="a pipeline-prepare copy of --dir (same file names): adds the row roi_prepared, "
        "ROI decoding of its files for the same crops",
    )
    ap.add_argument(
        "--upscale",
        type=int,
        default=1,
        help="re-encode the files N times larger first (quality 90, needs Pillow): what DCT "
        "scaling does for camera-size photos",
    )
    args = ap.parse_args(argv)
    args.dir = args.dir.resolve()  # the loader's list file lives elsewhere: absolute paths

    if not args.dir.is_dir():
        ap.error(f"{args.dir} is not a folder")
    files = sorted(p for p in args.dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if args.limit:
        files = files[: args.limit]
    if not files:
        ap.error(f"no images in {args.dir}")
    if args.prepared is not None and args.upscale > 1:
        ap.error("--prepared compares files as they are: it does not mix with --upscale")
    prepared = [args.prepared / f.name for f in files] if args.prepared is not None else None
    missing = [p.name for p in prepared or () if not p.is_file()]
    if missing:
        ap.error(
            f"--prepared {args.prepared} lacks {len(missing)} of the {len(files)} files "
            f"(e.g. {missing[0]}): make it with pipeline-prepare {args.dir} {args.prepared}"
        )

    with tempfile.TemporaryDirectory() as tmp:
        if args.upscale > 1:
            files = _upscaled(files, args.upscale, Path(tmp))
        return _run(args, files, prepared)


def _upscaled(files: list[Path], factor: int, folder: Path) -> list[Path]:
    from PIL import Image

    out = []
    for f in files:
        with Image.open(f) as img:
            rgb = img.convert("RGB")
        big = rgb.resize((rgb.width * factor, rgb.height * factor), Image.BICUBIC)
        target = folder / f"{f.stem}.jpg"
        big.save(target, quality=90)
        out.append(target)
    return out


def _run(args: argparse.Namespace, files: list[Path], prepared: list[Path] | None) -> int:
    decoded = bench_decode(files, args.size, args.repeats, prepared)
    result = {"dir": str(args.dir), "decode": decoded}
    result["upscale"] = args.upscale
    d = result["decode"]
    print(
        f"decode, one thread, {d['images']} files ({d['mean_bytes'] / 1e3:.0f} kB mean), "
        f"preloaded; crop plan: train RandomResizedCrop to {args.size} px"
    )
    names = ["full", "dct_scaled", "all_at_1/2", "all_at_1/4", "all_at_1/8"]
    names += ["roi", "roi_verify_tail"] if d["roi_available"] else []
    names += ["roi_prepared"] if "roi_prepared" in d else []
    print(f"  {'':<22}{'images/s (wall)':>16}{'images/CPU-s':>14}{'CPU ms/image':>14}")
    for name in names:
        r = d[name]
        print(
            f"  {name:<22}{r['images_per_s_wall']:>16.1f}{r['images_per_cpu_s']:>14.1f}"
            f"{1e3 / r['images_per_cpu_s']:>14.3f}"
        )
    print(
        f"  DCT scaling speed-up: {d['speedup_wall']:.2f}x wall, {d['speedup_cpu']:.2f}x CPU; "
        f"scales chosen: {d['dct_scales_chosen']}"
    )
    if d["roi_available"]:
        print(
            f"  ROI speed-up over dct_scaled (CPU): "
            f"{d['roi_speedup_cpu_vs_dct_scaled']:.2f}x, with the tail verified "
            f"{d['roi_verify_tail_speedup_cpu_vs_dct_scaled']:.2f}x"
        )
    else:
        print("  ROI decoding unavailable here (see the logged build error)")
    _print_prepared(d)
    if not args.no_loader:
        result["local_loader"] = bench_local(
            files, args.size, args.batch_size, args.threads, args.epochs
        )
        for dtype, r in result["local_loader"].items():
            print(
                f"LocalLoader {args.size} px, batch {args.batch_size}, {args.threads} threads, "
                f"{dtype} out ({r['augment']} augment): {r['images_per_s']:.1f} images/s, "
                f"{r['images_per_cpu_s']:.1f} images/CPU-s ({r['images']} images)"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _print_prepared(d: dict) -> None:
    """The prepared copy's lines: its ROI speed-up over the originals' and, where the decoder
    can say, how many of its files take the restart-marker path."""
    if "roi_prepared" in d:
        print(
            f"  ROI on the prepared copy vs on the originals: "
            f"{d['roi_prepared_speedup_cpu']:.2f}x faster in CPU ms/image, "
            f"{d['roi_prepared_speedup_wall']:.2f}x in wall time"
        )
    layouts = d.get("restart_layouts")
    if layouts is not None:
        others = "".join(f"; {n} not: {why}" for why, n in layouts["not_recognised"].items())
        print(
            f"  restart-marker layout recognised in {layouts['recognised']} of "
            f"{layouts['files']} prepared files{others}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
