"""Builds the native op just in time with `torch.utils.cpp_extension`, cached on disk.

Why JIT rather than setup.py: pip's isolated build environment would install its own, unpinned
torch to build against (gigabytes, and possibly not the ABI of the torch that runs it). Built here,
the extension compiles against the torch that imports it, from the same sources for editable
installs, wheels, Docker images (`python -m batchwire.native build` at image build time) and
CPU-only or CUDA machines.

The cache. Each build lives in a folder named by a key over everything the library depends on
(`Toolchain`: torch's version and build, torch's and nvcc's CUDA versions, the Python ABI, the
C++ compiler's path and version, the flags and CUDA architectures) and the sources' contents, so
two environments sharing one cache never rebuild each other's library. Finding the folder costs a
few `stat` calls: the sources' digest (and the compiler's and nvcc's versions) are remembered
on disk under a stamp of (size, mtime, ctime, inode), and only a changed stamp rereads them. A
folder whose build finished holds a `built` marker naming the library, which is then loaded
directly (no hashing, no ninja).

Builds of one folder are serialised by a lock file (`build.lock`) that records its holder's pid,
host, process start time and since when; a holder that is no longer running (same host) is taken
over at once, one on another host when its heartbeat stops, and a live one is waited on with a
log line saying who holds it. Every failure is a `NativeBuildError` whose message names the fix.

Two extensions share this machinery (`ExtensionSpec`): the fused augment op (`build()`), and the
optional region-of-interest JPEG decoder (`build_jpeg_roi()`), a separate pybind11 module so
that a machine without the libjpeg headers still builds the augment op.

CUDA is compiled iff `BATCHWIRE_CUDA=1`, or `BATCHWIRE_CUDA` is unset and torch is a CUDA build
and a CUDA toolkit (nvcc) of the same major version is found (`decide_cuda`). The architectures
are always an explicit list, and that list is part of the key (`cuda_arch_list`):
TORCH_CUDA_ARCH_LIST when set, else the compute capabilities of this host's GPUs (read through
NVML, which opens no CUDA context: `gpu_capabilities`), else the ones torch was built for, else
`DEFAULT_CUDA_ARCHS`; the newest listed architecture also gets PTX. Why explicit: the cache
usually lives in a home folder shared by every host of a cluster, and a key that said only
"detected" handed an H100 node's library to an A100 node, where every launch failed with "no
kernel image". Unless `BATCHWIRE_CUDA=1`, a failed CUDA build falls back to a CPU-only one with
one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
# Architectures for a CUDA build on a machine without a visible GPU when neither
# TORCH_CUDA_ARCH_LIST nor torch's own list says (A100, H100), with PTX for the newest so that a
# newer GPU (Blackwell: 10.x, 12.x) JIT-compiles the kernel from PTX instead of finding no image.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"

JPEG_ROI_NAME = "batchwire_jpeg_roi"
JPEG_ROI_SOURCES = ("jpeg_roi.cpp", "jpeg_restart.cpp", "jpeg_transcode.cpp")
JPEG_ROI_HEADERS = ("jpeg_strict.h", "jpeg_restart.h", "jpeg_index.h", "jpeg_fast_huffman.h")
JPEG_ROI_CFLAGS = ("-O2",)
JPEG_ROI_LDFLAGS = ("-ljpeg",)

CACHE_ENV = "BATCHWIRE_CACHE"  # batchwire's whole cache; builds go in its native/ folder
NATIVE_CACHE_ENV = "BATCHWIRE_NATIVE_CACHE"  # the build cache alone
CUDA_ENV = "BATCHWIRE_CUDA"
BUILT_MARKER = "built"
FAILED_MARKER = "failed"  # a CUDA build's error, so later processes go CPU-only at once
LOCK_NAME = "build.lock"


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
    """The region-of-interest JPEG decoder and the lossless transcoder of `pipeline-prepare`:
    libjpeg-turbo's libjpeg API (jpeglib.h, -ljpeg), one module."""
    return ExtensionSpec(
        JPEG_ROI_NAME,
        JPEG_ROI_SOURCES,
        JPEG_ROI_HEADERS,
        JPEG_ROI_CFLAGS,
        JPEG_ROI_LDFLAGS,
        python_module=True,
        system_header="jpeglib.h",
        system_package="libjpeg62-turbo-dev (Debian; libjpeg-turbo8-dev on Ubuntu)",
    )


