"""Builds the native op just in time with `torch.utils.cpp_extension.load`, cached on disk.

Why JIT rather than setup.py: pip's isolated build environment would install its own, unpinned
torch to build against (gigabytes, and possibly not the ABI of the torch that runs it). Built here,
the extension compiles against the torch that imports it, from the same sources for editable
installs, wheels, Docker images (`python -m batchwire.native build` at image build time) and
CPU-only or CUDA machines. The build folder is keyed by a hash of the sources, torch version and
flags, so a changed source or torch rebuilds and an unchanged one loads in milliseconds.

Two extensions share this machinery (`ExtensionSpec`): the fused augment op (`build()`), and the
optional region-of-interest JPEG decoder (`build_jpeg_roi()`), a separate pybind11 module so
that a machine without the libjpeg headers still builds the augment op.

CUDA is compiled iff `BATCHWIRE_CUDA=1`, or `BATCHWIRE_CUDA` is unset and torch is a CUDA build
and a CUDA toolkit (nvcc) is found. A GPU is never probed: a Docker build has none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("batchwire.native")

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "batchwire_native"
CPU_SOURCES = ("augment_op.cpp", "augment_cpu.cpp")
CUDA_SOURCES = ("augment_kernel.cu", "augment_cuda.cpp")
CPU_HEADERS = ("filter_math.h", "hue_math.h", "augment_op.h")
CUDA_HEADERS = ("augment_kernel.cuh", "augment_desc.h", "augment_pixel.h")
# -O3 but no -march=native: a build may be carried to other machines (Docker images, clusters);
# the hot loops carry their own AVX2 clones instead. -fno-trapping-math: nothing reads floating-
# point exception flags, and without it GCC keeps the selects of the hue loop as branches and
# leaves it scalar (values are unchanged: no reassociation, no fast-math).
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)
CUDA_CFLAGS = ("-O3",)

JPEG_ROI_NAME = "batchwire_jpeg_roi"
JPEG_ROI_SOURCES = ("jpeg_roi.cpp",)
JPEG_ROI_CFLAGS = ("-O2",)
JPEG_ROI_LDFLAGS = ("-ljpeg",)


@dataclass(frozen=True)
class ExtensionSpec:
    """One JIT-built extension: its module name, files and flags.

    `python_module`: a pybind11 module that the build returns, rather than a library that
    registers torch ops. `system_header`: a header from a system package that the sources
    include, checked before compiling so that its absence is named with its fix, not buried in
    compiler output; `system_package` says what to install.
    """

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    python_module: bool = False
    system_header: str | None = None
    system_package: str = ""


def augment_spec() -> ExtensionSpec:
    """The fused augment op, from the module's constants as they are now (tests patch them)."""
    return ExtensionSpec(NAME, CPU_SOURCES, CPU_HEADERS, CFLAGS, LDFLAGS)


