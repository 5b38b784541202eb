"""One pipeline-prepare run: find SRC's files, remove from DST what earlier runs wrote for
files SRC no longer has (`mirror`), prepare each file on a thread pool, keep the manifest, write
the list file (for a list) last, list what DST holds that prepare never wrote, and sum it up.

`--checksums-only` runs the same machinery with nothing written but a checksum manifest, beside
SRC or in a folder given (`pipeline.checksums` says where the server looks).

Threads rather than processes: the work is in the native transcoder and in file I/O, both of
which release the GIL, so threads use every core without copying file contents between
processes. At most a few files per thread are in flight, so memory stays flat for any dataset.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from batchwire.common.cores import available_cores
from batchwire.native.jpeg_transcode import transcode_available
from batchwire.pipeline.checksums import keyed_name
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS
from batchwire.pipeline.decode.files import read_file_and_stat
from batchwire.prepare import checksum_manifest
from batchwire.prepare.checksum_manifest import (
    CHECKSUMMED,
    DONE_OUTCOMES,
    FAILED,
    TMP_PREFIX,
    Header,
    Record,
)
from batchwire.prepare.job import (
    Result,
    Settings,
    prepare_file,
    write_atomically,
)
from batchwire.prepare.mirror import find_foreign, remove_gone, source_id
from batchwire.prepare.progress import Progress
from batchwire.prepare.restarts import AUTO
from batchwire.prepare.source import (
    Source,
    UsageError,
    check_destination,
    check_manifest_dir,
    check_report,
    discover,
)
from batchwire.prepare.summary import Summary, is_problem, problem_line

IN_FLIGHT_PER_JOB = 4


@dataclass(frozen=True)
class Options:
    """A run's settings. `dst` is None with `checksums_only` (then `manifest_dir`, if given,
    is where the checksum manifest goes instead of beside SRC); `max_pixels`: JPEGs claiming
    more are copied as they were (None: no cap)."""

    src: str
    dst: str | None
    jobs: int
    restart_interval: int = AUTO  # MCUs, or AUTO (per file, see restarts.AUTO_MOST)
    quiet: bool = False
    report: str | None = None
    fsync: bool = False
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    checksums_only: bool = False
    manifest_dir: str | None = None


@dataclass(frozen=True)
class Places:
    """Where a run writes: `out` the files' root (DST; SRC's folder with --checksums-only,
    where nothing but the manifest is written), and its manifest, lock and report."""

    out: Path
    manifest: Path
    lock: Path
    report: Path


def _places(options: Options, source: Source, dst: Path | None) -> Places:
    if dst is not None:
        return Places(
            dst,
            dst / checksum_manifest.MANIFEST_NAME,
            dst / checksum_manifest.LOCK_NAME,
            dst / checksum_manifest.REPORT_NAME,
        )
    if options.manifest_dir is None:
        path = source.root / checksum_manifest.CHECKSUMS_NAME
    else:
        folder = Path(os.path.realpath(Path(options.manifest_dir).expanduser()))
        path = folder / keyed_name(options.src)
    stem = path.name.removesuffix(".jsonl")
    return Places(
        source.root, path, path.with_name(f"{stem}.lock"), path.with_name(f"{stem}-report.json")
    )


def _writable(folder: Path, what: str) -> None:
    """Creates `folder` if needed and proves a file can be created in it; UsageError (exit
    status 2, nothing done) when not: a read-only DST is a setup problem, not a half-done run."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"cannot write to {what} {folder}: {exc.strerror or exc}") from None


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


def _validated(options: Options) -> tuple[Source, Path | None]:
    """SRC's files and DST's absolute path (None with --checksums-only), or UsageError for
    anything that stops the run."""
    if options.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {options.jobs}")
    if not (options.restart_interval == AUTO or 1 <= options.restart_interval <= 65535):
        raise UsageError(
            f"--restart-interval must be auto or 1 to 65535 MCUs, got {options.restart_interval}"
        )
    if options.max_pixels is not None and options.max_pixels < 1:
        raise UsageError(f"--max-pixels must be at least 1, got {options.max_pixels}")
    if options.checksums_only != (options.dst is None):
        raise UsageError(
            "--checksums-only takes SRC alone (and --manifest-dir DIR)"
            if options.checksums_only
            else "DST is missing (or pass --checksums-only)"
        )
    if options.manifest_dir is not None and not options.checksums_only:
        raise UsageError("--manifest-dir goes with --checksums-only")
    source = discover(options.src)
    if options.manifest_dir is not None:
        check_manifest_dir(source, options.manifest_dir)
    if options.report:
        check_report(source, options.report)
    if options.dst is None:
        return source, None
    dst = check_destination(source, options.dst)
    if not transcode_available():
        raise UsageError(
            "the JPEG transcoder cannot be built here (see the logged build error; it needs "
            "libjpeg62-turbo-dev, or libjpeg-turbo8-dev on Ubuntu)"
        )
    return source, dst