class NativeBuildError(RuntimeError):
    """The extension could not be built or loaded; the message names the cause and the fix."""


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


# --- where builds go -------------------------------------------------------------------------


def cache_root() -> Path:
    """The build cache: `BATCHWIRE_NATIVE_CACHE`, else the `native` folder of batchwire's cache
    (`BATCHWIRE_CACHE`, else `$XDG_CACHE_HOME/batchwire`, else `~/.cache/batchwire`). Read on
    every call, so tests and tools can redirect it per process; created when a build needs it."""
    override = os.environ.get(NATIVE_CACHE_ENV)
    if override:
        return Path(override).expanduser()
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "batchwire"
    return root.resolve() / "native"


def _stamp(paths: Sequence[Path]) -> str:
    """What `stat` says of `paths`: any write, replacement or copy changes it."""
    parts = []
    for p in paths:
        try:
            s = p.stat()
        except OSError:
            parts.append(f"{p}:missing")
            continue
        parts.append(f"{p}:{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}:{s.st_ino}")
    return "\n".join(parts)


def _remembered(kind: str, stamp: str, compute: Callable[[], str]) -> str:
    """`compute()`, remembered on disk under `stamp` (e.g. a digest of files whose stat is the
    stamp); recomputed when the stamp changes or the cache cannot be written."""
    memo = cache_root() / "stamps" / hashlib.sha256(f"{kind}\0{stamp}".encode()).hexdigest()[:32]
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return memo.read_text()
    value = compute()
    if value.startswith("unknown"):  # a failure to look: ask again next time
        return value
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, memo)
    return value


def sources_digest(files: Sequence[Path]) -> str:
    """A digest of the files' names and contents; read only when their stamp changed."""

    def digest() -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()

    return _remembered("sources", _stamp(files), digest)


def _tool_version(kind: str, path: str) -> str:
    """The first line of `path --version` (or nvcc's release line), remembered per binary."""

    def run() -> str:
        try:
            out = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown ({type(exc).__name__})"
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        if kind == "nvcc":
            return next((line for line in lines if "release" in line), "unknown")
        return lines[0] if lines else "unknown"

    resolved = Path(path).resolve()
    return _remembered(kind, f"{path}\0{_stamp([resolved])}", run)


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def compiler_identity(cxx: str | None = None) -> str:
    """The C++ compiler torch will use, as 'path (version)', or a 'missing' note."""
    cxx = cxx or _cxx()
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx} (missing)"
    return f"{path} ({_tool_version('cxx', path)})"


def _cuda_home() -> str | None:
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


def _nvcc_path() -> str | None:
    home = _cuda_home()
    if home is None:
        return None
    nvcc = Path(home) / "bin" / "nvcc"
    return str(nvcc) if nvcc.exists() else None


def parse_nvcc_version(text: str) -> str | None:
    """'13.0' from nvcc's 'Cuda compilation tools, release 13.0, V13.0.88', else None."""
    found = re.search(r"release (\d+)\.(\d+)", text)
    return f"{found[1]}.{found[2]}" if found else None


def nvcc_version() -> str | None:
    """The CUDA toolkit's version ('13.0') by its nvcc, or None where there is none."""
    nvcc = _nvcc_path()
    return None if nvcc is None else parse_nvcc_version(_tool_version("nvcc", nvcc))


# --- the CUDA decision -----------------------------------------------------------------------


@dataclass(frozen=True)
class CudaDecision:
    """Whether to compile the CUDA kernel and why; `warning`: why a CUDA torch builds CPU-only
    (logged once)."""

    with_cuda: bool
    reason: str
    warning: str | None = None


def _major(version: str) -> str:
    return version.split(".")[0]


