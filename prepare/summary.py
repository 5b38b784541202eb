"""pipeline-prepare's summary: counts of what DST now holds, the size change, the speed, and the
problem files, as text for stdout and as JSON for `--report` (and DST's own report file).

Counts cover every file of SRC, whether this run or an earlier one prepared it (`skipped` says
how many were earlier ones'), so a rerun after a kill reports the dataset as a whole and exits
with the same status as a single run would. Speeds cover this run's work only. What making DST
mirror SRC did (`prepare.mirror`: files removed, files kept, files prepare never wrote) is
listed too; none of it changes the exit status.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from batchwire.prepare.checksum_manifest import (
    CHECKSUMMED,
    COPIED,
    CORRUPT,
    FAILED,
    REWRITTEN,
    TOO_LARGE,
    UNVERIFIED,
    Record,
)
from batchwire.prepare.mirror import Mirror
from batchwire.prepare.restarts import AUTO, AUTO_MOST

EXIT_OK = 0
EXIT_CORRUPT = 1  # corrupt files found; DST is still complete
EXIT_USAGE = 2  # nothing was done
EXIT_INCOMPLETE = 3  # some files could not be read or written; rerun once fixed
TEXT_PROBLEMS = 20  # problem files listed on stdout; the report lists every one


@dataclass
class Summary:
    src: str
    dst: str
    restart_interval: int
    jobs: int
    cores: int = 1  # min(jobs, CPU cores): what "per core" divides by
    records: list[Record] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0
    report_path: str = ""
    list_file_written: bool | None = None  # None for a folder
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    checksums_only: bool = False
    mirror: Mirror = field(default_factory=Mirror)

    def add(self, record: Record, skipped: bool) -> None:
        self.records.append(record)
        self.skipped += skipped

    @property
    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.records)

    @property
    def problems(self) -> list[Record]:
        return sorted((r for r in self.records if is_problem(r)), key=lambda r: r.path)

    @property
    def not_intact(self) -> int:
        """--checksums-only: JPEGs the strict check refused (each with its error)."""
        return sum(r.outcome == CHECKSUMMED and bool(r.error) for r in self.records)

    def jpeg_bytes(self) -> tuple[int, int]:
        rewritten = [r for r in self.records if r.outcome == REWRITTEN]
        return sum(r.bytes_in for r in rewritten), sum(r.bytes_out for r in rewritten)

    @property
    def exit_status(self) -> int:
        counts = self.counts
        if counts[FAILED] or self.interrupted:
            return EXIT_INCOMPLETE
        return EXIT_CORRUPT if counts[CORRUPT] or self.not_intact else EXIT_OK

    def speed(self) -> tuple[int, float, float]:
        """(files this run worked on, files/s, files/s per core)."""
        worked = len(self.records) - self.skipped
        rate = worked / self.seconds if self.seconds > 0 else 0.0
        return worked, rate, rate / max(self.cores, 1)

    def to_json(self) -> dict[str, Any]:
        counts = self.counts
        before, after = self.jpeg_bytes()
        worked, rate, per_core = self.speed()
        return {
            "src": self.src,
            "dst": self.dst,
            "restart_interval": self.restart_interval,
            "jobs": self.jobs,
            "cores": self.cores,
            "files_seen": len(self.records),
            "rewritten": counts[REWRITTEN],
            "copied": counts[COPIED],
            "unverified": counts[UNVERIFIED],
            "corrupt": counts[CORRUPT],
            "too_large": counts[TOO_LARGE],
            "checksummed": counts[CHECKSUMMED],
            "intact": sum(r.intact is True for r in self.records),
            "failed": counts[FAILED],
            "skipped": self.skipped,
            "jpeg_bytes_before": before,
            "jpeg_bytes_after": after,
            "jpeg_bytes_change_percent": _percent(before, after),
            "seconds": round(self.seconds, 3),
            "files_worked": worked,
            "files_per_s": round(rate, 2),
            "files_per_s_per_core": round(per_core, 2),
            "list_file_written": self.list_file_written,
            "interrupted": self.interrupted,
            "exit_status": self.exit_status,
            "notes": self.notes,
            "problems": [
                {"path": r.path, "outcome": r.outcome, "error": r.error} for r in self.problems
            ],
            "removed": self.mirror.removed,
            "removed_dirs": self.mirror.removed_dirs,
            "kept_gone": [{"path": p, "why": why} for p, why in self.mirror.kept],
            "foreign": self.mirror.foreign,
        }

    def text(self) -> str:
        lines = self._checksum_lines() if self.checksums_only else self._prepare_lines()
        if self.list_file_written is False:
            lines.append("  the list file was NOT written to DST: some of its files are missing")
        if self.interrupted:
            lines.append("  interrupted: rerun the same command to finish")
        lines += [f"  note: {n}" for n in self.notes]
        lines += _listed("problem files", [problem_line(r) for r in self.problems])
        mirror = self.mirror
        lines += _listed(
            "removed from DST (SRC no longer has them)",
            mirror.removed + [f"{d}/" for d in mirror.removed_dirs],
        )
        lines += _listed(
            "kept in DST although SRC no longer has them",
            [f"{p}: {why}" for p, why in mirror.kept],
        )
        lines += _listed("in DST but never written by pipeline-prepare (kept)", mirror.foreign)
        if self.report_path:
            lines.append(f"full report: {self.report_path}")
        return "\n".join(lines)

    def _checksum_lines(self) -> list[str]:
        counts = self.counts
        worked, rate, per_core = self.speed()
        return [
            f"pipeline-prepare --checksums-only: {self.src} -> {self.dst}",
            f"  files seen              {len(self.records):>9}",
            f"  checksummed             {counts[CHECKSUMMED]:>9}",
            f"  JPEGs intact            {sum(r.intact is True for r in self.records):>9}  "
            "(strict full decode passed)",
            f"  corrupt JPEGs           {self.not_intact:>9}  (strict full decode failed)",
            f"  failed (no checksum)    {counts[FAILED]:>9}",
            f"  skipped (done before)   {self.skipped:>9}",
            f"  time {self.seconds:.1f} s for {worked} files: {rate:.1f} files/s, "
            f"{per_core:.1f} files/s per core ({self.jobs} jobs, {self.cores} cores)",
        ]

    def _prepare_lines(self) -> list[str]:
        counts = self.counts
        before, after = self.jpeg_bytes()
        worked, rate, per_core = self.speed()
        change = _percent(before, after)
        change_text = "" if change is None else f" ({change:+.2f} %)"
        return [
            f"pipeline-prepare: {self.src} -> {self.dst} ({interval_text(self.restart_interval)})",
            f"  files seen              {len(self.records):>9}",
            f"  JPEGs rewritten         {counts[REWRITTEN]:>9}  (verified: same coefficients "
            "and pixels)",
            f"  copied (not JPEG)       {counts[COPIED]:>9}",
            f"  copied unverified       {counts[UNVERIFIED]:>9}  (JPEGs kept as they were)",
            f"  corrupt                 {counts[CORRUPT]:>9}  (copied as they were)",
            f"  over the pixel cap      {counts[TOO_LARGE]:>9}  (copied as they were)",
            f"  failed (not in DST)     {counts[FAILED]:>9}",
            f"  skipped (done before)   {self.skipped:>9}",
            f"  removed (gone from SRC) {len(self.mirror.removed):>9}",
            f"  never written (kept)    {len(self.mirror.foreign):>9}",
            f"  rewritten JPEG bytes    {_mb(before)} -> {_mb(after)}{change_text}",
            f"  time {self.seconds:.1f} s for {worked} files: {rate:.1f} files/s, "
            f"{per_core:.1f} files/s per core ({self.jobs} jobs, {self.cores} cores)",
        ]


def _listed(title: str, items: list[str]) -> list[str]:
    """A titled list of at most TEXT_PROBLEMS lines (the report has them all); none if empty."""
    if not items:
        return []
    lines = [f"{title} ({len(items)}):"] + [f"  {item}" for item in items[:TEXT_PROBLEMS]]
    if len(items) > TEXT_PROBLEMS:
        lines.append(f"  ... and {len(items) - TEXT_PROBLEMS} more")
    return lines


def is_problem(record: Record) -> bool:
    """A problem file: corrupt, unverified, over the cap, failed, or (--checksums-only) a JPEG
    the strict check refused."""
    wanted = (CORRUPT, UNVERIFIED, TOO_LARGE, FAILED)
    return record.outcome in wanted or (record.outcome == CHECKSUMMED and bool(record.error))


def problem_line(record: Record) -> str:
    """'outcome: path: why', saying what DST holds for it."""
    kept = {
        CORRUPT: " (copied as it was)",
        UNVERIFIED: " (not verified: copied as it was)",
        TOO_LARGE: " (copied as it was; pipeline-server replaces it unless its --max-pixels "
        "allows it)",
        FAILED: " (not in DST)",
    }
    return f"{record.outcome}: {record.path}: {record.error}{kept.get(record.outcome, '')}"


def _percent(before: int, after: int) -> float | None:
    return round(100.0 * (after - before) / before, 3) if before else None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def interval_text(restart_interval: int) -> str:
    """How a run's restart interval setting reads in its summary."""
    if restart_interval == AUTO:
        return f"a restart marker every 1 to {AUTO_MOST} MCUs, dividing each file's rows"
    return f"a restart marker every {restart_interval} MCU" + ("s" if restart_interval > 1 else "")
