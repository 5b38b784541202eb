"""`pipeline-prepare SRC DST` and `pipeline-prepare --checksums-only SRC`: the command line of
batchwire.prepare (see the package doc).

Exit status: 0 every file prepared; 1 corrupt JPEGs found (reported, copied as they were: DST is
complete; with --checksums-only: reported, checksummed); 2 the command cannot run (SRC missing,
DST inside SRC or SRC inside DST, a list file path escaping its folder, the transcoder
unavailable, another run writing DST, DST not writable): nothing was done; 3 some files could
not be read or written, or the run was interrupted: DST is incomplete, and rerunning the same
command finishes it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from batchwire.common.cores import available_cores
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS
from batchwire.prepare.restarts import AUTO_MOST, restart_setting
from batchwire.prepare.source import UsageError
from batchwire.prepare.summary import EXIT_INCOMPLETE, EXIT_USAGE
from batchwire.wire.cli import ArgumentParser
from batchwire.wire.version import add_version_argument


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pipeline-prepare",
        description=(
            "Copy a dataset to DST with every JPEG rewritten losslessly as a baseline JPEG "
            "with a restart marker after every MCU (verified pixel for pixel), so that "
            "pipeline-server decodes random crops faster on CPU. Also a full integrity check: "
            "corrupt JPEGs are reported (and copied as they were). Rerunning resumes, and "
            "makes DST mirror SRC again (files gone from SRC are removed from DST). Every file "
            "written is checksummed in DST's manifest; pipeline-server checks every read."
        ),
    )
    add_version_argument(p)
    p.add_argument(
        "src",
        metavar="SRC",
        help="an ImageFolder tree (any folder) or a list file; with --shards or "
        "--checksums-only also tar shards, Parquet or a dataset in a bucket (s3://...)",
    )
    p.add_argument(
        "dst",
        metavar="DST",
        nargs="?",
        help="the output folder (created; outside SRC), or with --shards also a bucket "
        "prefix (s3://bucket/prefix); not with --checksums-only",
    )
    p.add_argument(
        "--checksums-only",
        action="store_true",
        help="rewrite nothing: only record a checksum of every file of SRC in a manifest "
        "(SRC/.batchwire-prepare-checksums.jsonl, or in --manifest-dir; for tar shards, Parquet "
        "and bucket datasets one per sample, beside the shards or files), which pipeline-server "
        "checks every read against, and whether each JPEG passes the strict full decode "
        "(only those may be decoded by their crop's restart intervals; corrupt ones are listed)",
    )
    p.add_argument(
        "--manifest-dir",
        metavar="DIR",
        help="with --checksums-only: write the manifest in DIR (named after SRC) instead of "
        "SRC; pipeline-server then needs to be told DIR",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        metavar="N",
        help="JPEGs whose header claims more pixels are copied as they were, not rewritten "
        "(pipeline-server's cap, which refuses them; 0: no cap) (default: %(default)s)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=available_cores(),
        help="files prepared at once (default: every core, %(default)s)",
    )
    p.add_argument(
        "--restart-interval",
        default="auto",
        metavar="auto|N",
        help=f"MCUs between restart markers. auto (default): per file, the largest of 1 to "
        f"{AUTO_MOST} that divides its MCU rows (on ImageNet: +3.3%% bytes, crops as fast as "
        "with 1). N: exactly N; the decoder enters a file at its markers only where N divides "
        "its MCU rows, other files are decoded as before",
    )
    p.add_argument(
        "--shards",
        metavar="SIZE",
        help="write DST as WebDataset tar shards of at most SIZE each (e.g. 1GB, 256MB): "
        "PREFIX-000000.tar ..., members KEY.jpg (the bytes as read) and KEY.cls; SRC may be "
        "any source pipeline-server reads (folder, list, CSV/JSON-lines, tar shards, Parquet)",
    )
    p.add_argument(
        "--shard-prefix",
        default="train",
        metavar="NAME",
        help="with --shards: the shards' name before -NNNNNN.tar (default: %(default)s); one "
        "prefix per DST: each split in a folder of its own (pipeline-server serves a folder whole)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress and no per-file lines")
    p.add_argument("--report", metavar="FILE.json", help="also write the summary as JSON here")
    p.add_argument(
        "--fsync",
        action="store_true",
        help="flush every file to disk before renaming it (survives a power cut; slower)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from batchwire.prepare.run import Options, run  # after parsing: --help needs no torch

    if args.shards is not None:
        return _shards_main(args)
    if args.checksums_only and args.dst is None:
        from batchwire.pipeline.sources import is_classic

        if not is_classic(args.src):  # tar shards, Parquet, a bucket: checksums per sample
            return _sample_sums_main(args)
    return _finish(
        lambda: run(
            Options(
                src=args.src,
                dst=args.dst,
                max_pixels=args.max_pixels or None,
                checksums_only=args.checksums_only,
                manifest_dir=args.manifest_dir,
                jobs=args.jobs,
                restart_interval=restart_setting(args.restart_interval),
                quiet=args.quiet,
                report=args.report,
                fsync=args.fsync,
            )
        )
    )


def _shards_main(args: argparse.Namespace) -> int:
    """`--shards`: SRC to DST as tar shards (prepare.shards); exit 0, 2 (usage) or 3 (some
    samples unreadable, named)."""
    from batchwire.prepare.shards import parse_size, write_shards

    def work() -> _Summary:
        if args.dst is None or args.checksums_only:
            raise UsageError("--shards takes SRC and DST (not --checksums-only)")
        return write_shards(
            args.src,
            args.dst,
            parse_size(args.shards),
            prefix=args.shard_prefix,
            jobs=args.jobs,
            progress=None if args.quiet else sys.stderr,
        )

    return _finish(work)


def _sample_sums_main(args: argparse.Namespace) -> int:
    """`--checksums-only` of tar shards, Parquet or a bucket dataset (prepare.samplesums)."""
    from batchwire.prepare.samplesums import checksum_samples

    return _finish(
        lambda: checksum_samples(
            args.src,
            manifest_dir=args.manifest_dir,
            jobs=args.jobs,
            max_pixels=args.max_pixels or None,
            progress=None if args.quiet else sys.stderr,
            report=args.report,
        )
    )


class _Summary(Protocol):
    @property
    def exit_status(self) -> int: ...

    def text(self) -> str: ...


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`, a container stop, a scheduler's preemption) ends the run as
    Ctrl-C does: the files in flight finish, the summary and report are written, exit status 3.
    The previous handler is restored after (main() also runs inside other programs' processes)."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal.signal would raise
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish(work: Callable[[], _Summary]) -> int:
    """Run `work`, print its summary, return its exit status: how both modes (copy and
    `--shards`) end. A usage error exits 2 and an OSError 3, each as one line on stderr."""
    try:
        with _sigterm_interrupts():
            summary = work()
    except UsageError as exc:
        print(f"pipeline-prepare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"pipeline-prepare: error: {exc}", file=sys.stderr)
        return EXIT_INCOMPLETE
    except KeyboardInterrupt:  # --shards (the copy mode writes its own summary)
        print("pipeline-prepare: interrupted: DST is incomplete", file=sys.stderr)
        return EXIT_INCOMPLETE
    print(printable(summary.text()))
    return summary.exit_status


def printable(text: str) -> str:
    """`text` as stdout can take it: a file name that is not UTF-8 (kept surrogate-escaped, as
    Python reads it) shown escaped (caf\\udce9.jpg) rather than failing the run at its very
    end on a strict stdout (any UTF-8 locale but C.UTF-8)."""
    encoding = sys.stdout.encoding or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


if __name__ == "__main__":
    sys.exit(main())