def decide_cuda(
    switch: str,
    torch_version: str,
    torch_cuda: str | None,
    cuda_home: str | None,
    nvcc: str | None,
) -> CudaDecision:
    """The CUDA decision from its inputs: `switch` is BATCHWIRE_CUDA ('' when unset),
    `torch_cuda` torch.version.cuda, `nvcc` the toolkit's version ('13.0'; None when no nvcc
    runs). Raises NativeBuildError for an invalid switch, or for BATCHWIRE_CUDA=1 that cannot
    be honoured."""
    switch = switch.strip()
    if switch == "0":
        return CudaDecision(False, "BATCHWIRE_CUDA=0")
    if switch not in ("", "1"):
        raise NativeBuildError(f"BATCHWIRE_CUDA must be 0 or 1, got {switch!r}")
    forced = switch == "1"
    if torch_cuda is None:
        if forced:
            raise NativeBuildError(
                f"BATCHWIRE_CUDA=1 but torch {torch_version} is a CPU-only build: install a "
                "CUDA build of torch, or set BATCHWIRE_CUDA=0"
            )
        return CudaDecision(False, f"torch {torch_version} is a CPU-only build")
    if cuda_home is None or nvcc is None:
        where = "no CUDA toolkit found (nvcc / CUDA_HOME)"
        if cuda_home is not None:
            where = f"no working nvcc in CUDA_HOME={cuda_home}"
        if forced:
            raise NativeBuildError(
                f"BATCHWIRE_CUDA=1 but {where}: install the CUDA toolkit {torch_cuda} and set "
                "CUDA_HOME, or set BATCHWIRE_CUDA=0"
            )
        return CudaDecision(False, where)
    if _major(nvcc) != _major(torch_cuda):
        problem = (
            f"the CUDA toolkit at {cuda_home} is CUDA {nvcc} but torch {torch_version} was built "
            f"for CUDA {torch_cuda} (the major versions must match)"
        )
        fix = (
            f"install a CUDA {_major(torch_cuda)}.x toolkit and point CUDA_HOME at it, or a torch "
            f"built for CUDA {_major(nvcc)}"
        )
        if forced:
            raise NativeBuildError(
                f"BATCHWIRE_CUDA=1 but {problem}: {fix}, or set BATCHWIRE_CUDA=0"
            )
        return CudaDecision(
            False,
            f"CPU-only: {problem}",
            f"batchwire.native: building the op without CUDA: {problem}. For the CUDA kernel, "
            f"{fix}; BATCHWIRE_CUDA=0 silences this.",
        )
    why = "BATCHWIRE_CUDA=1" if forced else "CUDA torch and toolkit found"
    return CudaDecision(True, f"{why} (torch CUDA {torch_cuda}, toolkit {nvcc} at {cuda_home})")


def toolkit_headers_problem(cuda_home: str | None) -> str | None:
    """Why `cuda_home` is no toolkit to build against (it lacks include/cuda_runtime.h), or None.
    Unless CUDA_HOME is set, torch takes the folder above the `nvcc` on PATH, which is wrong when
    that nvcc is a wrapper script (e.g. /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc):
    nvcc then runs, but the host compiler finds no CUDA headers and the link no libcudart."""
    if cuda_home is None or (Path(cuda_home) / "include" / "cuda_runtime.h").exists():
        return None
    return (
        f"CUDA_HOME={cuda_home} holds no include/cuda_runtime.h (without CUDA_HOME, torch takes "
        "the folder above the nvcc on PATH, which may be a wrapper script): set CUDA_HOME to the "
        "CUDA toolkit's folder, e.g. /usr/local/cuda"
    )


def current_cuda_decision() -> CudaDecision:
    """`decide_cuda` for this process: the switch, this torch and the toolkit found (nvcc runs
    only for a CUDA torch), then whether that toolkit has its headers. Logs the decision's
    warning once."""
    switch = os.environ.get(CUDA_ENV, "")
    torch_cuda = torch.version.cuda
    wants_toolkit = torch_cuda is not None and switch.strip() in ("", "1")
    home = _cuda_home() if wants_toolkit else None
    decision = decide_cuda(
        switch,
        torch.__version__,
        torch_cuda,
        home,
        nvcc_version() if wants_toolkit else None,
    )
    problem = toolkit_headers_problem(home) if decision.with_cuda else None
    if problem and switch.strip() == "1":
        raise NativeBuildError(f"BATCHWIRE_CUDA=1 but {problem}, or set BATCHWIRE_CUDA=0")
    if problem:
        decision = CudaDecision(
            False,
            f"CPU-only: {problem}",
            f"batchwire.native: building the op without CUDA: {problem}. BATCHWIRE_CUDA=0 "
            "silences this.",
        )
    if decision.warning:
        _warn_once(decision.warning)
    return decision


