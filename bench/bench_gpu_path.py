"""The CPU microseconds per image of the GPU decode path's Python work, everything but the decode
call itself (no GPU needed): the "ceilings" figure of issue 25.

A GPU server's producer spends, per image, CPU time in Python with the GIL held (header, plan,
request, narrowing, the decoder skeleton, encoded-bytes handling) before the GPU decodes; at
~100 us an image, one process tops out near 10k images/s whatever the GPU does. This measures
each part on real files (the shared ImageNet sample, else the embedded dataset) and, with
`--prepared DIR`, files with restart markers (pipeline-prepare's output), where narrowing cuts
the small JPEG of each crop. The decode call is replaced by a stub that returns a preallocated
image, so `skeleton` is `GpuDecoderBase.decode_batch` minus nvJPEG/DALI. The strict check
(a full entropy decode on the CPU threads, skipped for `intact` requests) is reported apart.

    python -m batchwire.bench.bench_gpu_path [--data DIR] [--prepared DIR] [--images N]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from batchwire.bench.data import DEFAULT_DATA
from batchwire.pipeline.augment_plan import AugmentConfig, plan_samples
from batchwire.pipeline.decode import DecodeRequest, DecodeResult, read_header
from batchwire.pipeline.decode.backends import check_jpeg_data
from batchwire.pipeline.decode.fallback import GpuBatch, GpuDecoderBase
from batchwire.pipeline.decode.restart import cut_region, narrow_request


class StubGpuDecoder(GpuDecoderBase):
    """`GpuDecoderBase` with the library call replaced by a preallocated image per item."""

    name = "stub"

    def __init__(self, max_batch: int) -> None:
        self.device = torch.device("cpu")
        self.max_batch = max_batch
        self.max_image_pixels = 16 * 1024 * 1024
        self._start_fallback(1)
        self._image = torch.zeros((8, 8, 3), dtype=torch.uint8)

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        # What nvJPEG's path does in Python per image besides the call: wrap the bytes.
        for i in items:
            torch.frombuffer(bytearray(batch.requests[i].data), dtype=torch.uint8)
            batch.results[i] = DecodeResult(image=self._image, box=batch.requests[i].box)


def native_cuts(requests: Sequence[DecodeRequest]) -> Callable[[], object] | None:
    """The native cut alone (`jpeg_roi.crop_bitstream`) on the stored regions `narrow_request`
    asks it for (computed here once, as narrow_request does), to tell its share of
    `narrow_request` from the Python around it; None when the extension is unavailable."""
    from batchwire.native import jpeg_roi

    if not jpeg_roi.jpeg_roi_available():
        return None
    calls = []
    for r in requests:
        region = cut_region(r.header, r.box, r.out_hw)
        if region is not None:
            calls.append((r.data, *region))
    crop = jpeg_roi.crop_bitstream
    return lambda: [crop(*args) for args in calls]


def per_image_us(fn: Callable[[], object], n: int, repeats: int = 3) -> float:
    """Best of `repeats` of CPU (process) microseconds per image for `fn` over `n` images."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return 1e6 * best / max(1, n)


def measure(files: list[bytes], label: str, size: int = 224, batch: int = 64) -> None:
    n = len(files)
    config = AugmentConfig(image_size=size, train=True)
    headers = [read_header(d) for d in files]
    plans = plan_samples(
        config, 0, 0, list(range(n)), [h.height for h in headers], [h.width for h in headers]
    )
    requests = [
        DecodeRequest(i, d, h, p.box, (size, size))
        for i, (d, h, p) in enumerate(zip(files, headers, plans, strict=True))
    ]
    sizes = (list(range(n)), [h.height for h in headers], [h.width for h in headers])
    dec = StubGpuDecoder(batch)
    rows = {
        "read_header": per_image_us(lambda: [read_header(d) for d in files], n),
        "plan_samples": per_image_us(lambda: plan_samples(config, 0, 0, *sizes), n),
        "DecodeRequest": per_image_us(
            lambda: [
                DecodeRequest(i, d, h, p.box, (size, size))
                for i, (d, h, p) in enumerate(zip(files, headers, plans, strict=True))
            ],
            n,
        ),
        "narrow_request": per_image_us(lambda: [narrow_request(r) for r in requests], n),
    }
    if (cuts := native_cuts(requests)) is not None:
        rows["  of it native cut"] = per_image_us(cuts, n)
    rows |= {
        "bytes -> tensor": per_image_us(
            lambda: [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in files], n
        ),
    }
    # The skeleton for `intact` requests (a prepared dataset with its manifest): no strict
    # check, so routing, narrowing and the chunks' Python are all that runs.
    intact = [dataclasses.replace(r, intact=True) for r in requests]
    rows["skeleton (intact)"] = per_image_us(
        lambda: [dec.decode_batch(intact[s : s + batch]) for s in range(0, n, batch)], n
    )
    strict = per_image_us(lambda: [check_jpeg_data(d) for d in files], n, repeats=1)
    dec.close()
    total = rows["read_header"] + rows["plan_samples"] + rows["DecodeRequest"]
    total += rows["skeleton (intact)"]
    mean_kb = sum(map(len, files)) / n / 1e3
    print(f"{label}: {n} files, {mean_kb:.0f} KB mean, {size} px crops, CPU us per image")
    for name, us in rows.items():
        print(f"  {name:>18}: {us:8.1f}")
    print(f"  {'total (CPU)':>18}: {total:8.1f}  -> {1e6 / total:,.0f} images/s per core")
    print(f"  {'strict check':>18}: {strict:8.1f}  (CPU threads, GIL released; not for intact)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--prepared", type=Path)
    parser.add_argument("--images", type=int, default=256)
    args = parser.parse_args(argv)
    data = args.data
    if not data.is_dir():
        from batchwire.pipeline.synthetic import default_dataset

        data = default_dataset().train_root
    for label, folder in (("original", data), ("prepared", args.prepared)):
        if folder is None:
            continue
        paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg"))
        files = [p.read_bytes() for p in paths[: args.images]]
        files = [d for d in files if read_header(d).kind == "jpeg"]
        measure(files, f"{label} ({folder})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
