"""The figures of scripts/gpu_check.sh: GPU results against the CPU reference, the card's memory
bandwidth, and the closing table.

`python -m batchwire.bench.gpu_check compare --device cuda --data DIR --json OUT` decodes the
images with every GPU decoder that runs on the device (nvJPEG, DALI) and with the CPU decoder,
and augments one batch with the compiled op on the device and with the pure torch reference on
the CPU; it prints and writes each one's difference and each decoder's fallbacks (images it sent
to the CPU decoder: those are the CPU's pixels, not the GPU's, so they are counted apart and
left out of the comparison). With `--device cpu` the same code compares DALI's CPU backend and
the CPU op (what `gpu_check.sh --cpu` runs). Exits 1 when a result is beyond its tolerance, an
image failed on the GPU but not on the CPU, or a GPU decoder asked for by `--require` is
missing.

`bandwidth` prints the card's memory bandwidth from NVML (memory clock x bus width x 2), the
figure the fused kernel's GB/s is set against. `table FILE` prints the tab-separated rows that
gpu_check.sh recorded (step, result, figure) as the closing table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Grey levels, each GPU image against the closer of libjpeg-turbo's two chroma upsamplings: on an
#: H200 nvJPEG's 200 photos were under 0.0005 (2026-11-28); an orientation or colour mistake
#: moves the mean by tens.
DECODE_MEAN_TOLERANCE = 1.0
#: The fused op against the float64 reference, in output units of a float32 batch.
AUGMENT_TOLERANCE = 2e-3


def _images(data: Path, limit: int) -> list[tuple[int, bytes]]:
    files = sorted(p for p in data.rglob("*") if p.is_file())[:limit]
    return [(i, p.read_bytes()) for i, p in enumerate(files)]


def _requests(blobs: list[tuple[int, bytes]]) -> list[Any]:
    from batchwire.pipeline.decode import DecodeError, DecodeRequest, read_header

    out = []
    for i, data in blobs:
        try:
            h = read_header(data)
        except DecodeError:
            continue
        box = (0.0, 0.0, float(h.height), float(h.width))
        out.append(DecodeRequest(i, data, h, box, (h.height, h.width)))  # full size: no scaling
    return out


def replicated_chroma_reference(data: bytes) -> np.ndarray | None:
    """The oriented RGB pixels libjpeg-turbo gives with its fast chroma upsampling (each chroma
    sample replicated, TJFLAG_FASTUPSAMPLE), or None where TurboJPEG does not decode the file.

    Why a second reference: nvJPEG upsamples chroma this way, not with libjpeg-turbo's default
    smoothing filter. On an H200 (2026-11-28) its pixels of a test image differed from the
    default decode by 2.4377713 grey levels on average, exactly what this reference differs by,
    and real photos by up to 1.9: a bound on that difference would measure the upsampling
    filter, not our decoder."""
    from batchwire.pipeline.decode.backends import turbo
    from batchwire.pipeline.decode.contract import DecodeError
    from batchwire.pipeline.decode.headers import read_header
    from batchwire.pipeline.decode.orientation import apply_orientation
    from turbojpeg import TJFLAG_FASTUPSAMPLE, TJPF_RGB

    tj = turbo()
    if tj is None:
        return None
    try:
        raw = tj.decode(data, pixel_format=TJPF_RGB, flags=TJFLAG_FASTUPSAMPLE)
        return apply_orientation(raw, read_header(data).orientation)
    except (OSError, DecodeError):  # TurboJPEG's failure or a bad header: no second reference
        return None


def mean_diff_to_closer_reference(
    image: torch.Tensor, default: torch.Tensor, replicated: np.ndarray | None
) -> tuple[float, int]:
    """Mean absolute difference of ``image`` to the closer of the two references (libjpeg-turbo's
    default decode, its replicated-chroma decode), and the max difference to the default."""
    got = image.cpu().int()
    to_default = (got - default.int()).abs()
    mean = to_default.float().mean().item()
    if replicated is not None and tuple(replicated.shape) == tuple(got.shape):
        mean = min(mean, (got - torch.from_numpy(replicated).int()).abs().float().mean().item())
    return mean, int(to_default.max().item())


def compare_decoders(device: str, data: Path, limit: int) -> dict[str, Any]:
    """Each GPU decoder's pixels against the CPU decoder's on the same whole images."""
    from batchwire.pipeline.decode import CpuBatchDecoder
    from batchwire.pipeline.decode.dali import DaliBatchDecoder, dali_decode_missing
    from batchwire.pipeline.decode.nvjpeg import NvjpegBatchDecoder, nvjpeg_decode_missing

    requests = _requests(_images(data, limit))
    cpu = CpuBatchDecoder(2)
    expected = cpu.decode_batch(requests)
    cpu.close()
    makers: dict[str, tuple[str | None, Any]] = {
        "dali": (dali_decode_missing(device), lambda: DaliBatchDecoder(device, 2, max_batch=64)),
    }
    if torch.device(device).type == "cuda":
        makers["nvjpeg"] = (
            nvjpeg_decode_missing(device),
            lambda: NvjpegBatchDecoder(device, 2, max_batch=64),
        )
    found: dict[str, Any] = {}
    for name, (missing, make) in makers.items():
        if missing is not None:
            found[name] = {"missing": missing}
            continue
        dec = make()
        fell: list[int] = []
        decode = dec._fallback.decode

        def recording(reqs, *args, _decode=decode, _fell=fell, **kwargs):
            _fell.extend(r.index for r in reqs)
            return _decode(reqs, *args, **kwargs)

        dec._fallback.decode = recording
        got = []
        for start in range(0, len(requests), 64):
            got += dec.decode_batch(requests[start : start + 64])
        dec.close()
        worst_mean, worst_max, gpu_only_failures, compared, identical = 0.0, 0, [], 0, 0
        for req, res, exp in zip(requests, got, expected, strict=True):
            if exp.image is None:
                continue
            if res.image is None:
                gpu_only_failures.append(req.index)
                continue
            if req.index in fell:
                continue  # the CPU decoder's own pixels: nothing of the GPU's to compare
            mean, most = mean_diff_to_closer_reference(
                res.image, exp.image, replicated_chroma_reference(req.data)
            )
            worst_mean = max(worst_mean, mean)
            worst_max = max(worst_max, most)
            identical += mean == 0.0  # every byte equal to one of the two references
            compared += 1
        found[name] = {
            "images": len(requests),
            "compared_on_device": compared,
            "fallbacks": len(fell),
            "worst_mean_diff": round(worst_mean, 3),
            "worst_max_diff": worst_max,
            "identical_to_a_reference": identical,
            "failed_only_here": gpu_only_failures,
            "ok": worst_mean <= DECODE_MEAN_TOLERANCE and not gpu_only_failures,
        }
    return found


def compare_augment(device: str) -> dict[str, Any]:
    """The compiled op on `device` against the reference on the CPU, one batch of every jitter."""
    from batchwire import native

    gen = torch.Generator().manual_seed(0)
    images = [
        torch.randint(0, 256, (int(h), int(w), 3), dtype=torch.uint8, generator=gen)
        for h, w in ((97, 131), (64, 64), (300, 201), (33, 480))
    ]
    boxes = torch.tensor(
        [[3.5, 7.25, 90.0, 120.5], [0.0, 0.0, 64.0, 64.0], [10.0, 5.0, 290.0, 200.0],
         [1.0, 20.0, 32.0, 400.0]], dtype=torch.float32,
    )  # fmt: skip
    flips = torch.tensor([True, False, True, False])
    jitter = torch.tensor(
        [[1.2, 0.8, 1.3, 0.1], [1.0, 1.0, 1.0, 0.0], [0.7, 1.4, 0.5, -0.3], [1.1, 1.1, 0.0, 0.5]]
    )
    mean = torch.tensor([0.485, 0.456, 0.406])
    std = torch.tensor([0.229, 0.224, 0.225])
    out = torch.empty(4, 3, 56, 48)
    expected = native.augment_batch_reference(images, boxes, flips, jitter, mean, std, out.clone())
    fn = native.augment_impl(device)
    if fn is native.augment_batch_reference:
        return {"ok": False, "missing": f"the compiled op does not run on {device} (see the log)"}
    dev = torch.device(device)
    got = fn([im.to(dev) for im in images], boxes, flips, jitter, mean, std, out.to(dev)).cpu()
    worst = (got - expected).abs().max().item()
    return {"max_diff": worst, "ok": worst <= AUGMENT_TOLERANCE}


def card_bandwidth(index: int = 0) -> float | None:
    """Bytes/s of the card's memory by NVML (2 transfers per memory clock x bus width), or
    None where NVML cannot say."""
    from batchwire.native.build import nvml_session

    with nvml_session() as nvml:
        if nvml is None:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)):
            return None
        clock, width = ctypes.c_uint(0), ctypes.c_uint(0)
        if nvml.nvmlDeviceGetMaxClockInfo(handle, ctypes.c_int(2), ctypes.byref(clock)):
            return None  # 2: NVML_CLOCK_MEM, MHz
        if nvml.nvmlDeviceGetMemoryBusWidth(handle, ctypes.byref(width)):
            return None
        return 2.0 * clock.value * 1e6 * width.value / 8


def describe_compare(result: dict[str, Any]) -> str:
    """One line of the closing table for `compare`'s JSON."""
    parts = []
    for name, d in result["decode"].items():
        if "missing" in d:
            parts.append(f"{name}: MISSING ({d['missing'][:80]})")
        else:
            parts.append(
                f"{name}: mean diff <= {d['worst_mean_diff']}, max {d['worst_max_diff']}, "
                f"{d['fallbacks']} fallbacks of {d['images']}"
            )
    a = result["augment"]
    parts.append(f"op: max diff {a['max_diff']:.2g}" if "max_diff" in a else "op: MISSING")
    return "; ".join(parts)