def _arch_name(arch: str) -> str | None:
    """torch.cuda.get_arch_list()'s 'sm_90' / 'sm_100a' as TORCH_CUDA_ARCH_LIST's '9.0' /
    '10.0a'; None for other entries (compute_XX)."""
    found = re.fullmatch(r"sm_(\d+)(\d)([a-z]?)", arch)
    return f"{found[1]}.{found[2]}{found[3]}" if found else None


def capability_arch_list(capabilities: Sequence[tuple[int, int]]) -> str | None:
    """TORCH_CUDA_ARCH_LIST for GPUs of these compute capabilities: each distinct one once,
    oldest first, the newest also as PTX (as torch's own detection does); None for none."""
    names = [f"{major}.{minor}" for major, minor in sorted(set(capabilities))]
    if not names:
        return None
    return ";".join([*names[:-1], names[-1] + "+PTX"])


def cuda_arch_list(
    env_value: str | None,
    capabilities: Sequence[tuple[int, int]],
    torch_arches: Sequence[str],
) -> str:
    """TORCH_CUDA_ARCH_LIST for a CUDA build, never None, so the key names what is compiled:
    the variable when set; else the GPUs' `capabilities` (`capability_arch_list`); else
    torch's own architectures (`torch_arches`, as torch.cuda.get_arch_list() gives them, the
    newest also as PTX); else DEFAULT_CUDA_ARCHS. Pure: the detection is the caller's
    (`gpu_capabilities`), so tests give any capability list."""
    if env_value and env_value.strip():
        return env_value.strip()
    detected = capability_arch_list(capabilities)
    if detected is not None:
        return detected
    names = [n for n in map(_arch_name, torch_arches) if n]
    if not names:
        return DEFAULT_CUDA_ARCHS
    return ";".join([*names[:-1], names[-1] + "+PTX"])


def _visible_gpus() -> int:
    """Counted through NVML where it can be (no CUDA context, fork stays safe); 0 on error."""
    try:
        return torch.cuda.device_count()
    except Exception:
        return 0


@contextlib.contextmanager
def nvml_session() -> Iterator[ctypes.CDLL | None]:
    """NVML (libnvidia-ml, the driver's management library) initialised for the block and shut
    down after it; None where the library does not load or start. NVML opens no CUDA context,
    so a process that forks later stays safe. The one place that loads it (the build's GPU
    list here, the card's memory bandwidth in `bench.gpu_check`)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        yield None
        return
    if nvml.nvmlInit_v2() != 0:
        yield None
        return
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _nvml_capabilities() -> list[tuple[int, int]] | None:
    """Compute capabilities of every GPU of this host through NVML, or None where NVML cannot
    say. NVML ignores CUDA_VISIBLE_DEVICES, so the list may hold more GPUs than this process
    sees (a build for all of them serves every one)."""
    with nvml_session() as nvml:
        if nvml is None:
            return None
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        found = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0:
                return None
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            rc = nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            )
            if rc != 0:
                return None
            found.append((major.value, minor.value))
        return found


def gpu_capabilities() -> list[tuple[int, int]]:
    """The compute capabilities to build for on this host: none without a visible GPU; else
    NVML's list of the host's GPUs; where NVML cannot say, torch's per visible device (this
    initialises CUDA in the process, as torch's own build-time detection would)."""
    if _visible_gpus() == 0:
        return []
    found = _nvml_capabilities()
    if found:
        return found
    try:
        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


# --- the key ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolchain:
    """Everything other than the sources that the built library depends on."""

    torch_version: str
    torch_build: str  # torch's git revision and C++ ABI: two builds of one version differ here
    torch_cuda: str | None
    python_abi: str
    compiler: str  # 'path (version)'
    nvcc: str | None  # 'path (release line)' for CUDA builds
    flags: tuple[str, ...]  # compile/link flags, the CUDA switch and architectures


def cache_key(toolchain: Toolchain, sources: str) -> str:
    """The build folder's name for a toolchain and a sources digest."""
    h = hashlib.sha256(repr((toolchain, sources)).encode())
    return h.hexdigest()[:16]


def python_abi() -> str:
    return f"{sys.implementation.cache_tag}:{sysconfig.get_config_var('SOABI')}"