def run(options: Options, progress_out: TextIO | None = None) -> Summary:
    """Prepares SRC into DST (see the package doc), or with `checksums_only` writes SRC's
    checksum manifest; raises UsageError before doing anything when the command cannot run
    (DST not writable included), OSError when DST cannot be set up."""
    started = time.monotonic()
    source, dst = _validated(options)
    places = _places(options, source, dst)
    if dst is not None:
        _writable(dst, "DST")
    else:
        hint = "" if options.manifest_dir else " (--manifest-dir DIR writes the manifest elsewhere)"
        _writable(places.manifest.parent, f"the manifest's folder{hint}")
    cores = min(options.jobs, available_cores())
    where = str(dst) if dst is not None else str(places.manifest)
    summary = Summary(str(options.src), where, options.restart_interval, options.jobs, cores=cores)
    summary.checksums_only = options.checksums_only
    summary.notes = _notes(source) if dst is not None else []
    with checksum_manifest.locked(places.lock):
        previous = checksum_manifest.load(places.manifest)
        if not previous.finished:
            removed = checksum_manifest.remove_temporaries(places.manifest.parent, dst is not None)
            if removed:
                summary.notes.append(f"removed {removed} temporaries left by an interrupted run")
        if dst is not None:
            remove_gone(dst, previous, source, summary.mirror)
            for rel_dir in source.dirs:
                (dst / rel_dir).mkdir(parents=True, exist_ok=True)
        for rel, why in source.unreadable:
            summary.add(Record(rel, 0, 0, FAILED, 0, 0, options.restart_interval, why), False)
        header = Header(source_id(source), tuple(source.dirs) if dst is not None else ())
        writer = checksum_manifest.Writer(places.manifest, header)
        try:
            _prepare_all(options, source, places, previous.records, summary, writer, progress_out)
        finally:
            writer.close()
        if not summary.interrupted:
            if source.kind == "list" and dst is not None:
                complete = not any(r.outcome == FAILED for r in summary.records)
                if complete:
                    _copy_list_file(source, dst, options.fsync)
                summary.list_file_written = complete
            done = [r for r in summary.records if r.outcome in DONE_OUTCOMES]
            if dst is None:
                done += _still_there(source, previous.records, summary.records)
            writer.finish(sorted(done, key=lambda r: r.path))
            if dst is not None:
                summary.mirror.foreign = find_foreign(dst, source)
        summary.seconds = time.monotonic() - started
        summary.report_path = str(places.report)
        report = summary.to_json()
        _write_json(places.report, report)
    if options.report:
        _write_json(Path(options.report).expanduser().resolve(), report)
    return summary


def _still_there(
    source: Source, previous: dict[str, Record], records: list[Record]
) -> list[Record]:
    """--checksums-only: earlier records of files this source does not name but that are still
    there unchanged (another list file's, in the same folder), so that checksumming one list
    does not drop the checksums of the other."""
    named = {r.path for r in records}
    kept = []
    for rel, record in previous.items():
        if rel in named or record.outcome != CHECKSUMMED:
            continue
        try:
            st = os.stat(source.root / rel)
        except OSError:
            continue
        if st.st_size == record.size and st.st_mtime_ns == record.mtime_ns:
            kept.append(record)
    return kept


def _prepare_all(
    options: Options,
    source: Source,
    places: Places,
    previous: dict[str, Record],
    summary: Summary,
    writer: checksum_manifest.Writer,
    progress_out: TextIO | None,
) -> None:
    """Runs every file's job, appending each finished one to the manifest as it comes."""
    settings = Settings(
        source.root,
        places.out,
        options.restart_interval,
        options.fsync,
        max_pixels=options.max_pixels,
        checksums_only=options.checksums_only,
    )
    total = len(source.files) + len(source.unreadable)
    progress = Progress(total, out=progress_out, enabled=not options.quiet)
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
            if is_problem(record):
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