def describe_bench(result: dict[str, Any]) -> str:
    """One line of the closing table for pipeline-bench's JSON: the batchwire rows' images/s
    and the server's decode fallbacks."""
    parts = []
    for row in result["rows"]:
        if not row["key"].startswith("batchwire"):
            continue
        if row["skipped"]:
            parts.append(f"{row['key']}: skipped ({row['skipped'][:80]})")
        else:
            parts.append(
                f"{row['key']}: {row['images_per_s']:.0f} images/s, "
                f"{row.get('fallbacks')} decode fallbacks"
            )
    return "; ".join(parts) or "no batchwire row"


def print_table(path: Path) -> None:
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    rows = [[*r, "", "", ""][:3] for r in rows]
    head = ("step", "result", "figures")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(2)]
    print(f"{head[0]:<{widths[0]}}  {head[1]:<{widths[1]}}  {head[2]}")
    print(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 7}")
    for step, result, figures in rows:
        print(f"{step:<{widths[0]}}  {result:<{widths[1]}}  {figures}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare")
    cmp.add_argument("--device", default="cuda:0")
    cmp.add_argument("--data", type=Path, required=True)
    cmp.add_argument("--images", type=int, default=256)
    cmp.add_argument("--json", type=Path)
    cmp.add_argument("--require", nargs="*", default=(), help="decoders that must run here")
    sub.add_parser("bandwidth")
    describe = sub.add_parser("describe")
    describe.add_argument("kind", choices=("compare", "bench"))
    describe.add_argument("file", type=Path)
    table = sub.add_parser("table")
    table.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    if args.command == "table":
        print_table(args.file)
        return 0
    if args.command == "describe":
        loaded = json.loads(args.file.read_text())
        print(describe_compare(loaded) if args.kind == "compare" else describe_bench(loaded))
        return 0
    if args.command == "bandwidth":
        bw = card_bandwidth()
        print("unknown" if bw is None else f"{bw / 1e9:.0f} GB/s")
        return 0 if bw is not None else 1
    result = {
        "device": args.device,
        "decode": compare_decoders(args.device, args.data, args.images),
        "augment": compare_augment(args.device),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    bad = [n for n, r in result["decode"].items() if "missing" not in r and not r["ok"]]
    bad += [n for n in args.require if "missing" in result["decode"].get(n, {"missing": 1})]
    bad += [] if result["augment"]["ok"] else ["augment"]
    if bad:
        print(f"gpu_check compare: beyond tolerance or missing: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