def current_toolchain(spec: ExtensionSpec, with_cuda: bool, arch_list: str | None) -> Toolchain:
    torch_build = f"{torch.version.git_version}:cxx11abi={torch.compiled_with_cxx11_abi()}"
    nvcc = None
    if with_cuda:
        path = _nvcc_path()
        nvcc = f"{path} ({_tool_version('nvcc', path)})" if path else "missing"
    flags = (
        *spec.cflags,
        "|",
        *spec.ldflags,
        "|",
        *(CUDA_CFLAGS if with_cuda else ()),
        f"cuda={with_cuda}",
        f"archs={arch_list}" if with_cuda else "",
    )
    return Toolchain(
        torch.__version__,
        torch_build,
        torch.version.cuda,
        python_abi(),
        compiler_identity(),
        nvcc,
        flags,
    )


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """What would be built, where, and why (CUDA or not)."""

    with_cuda: bool
    cuda_reason: str
    build_dir: Path
    sources: tuple[Path, ...]
    spec: ExtensionSpec
    toolchain: Toolchain
    arch_list: str | None = None  # TORCH_CUDA_ARCH_LIST for a CUDA build (always explicit)

    @property
    def marker(self) -> Path:
        return self.build_dir / BUILT_MARKER

    @property
    def library(self) -> Path:
        """The built library (the marker names it: torch may version the file name)."""
        try:
            name = json.loads(self.marker.read_text())["library"]
        except (OSError, ValueError, KeyError, TypeError):
            name = f"{self.spec.name}.so"
        return self.build_dir / name

    @property
    def built(self) -> bool:
        return self.marker.exists() and self.library.exists()

    @property
    def kind(self) -> str:
        return "CPU+CUDA" if self.with_cuda else "CPU"


def make_plan(
    spec: ExtensionSpec | None = None,
    cuda: CudaDecision | None = None,
    capabilities: Callable[[], Sequence[tuple[int, int]]] = gpu_capabilities,
) -> BuildPlan:
    """Decides CUDA or not and the cache folder for this toolchain and these sources (the
    augment op's unless `spec` names another extension; only the augment op has CUDA sources).
    `cuda` overrides the decision (the CPU-only retry); `capabilities` detects the GPUs to build
    for (injectable: tests plan for any GPUs on a machine without one). Costs `stat` calls, not
    hashing, while the sources are unchanged."""
    if spec is None:
        spec = augment_spec()
        if cuda is None:
            cuda = current_cuda_decision()
    elif cuda is None or spec.name != NAME:
        cuda = CudaDecision(False, "CPU-only extension")
    names = spec.sources + (CUDA_SOURCES if cuda.with_cuda else ())
    headers = spec.headers + (CUDA_HEADERS if cuda.with_cuda else ())
    sources = tuple(CSRC / n for n in names)
    arch_list = None
    if cuda.with_cuda:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST")
        arch_list = cuda_arch_list(
            env,
            () if env and env.strip() else capabilities(),
            torch.cuda.get_arch_list(),
        )
    toolchain = current_toolchain(spec, cuda.with_cuda, arch_list)
    digest = sources_digest([*sources, *(CSRC / n for n in headers)])
    key = cache_key(toolchain, digest)
    return BuildPlan(
        cuda.with_cuda, cuda.reason, cache_root() / key, sources, spec, toolchain, arch_list
    )


# --- tools -----------------------------------------------------------------------------------


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
    cxx = _cxx()
    if shutil.which(cxx) is None:
        problems.append(
            f"no C++ compiler ({cxx!r} is not on PATH): install one, e.g. `apt-get install g++`, "
            "or point CXX at it"
        )
    _ensure_ninja_on_path()
    if shutil.which("ninja") is None:
        problems.append("ninja is missing: `pip install ninja`")
    if plan.with_cuda and _nvcc_path() is None:
        problems.append(
            f"nvcc is missing (CUDA_HOME={_cuda_home()}): install the CUDA toolkit "
            f"{torch.version.cuda}, or set BATCHWIRE_CUDA=0 for a CPU-only build"
        )
    return problems


