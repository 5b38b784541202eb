"""The steps of scripts/gpu_check.sh that need Python, and the package bookkeeping of the GPU kit.

gpu_check.sh runs each step under its own time cap and reads the step's verdict from the file
named by GPU_CHECK_VERDICT: one tab-separated row per claim (name, status, figures). A status is
PASS or FAIL (a claim checked), REHEARSED (`--cpu`: the step's CPU form ran; it proves nothing
about a GPU) or NOT RUN (with why: "no time left", "DALI not installed", "not available: ...").
A step that writes no row is judged by its exit code. GPU_STEP_SECONDS is the step's cap, which
steps made of several runs (sanitizers, kernel) share out themselves.

Package bookkeeping (no GPU, no batchwire import; also run by gpu_kit.sh, gpu_rehearsal.sh and
tests/unit/test_gpu_kit.py): `gap` lists what the lent image lacks of our runtime dependencies
and checks that scripts/gpu_kit_requirements.txt covers it; `rehearsal-requirements` pins the
image's packages that batchwire and the check need, for a venv that stands in for the image;
`image-subset` says whether this interpreter holds anything the image does not.

    python scripts/gpu_steps.py gap | imports | build [--cpu] | probe | pytest NAME [--cpu] -- ARGS
    python scripts/gpu_steps.py compare|serve|kernel --data DIR [--cpu] | sanitize
    python scripts/gpu_steps.py report --results TSV --json FILE --table FILE [--cpu] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "scripts" / "gpu_image_packages.txt"
KIT_REQUIREMENTS = ROOT / "scripts" / "gpu_kit_requirements.txt"
#: The lent image's Python (gpu_image_packages.txt's header): markers are evaluated for it.
IMAGE_PYTHON = "3.12.3"
#: What the check's own steps import beyond batchwire's runtime dependencies: nvJPEG through
#: torchvision.io, the test runner and its per-test timeouts, PIL in the tests' helpers, and the
#: offline build of batchwire (setuptools, wheel) and the requirement parsing here (packaging).
CHECK_NEEDS = ("torchvision", "pytest", "pytest-timeout", "pillow", "setuptools", "wheel",
               "packaging")  # fmt: skip
#: Needed on a GPU only (nvJPEG through torchvision.io): `--cpu` lists it as not checked, since
#: torchvision's PyPI builds are CUDA builds whose operators do not load beside a CPU torch.
GPU_ONLY_NEEDS = ("torchvision",)
#: The rehearsal venv's stand-ins where the image's version cannot be installed on the
#: development machine (CPython 3.11; stated in bench/RESULTS.md): torch 2.11.0 is CUDA-only on
#: PyPI and PyTorch's CPU index is unreachable from there, so its disk's 2.13.0+cpu stands in,
#: without torchvision (GPU_ONLY_NEEDS); numpy 2.5 has no CPython 3.11 build, so 2.4.6 does.
REHEARSAL_OVERRIDES = {"torch": "torch==2.13.0", "torchvision": None, "numpy": "numpy==2.4.6"}

# Decoded pixels against libjpeg-turbo's, grey levels (0-255), worst image of the set: the mean
# bound is bench/gpu_check.py's (DECODE_MEAN_TOLERANCE, against the closer of libjpeg-turbo's two
# chroma upsamplings). The max bound, against its default decode, catches garbled blocks and a
# wrong channel order (57 on an H200's nvJPEG, 2026-11-28, at colour edges).
DECODE_MAX_TOLERANCE = 96
#: The share of images a GPU decoder may send to the CPU decoder and still pass: the kit's photos
#: are all ones it decodes (none is routed to the CPU by design), so more means GPU decodes fail
#: and the CPU safety net hides it.
MAX_FALLBACK_FRACTION = 0.02
STATUSES = ("PASS", "FAIL", "REHEARSED", "NOT RUN")


# ----------------------------------------------------------------------------- verdicts


def verdict(name: str, status: str, figures: str = "") -> None:
    """Append one row to the step's verdict file (and print it)."""
    assert status in STATUSES, status
    line = f"{name}\t{status}\t{' '.join(figures.split())}"
    print(f"--> {line}", flush=True)
    path = os.environ.get("GPU_CHECK_VERDICT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def seconds_left(started: float) -> float:
    """What is left of this step's cap (GPU_STEP_SECONDS), a few seconds kept for the verdict."""
    cap = float(os.environ.get("GPU_STEP_SECONDS", "600"))
    return cap - (time.monotonic() - started) - 5


# ------------------------------------------------------------------- package bookkeeping


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: Path) -> list[str]:
    return [s for s in (ln.split("#")[0].strip() for ln in path.read_text().splitlines()) if s]


