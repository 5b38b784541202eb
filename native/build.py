"""Builds the native op just in time with `torch.utils.cpp_extension.load`, cached on disk.

Why JIT rather than setup.py: pip's isolated build environment would install its own, unpinned
torch to build against (gigabytes, and possibly not the ABI of the torch that runs it). Built here,
the extension compiles against the torch that imports it, from the same sources for editable
installs, wheels, Docker images (`python -m batchwire.native build` at image build time) and
CPU-only or CUDA machines. The build folder is keyed by a hash of the sources, torch version and
flags, so a changed source or torch rebuilds and an unchanged one loads in milliseconds.

CUDA is compiled iff `BATCHWIRE_CUDA=1`, or `BATCHWIRE_CUDA` is unset and torch is a CUDA build
and a CUDA toolkit (nvcc) is found. A GPU is never probed: a Docker build has none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
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
CPU_HEADERS = ("filter_math.h", "augment_op.h")
CUDA_HEADERS = ("augment_kernel.cuh", "augment_desc.h", "augment_pixel.h")
# -O3 but no -march=native: a build may be carried to other machines (Docker images, clusters);
# the hot loops carry their own AVX2 clones instead.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CUDA_CFLAGS = ("-O3",)


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded; the message names the cause and the fix."""


@dataclass(frozen=True)
class BuildPlan:
    """What would be built, where, and why (CUDA or not)."""

    with_cuda: bool
    cuda_reason: str
    build_dir: Path
    sources: tuple[Path, ...]

    @property
    def library(self) -> Path:
        return self.build_dir / f"{NAME}.so"

    @property
    def kind(self) -> str:
        return "CPU+CUDA" if self.with_cuda else "CPU"


@dataclass(frozen=True)
class BuildResult:
    """A loaded build: `compiled` says whether this call compiled it, `seconds` how long it took."""

    plan: BuildPlan
    compiled: bool
    seconds: float


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


def _fingerprint(with_cuda: bool, files: list[Path]) -> str:
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        str(torch.version.cuda),
        sys.version.split()[0],
        repr((CFLAGS, LDFLAGS, CUDA_CFLAGS, with_cuda)),
        os.environ.get("CXX", ""),
        os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else "",
    ):
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def make_plan() -> BuildPlan:
    """Decides CUDA or not and the cache folder for this torch and these sources."""
    with_cuda, reason = cuda_decision()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    headers = CPU_HEADERS + (CUDA_HEADERS if with_cuda else ())
    sources = tuple(CSRC / n for n in names)
    digest = _fingerprint(with_cuda, [*sources, *(CSRC / n for n in headers)])
    return BuildPlan(with_cuda, reason, _cache_root() / digest, sources)


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


def _compile_and_load(plan: BuildPlan, verbose: bool) -> None:
    from torch.utils import cpp_extension

    plan.build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(plan.build_dir)
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in plan.sources],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_cuda_cflags=list(CUDA_CFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=str(plan.build_dir),
            with_cuda=plan.with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        detail = str(exc).strip()
        if len(detail) > 4000:
            detail = "...\n" + detail[-4000:]
        raise NativeBuildError(
            f"batchwire.native: building the {plan.kind} extension in {plan.build_dir} failed. "
            "Compiler output follows; `python -m batchwire.native info` lists the toolchain, and "
            "BATCHWIRE_CUDA=0 builds without CUDA.\n" + detail
        ) from exc


_lock = threading.Lock()
_result: BuildResult | None = None


def build(verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads the extension into this process, once per process."""
    global _result
    with _lock:
        if _result is not None:
            return _result
        plan = make_plan()
        problems = missing_tools(plan)
        if problems:
            raise NativeBuildError(
                f"batchwire.native: cannot build the {plan.kind} extension: " + "; ".join(problems)
            )
        compiling = not plan.library.exists()
        if compiling:
            log.warning(
                "batchwire.native: compiling the %s extension into %s (first use, cached "
                "afterwards)...",
                plan.kind,
                plan.build_dir,
            )
        start = time.perf_counter()
        _compile_and_load(plan, verbose)
        seconds = time.perf_counter() - start
        if compiling:
            log.warning("batchwire.native: compiled in %.1f s", seconds)
        _result = BuildResult(plan, compiling, seconds)
        return _result