def jpeg_roi_spec() -> ExtensionSpec:
    """The region-of-interest JPEG decoder: libjpeg-turbo's libjpeg API (jpeglib.h, -ljpeg)."""
    return ExtensionSpec(
        JPEG_ROI_NAME,
        JPEG_ROI_SOURCES,
        (),
        JPEG_ROI_CFLAGS,
        JPEG_ROI_LDFLAGS,
        python_module=True,
        system_header="jpeglib.h",
        system_package="libjpeg62-turbo-dev (Debian; libjpeg-turbo8-dev on Ubuntu)",
    )


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded; the message names the cause and the fix."""


@dataclass(frozen=True)
class BuildPlan:
    """What would be built, where, and why (CUDA or not)."""

    with_cuda: bool
    cuda_reason: str
    build_dir: Path
    sources: tuple[Path, ...]
    spec: ExtensionSpec

    @property
    def library(self) -> Path:
        return self.build_dir / f"{self.spec.name}.so"

    @property
    def kind(self) -> str:
        return "CPU+CUDA" if self.with_cuda else "CPU"


@dataclass(frozen=True)
class BuildResult:
    """A loaded build: `compiled` says whether this call compiled it, `seconds` how long it took;
    `module` is the imported module of a `python_module` extension (None for the op library)."""

    plan: BuildPlan
    compiled: bool
    seconds: float
    module: object | None = None


def _cuda_home() -> str | None:
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


def cuda_decision() -> tuple[bool, str]:
    """Whether to compile the CUDA kernel, and the reason in words (for `info` and errors)."""
    switch = os.environ.get("BATCHWIRE_CUDA", "").strip()
    if switch == "0":
        return False, "BATCHWIRE_CUDA=0"
    if switch not in ("", "1"):
        raise NativeBuildError(f"BATCHWIRE_CUDA must be 0 or 1, got {switch!r}")
    if torch.version.cuda is None:
        if switch == "1":
            raise NativeBuildError(
                f"BATCHWIRE_CUDA=1 but torch {torch.__version__} is a CPU-only build: install a "
                "CUDA build of torch, or set BATCHWIRE_CUDA=0"
            )
        return False, f"torch {torch.__version__} is a CPU-only build"
    if _cuda_home() is None:
        if switch == "1":
            raise NativeBuildError(
                f"BATCHWIRE_CUDA=1 but no CUDA toolkit was found (nvcc): install the CUDA "
                f"toolkit {torch.version.cuda} and set CUDA_HOME, or set BATCHWIRE_CUDA=0"
            )
        return False, "no CUDA toolkit found (nvcc / CUDA_HOME)"
    why = "BATCHWIRE_CUDA=1" if switch == "1" else "CUDA torch and toolkit found"
    return True, f"{why} (torch CUDA {torch.version.cuda}, toolkit {_cuda_home()})"


def _cache_root() -> Path:
    override = os.environ.get("BATCHWIRE_NATIVE_CACHE")
    if override:
        return Path(override).expanduser()
    try:
        from batchwire.pipeline.paths import cache_dir
    except ImportError:  # the pipeline package is optional for the op itself
        env = os.environ.get("BATCHWIRE_CACHE")
        return (Path(env).expanduser() if env else Path.home() / ".cache" / "batchwire") / "native"
    return cache_dir() / "native"


def _fingerprint(spec: ExtensionSpec, with_cuda: bool, files: list[Path]) -> str:
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        str(torch.version.cuda),
        sys.version.split()[0],
        repr((spec.cflags, spec.ldflags, CUDA_CFLAGS, with_cuda)),
        os.environ.get("CXX", ""),
        os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else "",
    ):
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def make_plan(spec: ExtensionSpec | None = None) -> BuildPlan:
    """Decides CUDA or not and the cache folder for this torch and these sources (the augment
    op's unless `spec` names another extension; only the augment op has CUDA sources)."""
    if spec is None:
        spec = augment_spec()
        with_cuda, reason = cuda_decision()
    else:
        with_cuda, reason = False, "CPU-only extension"
    names = spec.sources + (CUDA_SOURCES if with_cuda else ())
    headers = spec.headers + (CUDA_HEADERS if with_cuda else ())
    sources = tuple(CSRC / n for n in names)
    digest = _fingerprint(spec, with_cuda, [*sources, *(CSRC / n for n in headers)])
    return BuildPlan(with_cuda, reason, _cache_root() / digest, sources, spec)


def _ensure_ninja_on_path() -> None:
    """The `ninja` pip package puts its binary next to the venv's python, which is on PATH only
    when the venv is activated; torch looks for `ninja` on PATH."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def missing_tools(plan: BuildPlan) -> list[str]:
    """Each missing build tool with what to install; empty when the build can be attempted."""
    problems = []
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        problems.append(
            f"no C++ compiler ({cxx!r} is not on PATH): install one, e.g. `apt-get install g++`, "
            "or point CXX at it"
        )
    _ensure_ninja_on_path()
    if shutil.which("ninja") is None:
        problems.append("ninja is missing: `pip install ninja`")
    if plan.with_cuda:
        home = _cuda_home()
        if home is None or not (Path(home) / "bin" / "nvcc").exists():
            problems.append(
                f"nvcc is missing (CUDA_HOME={home}): install the CUDA toolkit "
                f"{torch.version.cuda}, or set BATCHWIRE_CUDA=0 for a CPU-only build"
            )
    return problems


def missing_system_header(plan: BuildPlan) -> str | None:
    """The missing system header of `plan` with what to install, or None (asks the compiler's
    preprocessor, so it runs only before a compile)."""
    spec = plan.spec
    if spec.system_header is None:
        return None
    cxx = os.environ.get("CXX", "c++")
    source = f"#include <cstdio>\n#include <{spec.system_header}>\n"
    try:
        probe = subprocess.run(
            [cxx, "-E", "-x", "c++", "-", "-o", os.devnull],
            input=source,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {cxx!r} to look for <{spec.system_header}>: {exc}"
    if probe.returncode == 0:
        return None
    return (
        f"<{spec.system_header}> is missing: install {spec.system_package}, e.g. "
        f"`apt-get install {spec.system_package.split()[0]}`"
    )


# torch serialises builds of one folder with a `lock` file; a build killed midway leaves it
# behind and every later load would wait on it forever.
STALE_LOCK_S = 900.0


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("batchwire.native: removing a build lock left %.0f s ago: %s", age, lock)
        lock.unlink(missing_ok=True)


def _compile_and_load(plan: BuildPlan, verbose: bool) -> object | None:
    from torch.utils import cpp_extension

    plan.build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(plan.build_dir)
    try:
        return cpp_extension.load(
            name=plan.spec.name,
            sources=[str(s) for s in plan.sources],
            extra_cflags=list(plan.spec.cflags),
            extra_ldflags=list(plan.spec.ldflags),
            extra_cuda_cflags=list(CUDA_CFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=str(plan.build_dir),
            with_cuda=plan.with_cuda,
            is_python_module=plan.spec.python_module,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        detail = str(exc).strip()
        if len(detail) > 4000:
            detail = "...\n" + detail[-4000:]
        raise NativeBuildError(
            f"batchwire.native: building the {plan.kind} extension {plan.spec.name} in "
            f"{plan.build_dir} failed. Compiler output follows; `python -m batchwire.native "
            "info` lists the toolchain, and BATCHWIRE_CUDA=0 builds without CUDA.\n" + detail
        ) from exc


_lock = threading.Lock()
_results: dict[str, BuildResult] = {}


def build_extension(spec: ExtensionSpec | None = None, verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads an extension (the augment op by default) into this
    process, once per process; raises NativeBuildError."""
    with _lock:
        plan = make_plan(spec)
        done = _results.get(plan.spec.name)
        if done is None:
            done = _results[plan.spec.name] = _build_and_load(plan, verbose)
        return done


def _build_and_load(plan: BuildPlan, verbose: bool) -> BuildResult:
    what = f"{plan.kind} extension {plan.spec.name}"
    problems = missing_tools(plan)
    compiling = not plan.library.exists()
    if compiling and not problems:
        header = missing_system_header(plan)
        problems += [header] if header else []
    if problems:
        raise NativeBuildError(f"batchwire.native: cannot build the {what}: " + "; ".join(problems))
    if compiling:
        log.warning(
            "batchwire.native: compiling the %s into %s (first use, cached afterwards)...",
            what,
            plan.build_dir,
        )
    start = time.perf_counter()
    module = _compile_and_load(plan, verbose)
    seconds = time.perf_counter() - start
    if compiling:
        log.warning("batchwire.native: compiled %s in %.1f s", plan.spec.name, seconds)
    return BuildResult(plan, compiling, seconds, module if plan.spec.python_module else None)


def build(verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads the augment op into this process, once per process."""
    return build_extension(None, verbose)


def build_jpeg_roi(verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads the region-of-interest JPEG decoder; `.module` holds it."""
    return build_extension(jpeg_roi_spec(), verbose)