def image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """The image's distributions: canonical name -> version (None where not read)."""
    out: dict[str, str | None] = {}
    for line in _lines(path):
        name, _, version = line.partition("==")
        out[_canonical(name)] = version or None
    return out


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's [project] dependencies that apply on the image's Python, as written."""
    import tomllib
    from packaging.requirements import Requirement

    env = {"python_version": IMAGE_PYTHON[:4], "python_full_version": IMAGE_PYTHON}
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if Requirement(d).marker is None or Requirement(d).marker.evaluate(env)]


def needed_names() -> list[str]:
    """Canonical names of every distribution the GPU check needs: runtime deps, then its own."""
    from packaging.requirements import Requirement

    names = [_canonical(Requirement(d).name) for d in runtime_requirements()]
    return names + [_canonical(n) for n in CHECK_NEEDS if _canonical(n) not in names]


def kit_requirements(path: Path = KIT_REQUIREMENTS) -> dict[str, str]:
    """The kit's pinned requirements: canonical name -> the line."""
    from packaging.requirements import Requirement

    return {_canonical(Requirement(line).name): line for line in _lines(path)}


def image_gap() -> list[str]:
    """What the check needs that the image lacks (canonical names)."""
    image = image_packages()
    return [n for n in needed_names() if n not in image]


def rehearsal_requirements() -> list[str]:
    """pip lines for a venv standing in for the image: what the check needs that the image has,
    at the image's version where known (torch and torchvision at their CPU stand-ins)."""
    image = image_packages()
    lines = []
    for name in needed_names():
        if name not in image:
            continue
        version = image[name]
        line = f"{name}=={version}" if version else name
        line = REHEARSAL_OVERRIDES.get(name, line)
        if line is not None:
            lines.append(line)
    return lines


def installed_outside_image() -> list[str]:
    """Distributions this interpreter can import that the image's list lacks."""
    from importlib import metadata

    image = image_packages()
    names = {_canonical(d.metadata["Name"]) for d in metadata.distributions()}
    return sorted(n for n in names if n not in image)


# --------------------------------------------------------------------------- the steps


def _module_of(dist: str) -> str:
    from importlib import metadata

    for module, dists in metadata.packages_distributions().items():
        if any(_canonical(d) == dist for d in dists) and not module.startswith("_"):
            return module
    return dist.replace("-", "_")


def step_imports(cpu: bool) -> int:
    """Every distribution the check needs is installed and imports; libturbojpeg loads."""
    import importlib
    from importlib import metadata

    found, missing = [], []
    needed = needed_names()
    if cpu:
        needed = [n for n in needed if n not in GPU_ONLY_NEEDS]
        found.append(f"not checked (--cpu): {', '.join(GPU_ONLY_NEEDS)}")
    for dist in needed:
        try:
            version = metadata.version(dist)
            module = _module_of(dist)
            importlib.import_module(module)
            found.append(f"{dist} {version}")
        except Exception as e:  # a missing wheel, or one that cannot load here
            missing.append(f"{dist} ({type(e).__name__}: {str(e)[:80]})")
    try:
        from turbojpeg import TurboJPEG

        lib = TurboJPEG()._TurboJPEG__find_turbojpeg()
        found.append(f"libturbojpeg at {lib}")
    except Exception as e:
        missing.append(f"libturbojpeg ({str(e)[:80]})")
    try:
        import nvidia.dali as dali

        found.append(f"DALI {dali.__version__}")
    except ImportError:
        found.append("DALI not installed")
    print("\n".join(found))
    if missing:
        verdict("environment", "FAIL", "missing: " + "; ".join(missing))
        return 1
    import torch

    verdict(
        "environment",
        "PASS",
        f"nothing missing of {len(needed)} packages; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); {found[-1]}" + ("; " + found[0] if cpu else ""),
    )
    return 0


def _cuobjdump() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    tool = shutil.which("cuobjdump") or str(Path(home) / "bin" / "cuobjdump")
    return tool if Path(tool).exists() else None


