"""One pipeline-prepare run: find SRC's files, prepare each on a thread pool, keep the manifest,
write the list file (for a list) last, and sum it up.

Threads rather than processes: the work is in the native transcoder and in file I/O, both of
which release the GIL, so threads use every core without copying file contents between
processes. At most a few files per thread are in flight, so memory stays flat for any dataset.
"""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from batchwire.common.cores import available_cores
from batchwire.native.jpeg_transcode import transcode_available
from batchwire.pipeline.decode.files import read_file_and_stat
from batchwire.prepare import manifest
from batchwire.prepare.job import (
    AUTO,
    Result,
    Settings,
    prepare_file,
    write_atomically,
)
from batchwire.prepare.manifest import COPIED, DONE_OUTCOMES, FAILED, REWRITTEN, Record
from batchwire.prepare.progress import Progress
from batchwire.prepare.source import (
    Source,
    UsageError,
    check_destination,
    check_report,
    discover,
)
from batchwire.prepare.summary import Summary, problem_line

IN_FLIGHT_PER_JOB = 4


@dataclass(frozen=True)
class Options:
    src: str
    dst: str
    jobs: int
    restart_interval: int = AUTO  # MCUs, or AUTO (per file, see job.AUTO_MOST)
    quiet: bool = False
    report: str | None = None
    fsync: bool = False


def _results(
    pool: ThreadPoolExecutor,
    files: list[str],
    previous: dict[str, Record],
    settings: Settings,
    window: int,
) -> Iterator[Result]:
    """Results as files finish, with at most `window` submitted and not yet returned."""
    pending: set[Future[Result]] = set()
    for rel in files:
        pending.add(pool.submit(prepare_file, rel, previous.get(rel), settings))
        if len(pending) >= window:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from (f.result() for f in done)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from (f.result() for f in done)


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, (json.dumps(data, indent=1) + "\n").encode(), 0o644, fsync=False)


def _copy_list_file(source: Source, dst: Path, fsync: bool) -> None:
    """The list file, byte for byte, beside the files it names (its paths are relative)."""
    assert source.list_name is not None
    data, st = read_file_and_stat(str(source.root / source.list_name))
    write_atomically(dst / source.list_name, data, stat.S_IMODE(st.st_mode), fsync)


def _notes(source: Source) -> list[str]:
    if source.kind == "tree" and not source.has_classes:
        return [
            "SRC has no class folders: pipeline-server opens neither SRC nor DST as an "
            "ImageFolder (a list file naming the files would work)"
        ]
    return []


def _validated(options: Options) -> tuple[Source, Path]:
    """SRC's files and DST's absolute path, or UsageError for anything that stops the run."""
    if options.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {options.jobs}")
    if not (options.restart_interval == AUTO or 1 <= options.restart_interval <= 65535):
        raise UsageError(
            f"--restart-interval must be auto or 1 to 65535 MCUs, got {options.restart_interval}"
        )
    source = discover(options.src)
    dst = check_destination(source, options.dst)
    if options.report:
        check_report(source, options.report)
    if not transcode_available():
        raise UsageError(
            "the JPEG transcoder cannot be built here (see the logged build error; it needs "
            "libjpeg62-turbo-dev, or libjpeg-turbo8-dev on Ubuntu)"
        )
    return source, dst


def run(options: Options, progress_stream: TextIO | None = None) -> Summary:
    """Prepares SRC into DST (see the package doc); raises UsageError before doing anything
    when the command cannot run, OSError when DST cannot be set up."""
    started = time.monotonic()
    source, dst = _validated(options)
    dst.mkdir(parents=True, exist_ok=True)
    cores = min(options.jobs, available_cores())
    summary = Summary(
        str(options.src), str(dst), options.restart_interval, options.jobs, cores=cores
    )
    summary.notes = _notes(source)
    with manifest.locked(dst):
        previous = manifest.load(dst)
        if not previous.finished:
            removed = manifest.remove_temporaries(dst)
            if removed:
                summary.notes.append(f"removed {removed} temporaries left by an interrupted run")
        for rel_dir in source.dirs:
            (dst / rel_dir).mkdir(parents=True, exist_ok=True)
        for rel, why in source.unreadable:
            summary.add(Record(rel, 0, 0, FAILED, 0, 0, options.restart_interval, why), False)
        writer = manifest.Writer(dst)
        try:
            _prepare_all(options, source, dst, previous.records, summary, writer, progress_stream)
        finally:
            writer.close()
        if not summary.interrupted:
            if source.kind == "list":
                complete = not any(r.outcome == FAILED for r in summary.records)
                if complete:
                    _copy_list_file(source, dst, options.fsync)
                summary.list_file_written = complete
            done = sorted(
                (r for r in summary.records if r.outcome in DONE_OUTCOMES), key=lambda r: r.path
            )
            writer.finish(done)
        summary.seconds = time.monotonic() - started
        summary.report_path = str(dst / manifest.REPORT_NAME)
        report = summary.to_json()
        _write_json(dst / manifest.REPORT_NAME, report)
    if options.report:
        _write_json(Path(options.report).expanduser().resolve(), report)
    return summary


def _prepare_all(
    options: Options,
    source: Source,
    dst: Path,
    previous: dict[str, Record],
    summary: Summary,
    writer: manifest.Writer,
    progress_stream: TextIO | None,
) -> None:
    """Runs every file's job, appending each finished one to the manifest as it comes."""
    settings = Settings(source.root, dst, options.restart_interval, options.fsync)
    total = len(source.files) + len(source.unreadable)
    progress = Progress(total, stream=progress_stream, enabled=not options.quiet)
    for record in summary.records:
        progress.note(problem_line(record))
    problems = len(summary.records)
    pool = ThreadPoolExecutor(options.jobs, thread_name_prefix="batchwire-prepare")
    try:
        window = options.jobs * IN_FLIGHT_PER_JOB
        for result in _results(pool, source.files, previous, settings, window):
            record = result.record
            if not result.skipped and record.outcome in DONE_OUTCOMES:
                writer.append(record)
            if record.outcome not in (REWRITTEN, COPIED):
                problems += 1
                if not result.skipped:
                    progress.note(problem_line(record))
            summary.add(record, result.skipped)
            progress.update(len(summary.records), problems)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()
