"""`python -m batchwire.native build|info`: build the extension ahead of time (Docker images,
CI caches) or show what would be built, where, and why.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys

import torch
from batchwire.native.build import (
    FAILED_MARKER,
    LOCK_NAME,
    BuildResult,
    NativeBuildError,
    build,
    build_jpeg_roi,
    compiler_identity,
    make_plan,
    missing_tools,
    read_lock,
)


def _info() -> int:
    try:
        plan = make_plan()
    except NativeBuildError as exc:
        print(f"error: {exc}")
        return 1
    tools = plan.toolchain
    print(f"torch:      {torch.__version__} (CUDA {torch.version.cuda}, {tools.torch_build})")
    print(f"CUDA build: {'yes' if plan.with_cuda else 'no'} ({plan.cuda_reason})")
    if plan.with_cuda:
        print(f"nvcc:       {tools.nvcc}")
        print(f"CUDA archs: {plan.arch_list or 'detected from the visible GPUs'}")
    print(f"python ABI: {tools.python_abi}")
    print(f"compiler:   {compiler_identity()}")
    problems = missing_tools(plan)
    print(f"ninja:      {shutil.which('ninja') or 'missing'}")
    print(f"build dir:  {plan.build_dir}")
    print(f"built:      {'yes' if plan.built else 'no'} ({plan.library})")
    try:
        holder, _ = read_lock(plan.build_dir / LOCK_NAME)
    except FileNotFoundError:
        pass
    else:
        print(f"build lock: held by {holder.describe() if holder else 'an unreadable lock'}")
    if plan.with_cuda and (plan.build_dir / FAILED_MARKER).exists():
        problems.append(
            f"this CUDA build failed before; delete {plan.build_dir / FAILED_MARKER} to retry it"
        )
    for problem in problems:
        print(f"problem:    {problem}")
    return 1 if problems else 0


def _report(result: BuildResult) -> None:
    plan = result.plan
    if result.compiled:
        print(f"built the {plan.kind} extension in {result.seconds:.1f} s: {plan.library}")
    else:
        print(f"the {plan.kind} extension is up to date ({result.seconds:.2f} s): {plan.library}")


def _build(verbose: bool) -> int:
    """The augment op is required; the JPEG region decoder is optional (the pipeline then
    decodes whole images), so its failure is reported but does not fail the build."""
    try:
        result = build(verbose=verbose)
    except NativeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _report(result)
    print(f"CUDA: {'yes' if result.plan.with_cuda else 'no'} ({result.plan.cuda_reason})")
    try:
        _report(build_jpeg_roi(verbose=verbose))
    except NativeBuildError as exc:
        print(f"warning: JPEG region decoder not built, whole images will be decoded: {exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchwire.native",
        description="Build the batchwire native augment op ahead of time, or show its status.",
    )
    parser.add_argument("command", choices=("build", "info"))
    parser.add_argument("-v", "--verbose", action="store_true", help="show compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _build(args.verbose) if args.command == "build" else _info()


if __name__ == "__main__":
    sys.exit(main())