def missing_system_header(plan: BuildPlan) -> str | None:
    """The missing system header of `plan` with what to install, or None (asks the compiler's
    preprocessor, so it runs only before a compile)."""
    spec = plan.spec
    if spec.system_header is None:
        return None
    cxx = _cxx()
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


# --- the build lock --------------------------------------------------------------------------

HEARTBEAT_S = 10.0  # a holder refreshes its lock's mtime this often
FOREIGN_STALE_S = 120.0  # a lock of another host without a heartbeat for this long is dead
WAIT_LOG_S = 30.0  # a waiter repeats its log line this often


@dataclass(frozen=True)
class LockOwner:
    """Who holds a build lock: written into the lock file as JSON."""

    pid: int
    host: str
    since: float  # time.time() when taken
    started: str | None = None  # the process's start time (/proc), against pid reuse

    def describe(self, now: float | None = None) -> str:
        age = (now or time.time()) - self.since
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}, since {when} ({age:.0f} s)"


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


def pid_alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` of this host is running (a zombie is not, nor a new process that
    reused the pid of one started at `started`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if _process_state(pid) == "Z":
        return False
    now_started = _process_start(pid)
    return not (started and now_started and started != now_started)


def owner_alive(owner: LockOwner, heartbeat_age: float, host: str | None = None) -> bool:
    """A same-host owner by its pid; another host's by the lock's heartbeat (its mtime age)."""
    if owner.host == (host or socket.gethostname()):
        return pid_alive(owner.pid, owner.started)
    return heartbeat_age < FOREIGN_STALE_S


def read_lock(path: Path) -> tuple[LockOwner | None, float]:
    """(owner or None if unreadable, seconds since its last heartbeat); FileNotFoundError when
    there is no lock."""
    mtime = path.stat().st_mtime
    try:
        data = json.loads(path.read_text())
        owner = LockOwner(
            int(data["pid"]), str(data["host"]), float(data["since"]), data["started"]
        )
    except (ValueError, KeyError, TypeError):
        owner = None
    return owner, time.time() - mtime


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    """Serialises the check-and-take of the lock file (held for microseconds)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class BuildLock:
    """The build folder's lock: at most one process builds it at a time. A dead holder's lock
    is taken over at once (with torch's own `lock` it left), a live one waited on and logged.
    Use as a context manager."""

    def __init__(self, build_dir: Path, poll_s: float = 0.1, log_every_s: float = WAIT_LOG_S):
        self.path = build_dir / LOCK_NAME
        self.guard = build_dir / f"{LOCK_NAME}.guard"
        self.poll_s = poll_s
        self.log_every_s = log_every_s
        self.owner: LockOwner | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _try_take(self) -> LockOwner | None:
        """Takes the lock (None) or returns its live holder."""
        with _guard(self.guard):
            try:
                holder, age = read_lock(self.path)
            except FileNotFoundError:
                holder = None
            else:
                if holder is not None and owner_alive(holder, age):
                    return holder
                who = holder.describe() if holder else "an unreadable lock"
                log.warning(
                    "batchwire.native: taking over the build lock %s: its holder (%s) is no "
                    "longer running",
                    self.path,
                    who,
                )
            me = LockOwner(
                os.getpid(), socket.gethostname(), time.time(), _process_start(os.getpid())
            )
            tmp = self.path.with_name(f"{LOCK_NAME}.{me.pid}.tmp")
            tmp.write_text(json.dumps(me.__dict__))
            os.replace(tmp, self.path)
            self.owner = me
        # Every build of this folder holds this lock first, so torch's own lock of the folder
        # can only be a dead build's (torch would wait on it forever).
        torch_lock = self.path.parent / "lock"
        if torch_lock.exists():
            log.warning(
                "batchwire.native: removing torch's build lock left by a dead build: %s", torch_lock
            )
            torch_lock.unlink(missing_ok=True)
        return None

    def acquire(self) -> None:
        start = last_log = time.monotonic()
        logged = False
        while (holder := self._try_take()) is not None:
            now = time.monotonic()
            if not logged or now - last_log >= self.log_every_s:
                log.warning(
                    "batchwire.native: waiting for the build of %s held by %s (waited %.0f s)",
                    self.path.parent,
                    holder.describe(),
                    now - start,
                )
                logged, last_log = True, now
            time.sleep(self.poll_s)
        self._stop.clear()
        self._beat = threading.Thread(
            target=self._heartbeat, name="batchwire-build-lock", daemon=True
        )
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with _guard(self.guard), contextlib.suppress(FileNotFoundError):
            holder, _ = read_lock(self.path)
            if holder == self.owner:
                self.path.unlink()
        self.owner = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- building and loading --------------------------------------------------------------------


@dataclass(frozen=True)
class BuildResult:
    """A loaded build: `compiled` says whether this call compiled it, `seconds` how long it took;
    `module` is the imported module of a `python_module` extension (None for the op library)."""

    plan: BuildPlan
    compiled: bool
    seconds: float
    module: object | None = None


def _load_built(plan: BuildPlan) -> object | None:
    """Loads a finished build without torch's JIT machinery (no hashing, no ninja)."""
    library = plan.library
    if not plan.spec.python_module:
        torch.ops.load_library(str(library))
        return None
    name = library.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _arch_env(arch_list: str | None) -> Iterator[None]:
    """TORCH_CUDA_ARCH_LIST set to `arch_list` for the build (torch reads it from the
    environment), restored afterwards."""
    if arch_list is None:
        yield
        return
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before


def _fix_for(exc: BaseException, plan: BuildPlan) -> str:
    """What to do about a failed build, in words."""
    text = str(exc)
    arch_problem = isinstance(exc, IndexError) or any(
        words in text for words in ("Unknown CUDA arch", "Unsupported gpu architecture")
    )
    if plan.with_cuda and arch_problem:
        return (
            "the CUDA architectures could not be determined or are not supported by this nvcc: "
            "set TORCH_CUDA_ARCH_LIST to the GPUs it will run on (e.g. '8.0;9.0+PTX'), or "
            "BATCHWIRE_CUDA=0 for a CPU-only build"
        )
    if isinstance(exc, (ImportError, OSError)) and plan.library.exists():
        return (
            f"the built library does not load: delete {plan.build_dir} to rebuild it; "
            "`python -m batchwire.native info` lists the toolchain"
        )
    fix = "`python -m batchwire.native info` lists the toolchain"
    if plan.with_cuda:
        fix += "; BATCHWIRE_CUDA=0 builds without CUDA"
    return fix


def _find_library(plan: BuildPlan) -> Path:
    """The library torch just built (it appends _v1, _v2... when one process builds a name
    twice from different sources)."""
    candidates = [
        p
        for p in plan.build_dir.glob(f"{plan.spec.name}*.so")
        if re.fullmatch(rf"{re.escape(plan.spec.name)}(_v\d+)?\.so", p.name)
    ]
    if not candidates:
        raise OSError(f"no {plan.spec.name}*.so in {plan.build_dir} after the build")
    return max(candidates, key=lambda p: p.stat().st_mtime_ns)


def _compile_and_load(plan: BuildPlan, verbose: bool) -> object | None:
    from torch.utils import cpp_extension

    module = cpp_extension.load(
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
    marker = {"library": _find_library(plan).name, "toolchain": repr(plan.toolchain)}
    tmp = plan.marker.with_name(f"{BUILT_MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, plan.marker)
    return module


def _build_and_load(plan: BuildPlan, verbose: bool) -> BuildResult:
    """Loads `plan`'s finished build, or builds it under the folder's lock; raises
    NativeBuildError, whatever the cause."""
    what = f"{plan.kind} extension {plan.spec.name}"
    start = time.perf_counter()
    failed = plan.build_dir / FAILED_MARKER
    if plan.with_cuda and failed.exists():
        with contextlib.suppress(OSError):
            raise NativeBuildError(
                f"batchwire.native: the {what} failed to build earlier with this toolchain "
                f"and these sources (delete {failed} to try again): {failed.read_text()}"
            )
    if plan.built:
        try:
            module = _load_built(plan)
        except (OSError, ImportError) as exc:  # the file does not load (dlopen): rebuild it
            log.warning(
                "batchwire.native: the cached %s does not load (%s: %s); rebuilding it",
                what,
                type(exc).__name__,
                exc,
            )
            plan.marker.unlink(missing_ok=True)
        except Exception as exc:  # e.g. the op registered twice: rebuilding would not help
            raise NativeBuildError(
                f"batchwire.native: loading the {what} from {plan.library} failed: "
                f"{_fix_for(exc, plan)}. The error follows.\n{type(exc).__name__}: {exc}"
            ) from exc
        else:
            return BuildResult(plan, False, time.perf_counter() - start, module)
    problems = missing_tools(plan)
    if not problems:
        header = missing_system_header(plan)
        problems += [header] if header else []
    if problems:
        raise NativeBuildError(f"batchwire.native: cannot build the {what}: " + "; ".join(problems))
    try:
        plan.build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(
            f"batchwire.native: cannot create the build folder {plan.build_dir} ({exc}): point "
            f"{NATIVE_CACHE_ENV} or {CACHE_ENV} at a writable folder"
        ) from exc
    try:
        with BuildLock(plan.build_dir):
            if plan.built:  # another process built it while this one waited
                module, compiled = _load_built(plan), False
            else:
                log.warning(
                    "batchwire.native: compiling the %s into %s (first use, cached afterwards)...",
                    what,
                    plan.build_dir,
                )
                with _arch_env(plan.arch_list):
                    module, compiled = _compile_and_load(plan, verbose), True
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}".strip()
        if len(detail) > 4000:
            detail = "...\n" + detail[-4000:]
        error = NativeBuildError(
            f"batchwire.native: building the {what} in {plan.build_dir} failed: "
            f"{_fix_for(exc, plan)}. The error follows.\n{detail}"
        )
        if plan.with_cuda:  # not retried by every process start (each would fall back anyway)
            with contextlib.suppress(OSError):
                failed.write_text(str(error))
        raise error from exc
    seconds = time.perf_counter() - start
    if compiled:
        log.warning("batchwire.native: compiled %s in %.1f s", plan.spec.name, seconds)
    return BuildResult(plan, compiled, seconds, module if plan.spec.python_module else None)


def build_with_fallback(
    plan: BuildPlan, verbose: bool = False, switch: str | None = None
) -> BuildResult:
    """Builds and loads `plan`; a failed CUDA build is retried CPU-only with one warning unless
    `switch` (BATCHWIRE_CUDA, read from the environment when None) is '1', so a CUDA problem
    never takes the CPU op away."""
    try:
        return _build_and_load(plan, verbose)
    except NativeBuildError as exc:
        if switch is None:
            switch = os.environ.get(CUDA_ENV, "")
        if not plan.with_cuda or switch.strip() == "1":
            raise
        first = str(exc).splitlines()[0]
        _warn_once(
            f"batchwire.native: the CUDA build failed, building the op CPU-only instead (CUDA "
            f"tensors will use the slow reference; BATCHWIRE_CUDA=0 skips the CUDA attempt, "
            f"BATCHWIRE_CUDA=1 makes it an error): {exc}"
        )
        cpu = make_plan(
            plan.spec, CudaDecision(False, f"CPU-only: the CUDA build failed ({first})")
        )
        return _build_and_load(cpu, verbose)


_first_use = threading.RLock()  # functools.cache alone may run a first call twice at once


@dataclass(frozen=True)
class _Failed:
    message: str


@functools.cache
def _build_once(spec: ExtensionSpec, verbose: bool) -> BuildResult | _Failed:
    try:
        plan = make_plan(None if spec == augment_spec() else spec)
        return build_with_fallback(plan, verbose)
    except NativeBuildError as exc:
        return _Failed(str(exc))
    except Exception as exc:  # every failure is a NativeBuildError, never a crash of the caller
        return _Failed(
            f"batchwire.native: preparing the build of {spec.name} failed ({type(exc).__name__}: "
            f"{exc}); `python -m batchwire.native info` lists the toolchain"
        )


def build_extension(spec: ExtensionSpec | None = None, verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads an extension (the augment op by default) into this
    process, once per process (a failure too is remembered); raises NativeBuildError."""
    with _first_use:
        done = _build_once(spec or augment_spec(), verbose)
    if isinstance(done, _Failed):
        raise NativeBuildError(done.message)
    return done


def build(verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads the augment op into this process, once per process."""
    return build_extension(None, verbose)


def build_jpeg_roi(verbose: bool = False) -> BuildResult:
    """Builds (if needed) and loads the region-of-interest JPEG decoder; `.module` holds it."""
    return build_extension(jpeg_roi_spec(), verbose)