def step_build(cpu: bool) -> int:
    """The op built for the GPU found (its compute capability, +PTX), and what the library holds."""
    if cpu:
        run = subprocess.run([sys.executable, "-m", "batchwire.native", "build"])
        status = "REHEARSED" if run.returncode == 0 else "FAIL"
        verdict("CUDA build of the op", status, "--cpu: the CPU build only")
        return run.returncode
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    arch = f"{major}.{minor}+PTX"
    env = {**os.environ, "BATCHWIRE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": arch}
    run = subprocess.run([sys.executable, "-m", "batchwire.native", "build"], env=env)
    if run.returncode != 0:
        verdict("CUDA build of the op", "FAIL", f"build for {arch} exited {run.returncode}")
        return 1
    code = "from batchwire.native.build import make_plan; print(make_plan().library)"
    library = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    tool = _cuobjdump()
    if tool is None:
        verdict("CUDA build of the op", "FAIL", f"built for {arch}; no cuobjdump to check it")
        return 1
    elf = subprocess.run([tool, "--list-elf", library], capture_output=True, text=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", library], capture_output=True, text=True).stdout
    sm, compute = f"sm_{major}{minor}", f"compute_{major}{minor}"
    print(elf, ptx, sep="\n")
    ok = sm in elf and (compute in ptx or ".ptx" in ptx)
    figures = f"TORCH_CUDA_ARCH_LIST={arch}: {sm} code {'found' if sm in elf else 'MISSING'}, "
    figures += f"PTX {'found' if ptx.strip() else 'MISSING'} ({Path(library).name})"
    verdict("CUDA build of the op", "PASS" if ok else "FAIL", figures)
    return 0 if ok else 1


def step_probe() -> int:
    """The compiled op passes its launch probe on this GPU (not the reference fallback)."""
    import torch
    from batchwire import native

    fn = native.augment_impl(torch.device("cuda", 0))
    ok = fn is not native.augment_batch_reference
    name = torch.cuda.get_device_name(0)
    figures = f"the compiled op {'launched' if ok else 'FAILED its probe'} on {name}"
    verdict("launch probe", "PASS" if ok else "FAIL", figures)
    return 0 if ok else 1


def _skip_reason(skipped: ET.Element) -> str:
    """A skip's reason: its message, or for a module skipped whole ("collection skipped") the
    reason in its text (which also names the file: not a reason)."""
    message = skipped.get("message") or ""
    if message != "collection skipped":
        return message
    found = re.search(r"Skipped: (.*?)['\"]\)?$", (skipped.text or "").strip())
    return found.group(1) if found else (skipped.text or message)


def is_dali_absence(reason: str) -> bool:
    return "DALI" in reason or "nvidia.dali" in reason


def junit_counts(xml: Path) -> tuple[int, int, list[str]]:
    """Tests, failures + errors, and each skipped test's reason, from pytest's JUnit XML."""
    root = ET.parse(xml).getroot()
    cases = list(root.iter("testcase"))
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skips = [_skip_reason(s) for s in (c.find("skipped") for c in cases) if s is not None]
    return len(cases), failed, skips


def step_pytest(name: str, cpu: bool, args: Sequence[str]) -> int:
    """pytest with JUnit XML. On a GPU a skipped test fails the step, except for DALI's absence
    (reported as not installed: a non-pass, not a failure); --cpu counts skips as rehearsed."""
    slug = re.sub(r"\W+", "_", name)
    xml = Path(os.environ.get("GPU_CHECK_WORK", "/tmp")) / f"junit-{slug}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *args]  # fmt: skip
    rc = subprocess.run(cmd).returncode
    try:
        total, failed, skips = junit_counts(xml)
    except (OSError, ET.ParseError):
        verdict(name, "FAIL", f"pytest exited {rc} and wrote no report")
        return 1
    dali = [s for s in skips if is_dali_absence(s)]
    other = [s for s in skips if not is_dali_absence(s)]
    passed = total - failed - len(skips)
    figures = f"{passed} passed, {failed} failed, {len(skips)} skipped of {total}"
    if rc not in (0, 5) or failed or total == 0:
        verdict(name, "FAIL", figures if total else "no test ran")
    elif other and not cpu:
        reasons = sorted(set(other))[:3]
        verdict(name, "FAIL", f"{figures}: a skip is a failure on a GPU ({'; '.join(reasons)})")
    elif cpu:
        verdict(name, "REHEARSED", f"{figures} (--cpu: the CUDA tests skip)")
    else:
        verdict(name, "PASS", figures)
    if dali:
        verdict(f"{name}: DALI", "NOT RUN", f"DALI not installed ({len(dali)} tests skipped)")
    return 0


def step_compare(data: Path, cpu: bool, images: int) -> int:
    """Each GPU decoder's pixels against the CPU decoder's (max and mean absolute difference,
    fallbacks listed), and the op on the device against the float64 reference."""
    from batchwire.bench.gpu_check import (
        AUGMENT_TOLERANCE,
        DECODE_MEAN_TOLERANCE,
        compare_augment,
        compare_decoders,
    )

    device = "cpu" if cpu else "cuda:0"
    found = compare_decoders(device, data, images)
    print(json.dumps(found, indent=2))
    for name in ("nvjpeg", "dali"):
        row = f"{name} vs libjpeg-turbo"
        d = found.get(name)
        if d is None:
            verdict(row, "NOT RUN", "--cpu: nvJPEG needs a GPU")
            continue
        if "missing" in d:
            missing = "DALI not installed" if name == "dali" else f"missing: {d['missing']}"
            verdict(row, "NOT RUN" if name == "dali" else "FAIL", missing)
            continue
        ok = (
            d["ok"]
            and d["worst_mean_diff"] <= DECODE_MEAN_TOLERANCE
            and d["worst_max_diff"] <= DECODE_MAX_TOLERANCE
            and d["compared_on_device"] > 0
            and d["fallbacks"] <= MAX_FALLBACK_FRACTION * d["images"]
        )
        figures = (
            f"{d['compared_on_device']} images on {device}: mean abs diff to libjpeg-turbo <= "
            f"{d['worst_mean_diff']} (tolerance {DECODE_MEAN_TOLERANCE}; byte-identical to "
            f"one of its two upsamplings: {d.get('identical_to_a_reference', '?')}), "
            f"max {d['worst_max_diff']} (tolerance {DECODE_MAX_TOLERANCE}); "
            f"fallbacks to the CPU decoder: {d['fallbacks']} of {d['images']} (at most "
            f"{MAX_FALLBACK_FRACTION:.0%}); "
            f"failed only here: {len(d['failed_only_here'])}"
        )
        verdict(row, ("REHEARSED" if cpu else "PASS") if ok else "FAIL", figures)
    op = compare_augment(device)
    if "missing" in op:
        verdict("op vs float64 reference", "FAIL", op["missing"])
    else:
        status = ("REHEARSED" if cpu else "PASS") if op["ok"] else "FAIL"
        figures = f"max abs diff {op['max_diff']:.2g} on {device} (tolerance {AUGMENT_TOLERANCE})"
        verdict("op vs float64 reference", status, figures)
    return 0


def step_serve(data: Path | None, cpu: bool, images: int) -> int:
    """One real pipeline-server on the device feeding a RemoteLoader on the device, timed."""
    import torch
    from batchwire.bench.data import resolve_data
    from batchwire.bench.e2e_row import pipeline_server, server_counters, time_remote_loader

    started = time.monotonic()
    device = "cpu" if cpu else "cuda"
    train = resolve_data(str(data) if data else None).server_train
    with pipeline_server(
        train, batch_size=64, image_size=224, threads=None, device=device, decoder="auto"
    ) as endpoint:
        measured, stats = time_remote_loader(
            endpoint,
            device=device,
            normalize_on_device=True,
            measure_images=images,
            max_seconds=max(5.0, seconds_left(started) - 20),
        )
        counters = server_counters(endpoint)
        memory = "no GPU"
        if not cpu:
            free, total = torch.cuda.mem_get_info()
            peak = torch.cuda.max_memory_allocated() / 2**20
            memory = f"device memory in use {(total - free) / 2**20:.0f} MiB with the server up"
            memory += f", loader peak {peak:.0f} MiB"
    fallbacks = None if counters is None else counters.decode_fallbacks_total
    made = 0 if counters is None else counters.images_total
    figures = (
        f"--device {device} --decoder auto: {measured.images_per_s:.0f} images/s "
        f"({measured.images} images in {measured.seconds:.1f} s), data-wait "
        f"{stats.get('data_wait_fraction', float('nan')):.1%}, server decode fallbacks "
        f"{fallbacks} of {made}, {memory}"
    )
    ok = fallbacks is not None and fallbacks <= MAX_FALLBACK_FRACTION * made
    if not ok:
        figures += f"; more than {MAX_FALLBACK_FRACTION:.0%} of the images made, or unsaid"
    status = ("REHEARSED" if cpu else "PASS") if ok else "FAIL"
    verdict("server -> RemoteLoader", status, figures)
    return 0


class StudyConfig(NamedTuple):
    """One served configuration of the study: --device, --decoder, --producers (None: the
    server's default, 3) and how many server processes the loader reads from together."""

    device: str
    decoder: str
    producers: int | None = None
    servers: int = 1

    @property
    def name(self) -> str:
        name = f"serve study: {self.device}/{self.decoder}"
        name += f", {self.producers} producers" if self.producers else ""
        return name + (f", {self.servers} servers" if self.servers > 1 else "")


#: What the study compares: nvJPEG against the CPU decoder on the same GPU server, the CPU alone,
#: twice the producers, and two nvJPEG server processes. torchvision's CUDA decode holds one lock
#: per process: more producers should not help if that lock is the limit, two processes should.
STUDY_CONFIGS = (
    StudyConfig("cuda", "nvjpeg"),
    StudyConfig("cuda", "cpu"),
    StudyConfig("cpu", "cpu"),
    StudyConfig("cuda", "nvjpeg", producers=6),
    StudyConfig("cuda", "nvjpeg", servers=2),
)
#: Batches in one epoch of the study at the least: the kit's 200 photos make 3 batches of 64, and
#: an epoch that short measures epoch turnover as much as the server.
STUDY_EPOCH_BATCHES = 32


def study_configs(cpu: bool) -> list[StudyConfig]:
    """STUDY_CONFIGS on a GPU; on the CPU (a rehearsal) the CPU ones: the default, more
    producers, two servers."""
    if cpu:
        return [StudyConfig("cpu", "cpu"), StudyConfig("cpu", "cpu", producers=4),
                StudyConfig("cpu", "cpu", servers=2)]  # fmt: skip
    return list(STUDY_CONFIGS)


def study_list(paths: Sequence[str], batch_size: int, folder: Path) -> Path:
    """A list file naming ``paths`` again and again, so that an epoch holds at least
    STUDY_EPOCH_BATCHES batches (a list file may name an image twice: two samples)."""
    repeats = max(1, -(-STUDY_EPOCH_BATCHES * batch_size // max(1, len(paths))))
    out = folder / "study-list.txt"
    out.write_text("".join(f"{p} 0\n" for p in list(paths) * repeats))
    return out


def child_cpu_seconds() -> float:
    """User + system CPU seconds of this process's live children (/proc), 0.0 where unknown:
    a server's CPU while it serves, without its start (torch's import) or its exit."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def step_study(data: Path | None, cpu: bool, images: int) -> int:
    """The served rate by configuration, with the server's stages (recent ms per batch, depth
    of bound) and its CPU per image while it served: where a GPU server's time goes. (The
    first H200 run served 2,001 images/s with the loader waiting 99.5 % of its time, over
    epochs of 3 batches.)"""
    from batchwire.bench.data import resolve_data
    from batchwire.bench.e2e_row import pipeline_server, time_remote_loader
    from batchwire.wire.stats_client import StatsUnavailable, fetch_stats

    started = time.monotonic()
    work = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir()))
    paths = resolve_data(str(data) if data else None).paths
    train = str(study_list(paths, 64, work))
    if not cpu:  # first: seconds, and the most telling figure
        try:
            verdict("serve study: nvjpeg alone", "PASS", nvjpeg_alone(paths, seconds=4.0))
        except Exception as e:  # torchvision without nvJPEG, a decode error: the row says which
            verdict("serve study: nvjpeg alone", "FAIL", f"{type(e).__name__}: {e}"[:300])
    configs = study_configs(cpu)
    for i, config in enumerate(configs):
        share = seconds_left(started) / (len(configs) - i)
        if share < 20:
            verdict(config.name, "NOT RUN", "no time left in this step's cap")
            continue
        try:
            with contextlib.ExitStack() as stack:
                endpoints = [
                    stack.enter_context(pipeline_server(
                        train, batch_size=64, image_size=224, threads=None,
                        device=config.device, decoder=config.decoder, producers=config.producers,
                    ))
                    for _ in range(config.servers)
                ]  # fmt: skip
                cpu_before = child_cpu_seconds()
                made_before = sum(_images_made(e) for e in endpoints)
                measured, stats = time_remote_loader(
                    endpoints, device=config.device, normalize_on_device=True,
                    measure_images=images, max_seconds=max(5.0, share - 15),
                )  # fmt: skip
                cpu_used = child_cpu_seconds() - cpu_before
                made = sum(_images_made(e) for e in endpoints) - made_before
                try:
                    snap = fetch_stats(endpoints[0])
                except StatsUnavailable:
                    snap = None
        except Exception as e:  # one configuration failing (its server's start...) is its row
            print(f"{config.name}: {type(e).__name__}: {e}", flush=True)  # the log tail: why
            verdict(config.name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        stages = "; ".join(
            f"{st.name} {st.latency_ms:.1f} ms ({st.depth}/{st.capacity})" for st in snap.stages
        ) if snap else "no stats"  # fmt: skip
        per_image = f"{1e3 * cpu_used / made:.2f} server CPU ms/image" if made else "no CPU figure"
        figures = (
            f"{measured.images_per_s:.0f} images/s, data-wait "
            f"{stats.get('data_wait_fraction', float('nan')):.1%}, {per_image} while serving "
            f"({made} made); {'the first server' if config.servers > 1 else 'the server'}'s "
            f"stages: {stages}"
        )
        verdict(config.name, "REHEARSED" if cpu else "PASS", figures)
    return 0


def nvjpeg_alone(files: Sequence[str], seconds: float) -> str:
    """torchvision's nvJPEG decode alone, batches of 64 photos, from 1 thread and from 3 (the
    server's producers): images/s each. torchvision serializes every `decode_jpeg` call on a
    CUDA device behind one process-wide lock, so 3 threads are expected to gain nothing: this
    bounds what `--decoder nvjpeg` can serve per server process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torchvision.io import decode_jpeg

    datas = [torch.frombuffer(bytearray(Path(f).read_bytes()), dtype=torch.uint8) for f in files]
    batch = (datas * (1 + 64 // max(1, len(datas))))[:64]

    def decode_for(deadline: float) -> int:
        done = 0
        while time.monotonic() < deadline:
            decode_jpeg(batch, device="cuda")
            torch.cuda.current_stream().synchronize()
            done += len(batch)
        return done

    decode_for(time.monotonic() + 0.5)  # warm-up: the decoder's handles and buffers
    rates = []
    for threads in (1, 3):
        begun = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(decode_for, [begun + seconds / 2] * threads))
        rate = done / (time.monotonic() - begun)
        rates.append(f"{threads} thread{'s' if threads > 1 else ''} {rate:.0f} images/s")
    return ", ".join(rates) + " (torchvision.io.decode_jpeg, batches of 64, to cuda)"


def _images_made(endpoint: str) -> int:
    """The server's images_total now (0 where it does not answer)."""
    from batchwire.bench.e2e_row import server_counters

    counters = server_counters(endpoint)
    return 0 if counters is None else counters.images_total


def _run_tail(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None):
    """Run `cmd` with its output printed and kept; None if it ran past `timeout`."""
    try:
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return None
    print(run.stdout[-6000:], run.stderr[-6000:], sep="\n")
    return run


SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
#: Which kernels each tool instruments: only ours ("batchwire" in the name) where a tool judges a
#: kernel by what it does itself. Not for initcheck: a write by a kernel it does not instrument
#: is invisible to it, so with the filter every copy of torch's own results (an `.item()`) read
#: as uninitialized (7,009 errors on an H200, 2026-11-28; the one shown whole was an `.item()`).
SANITIZER_FILTER = {
    "memcheck": ("--kernel-name", "kns=batchwire"),
    "racecheck": ("--kernel-name", "kns=batchwire"),
    "synccheck": ("--kernel-name", "kns=batchwire"),
    "initcheck": (),
}
#: The op's CUDA tests: what the sanitizers run.
OP_CUDA_TESTS = ("tests/e2e/test_native.py", "tests/unit/test_native_probe.py")


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if not found and home and Path(home, "bin", "compute-sanitizer").exists():
            found = str(Path(home, "bin", "compute-sanitizer"))
    return found


def chosen_sanitizers(only: str) -> list[str]:
    """The tools gpu_check.sh's --only names (comma-separated): every one without --only, or
    for "sanitizers"; else those named "sanitizer TOOL"."""
    names = {w.strip() for w in only.split(",") if w.strip()}
    every = not names or "sanitizers" in names
    return [t for t in SANITIZER_TOOLS if every or f"sanitizer {t}" in names]


def sanitizer_summary(text: str) -> str:
    """compute-sanitizer's count ("ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY:
    ..."), not the "N errors were not printed" line that follows it past --print-limit."""
    found = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: [^\n]*", text)
    counts = [line for line in found if "not printed" not in line]
    return counts[0] if counts else "no summary"


def sanitizer_errors(text: str) -> Counter[tuple[str, str, str]]:
    """compute-sanitizer's printed errors by (what, the kernel or API call, the test's own
    frame): the tail of its output shows one backtrace, this says where all the printed ones
    were."""
    found: Counter[tuple[str, str, str]] = Counter()
    what = where = test = ""
    for line in text.splitlines():
        body = line.removeprefix("========= ")
        if not line.startswith("========= ") or not body.strip():
            continue
        if not body.startswith(" "):
            if what:
                found[(what, where, test)] += 1
            banner = "SUMMARY" in body or body.startswith(
                ("COMPUTE-SANITIZER", "Target application")
            )
            what, where, test = ("", "", "") if banner else (body.strip(), "", "")
        elif body.strip().startswith("at ") and not where:
            where = body.strip()[3:90]
        elif not test and (frame := re.search(r"Host Frame: (test_\w+ in test_\w+\.py:\d+)", body)):
            test = frame.group(1)
    if what:
        found[(what, where, test)] += 1
    return found


def step_sanitize() -> int:
    """compute-sanitizer's four tools over the op's CUDA tests; "Device not supported" (and a
    missing tool) is not available, not a failure."""
    started = time.monotonic()
    tool = _sanitizer()
    if tool is None:
        for name in SANITIZER_TOOLS:
            verdict(f"sanitizer {name}", "NOT RUN", "not available: no compute-sanitizer")
        return 0
    probe = [tool, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c",
             "import torch; assert torch.ones(64, device='cuda').sum().item() == 64"]  # fmt: skip
    run = _run_tail(probe, max(10.0, seconds_left(started)))
    if run is None or run.returncode != 0:
        text = "" if run is None else run.stdout + run.stderr
        why = "Device not supported" if "Device not supported" in text else "its probe failed"
        status = "NOT RUN" if "Device not supported" in text else "FAIL"
        for name in SANITIZER_TOOLS:
            verdict(f"sanitizer {name}", status, f"not available: {why}")
        return 0
    tools = chosen_sanitizers(os.environ.get("GPU_SANITIZERS", ""))
    for name in SANITIZER_TOOLS:
        if name not in tools:
            verdict(f"sanitizer {name}", "NOT RUN", "not selected (--only)")
    for i, name in enumerate(tools):
        share = seconds_left(started) / (len(tools) - i)
        if share < 20:
            verdict(f"sanitizer {name}", "NOT RUN", "no time left in this step's cap")
            continue
        env = dict(os.environ)
        if name in ("memcheck", "initcheck"):  # each buffer its own bounds, none recycled
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        cmd = [tool, "--tool", name, *SANITIZER_FILTER[name], "--error-exitcode", "1",
               "--print-limit", "100", sys.executable, "-m", "pytest", "-q", "-x", "-m", "cuda",
               "-p", "no:cacheprovider", *OP_CUDA_TESTS]  # fmt: skip
        t0 = time.monotonic()
        run = _run_tail(cmd, share, env)
        took = time.monotonic() - t0
        if run is not None:
            for (what, where, test), n in sanitizer_errors(run.stdout + run.stderr).most_common(8):
                print(f"{name}: {n} x {what} | {where} | {test}")
        if run is None:
            # A sanitized run is 10-100x slower: out of time says nothing about the op.
            verdict(f"sanitizer {name}", "NOT RUN", f"no time: ran past its share of {share:.0f} s")
        else:
            passed = re.search(r"(\d+) passed", run.stdout)
            figures = f"{sanitizer_summary(run.stdout + run.stderr)}, "
            figures += f"{passed.group(1) if passed else 0} tests passed, {took:.0f} s"
            verdict(f"sanitizer {name}", "PASS" if run.returncode == 0 else "FAIL", figures)
    return 0


def card_figure() -> str:
    from batchwire.bench.gpu_check import card_bandwidth

    bw = card_bandwidth()
    return "card bandwidth unknown (NVML)" if bw is None else f"card {bw / 1e9:.0f} GB/s (NVML)"


def step_kernel(data: Path | None, cpu: bool) -> int:
    """The fused op alone (bench_augment): images/s and GB/s against the card's bandwidth."""
    started = time.monotonic()
    dtypes = ("uint8",) if cpu else ("uint8", "float32")
    extra = ["--images", "64", "--repeats", "1"] if cpu else ["--repeats", "5"]
    for i, dtype in enumerate(dtypes):
        share = seconds_left(started) / (len(dtypes) - i)
        cmd = [sys.executable, "-m", "batchwire.bench.bench_augment", "--dtype", dtype, *extra]
        cmd += ["--data", str(data)] if data else []
        run = _run_tail(cmd, share)
        row = f"kernel {dtype}"
        if run is None or run.returncode != 0:
            verdict(row, "FAIL", "ran past its share" if run is None else f"exit {run.returncode}")
            continue
        if cpu:
            line = next((ln for ln in run.stdout.splitlines() if "op cpu" in ln), "")
            verdict(row, "REHEARSED", f"--cpu: {' '.join(line.split())[:120]}")
            continue
        lines = [" ".join(ln.split()) for ln in run.stdout.splitlines() if "op cuda" in ln]
        ok = any(ln.startswith("op cuda:") and "images/s" in ln for ln in lines)
        verdict(row, "PASS" if ok else "FAIL", "; ".join(lines) + f" | {card_figure()}")
    return 0


# -------------------------------------------------------------------------------- report


def read_results(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            name, status, seconds, figures = [*line.split("\t"), "", "", ""][:4]
            rows.append({"step": name, "status": status, "seconds": int(seconds or 0),
                         "figures": figures})  # fmt: skip
    return rows


def exit_code(rows: Iterable[dict[str, Any]]) -> int:
    """1 if a claim failed; else 3 if a step had no time (the check is incomplete); else 0."""
    rows = list(rows)
    if any(r["status"] == "FAIL" for r in rows):
        return 1
    if any(r["status"] == "NOT RUN" and r["figures"].startswith("no time") for r in rows):
        return 3
    return 0


def report(args: argparse.Namespace) -> int:
    rows = read_results(args.results)
    code = exit_code(rows)
    summary = {
        "mode": "cpu rehearsal (no GPU claim checked)" if args.cpu else "gpu",
        "gpu": args.gpu,
        "budget_s": args.budget,
        "elapsed_s": args.elapsed,
        "exit_code": code,
        "counts": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
        "steps": rows,
    }
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    head = ("step", "result", "s", "figures")
    table = [head, *((r["step"], r["status"], str(r["seconds"]), r["figures"]) for r in rows)]
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    text = [f"GPU check: {summary['mode']}, GPU {args.gpu}, budget {args.budget} s, "
            f"{args.elapsed} s used, exit {code}"]  # fmt: skip
    for i, t in enumerate(table):
        text.append(f"{t[0]:<{widths[0]}}  {t[1]:<{widths[1]}}  {t[2]:>{widths[2]}}  {t[3]}")
        if i == 0:
            text.append("  ".join("-" * w for w in widths) + "  -------")
    args.table.write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return code


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("gap", "rehearsal-requirements", "image-subset", "probe", "sanitize"):
        sub.add_parser(name)
    for name in ("imports", "build", "compare", "serve", "study", "kernel", "pytest"):
        p = sub.add_parser(name)
        p.add_argument("--cpu", action="store_true")
        if name in ("compare", "serve", "study", "kernel"):
            p.add_argument("--data", type=Path)
            p.add_argument("--images", type=int, default=256 if name == "compare" else 4096)
        if name == "pytest":
            p.add_argument("name")
            p.add_argument("args", nargs="*")
    rep = sub.add_parser("report")
    rep.add_argument("--results", type=Path, required=True)
    rep.add_argument("--json", type=Path, required=True)
    rep.add_argument("--table", type=Path, required=True)
    rep.add_argument("--cpu", action="store_true")
    rep.add_argument("--gpu", default="none")
    rep.add_argument("--budget", type=int, default=0)
    rep.add_argument("--elapsed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "gap":
        gap, kit = image_gap(), kit_requirements()
        print("\n".join(f"{n}: {kit.get(n, 'NOT IN THE KIT')}" for n in gap))
        uncovered = [n for n in gap if n not in kit]
        if uncovered:
            print(f"{KIT_REQUIREMENTS.name} lacks: {', '.join(uncovered)}", file=sys.stderr)
        return 1 if uncovered else 0
    if args.command == "rehearsal-requirements":
        print("\n".join(rehearsal_requirements()))
        return 0
    if args.command == "image-subset":
        extra = installed_outside_image()
        print("\n".join(extra) or "every installed distribution is one of the image's")
        return 1 if extra else 0
    if args.command == "report":
        return report(args)
    steps = {
        "imports": lambda: step_imports(args.cpu),
        "probe": step_probe,
        "sanitize": step_sanitize,
        "build": lambda: step_build(args.cpu),
        "pytest": lambda: step_pytest(args.name, args.cpu, args.args),
        "compare": lambda: step_compare(args.data, args.cpu, args.images),
        "serve": lambda: step_serve(args.data, args.cpu, args.images),
        "study": lambda: step_study(args.data, args.cpu, args.images),
        "kernel": lambda: step_kernel(args.data, args.cpu),
    }
    return steps[args.command]()


if __name__ == "__main__":
    sys.exit(main())
