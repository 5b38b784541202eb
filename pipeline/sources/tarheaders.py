"""Reading a tar file's member table from its headers alone: (name, data offset, size) each.

Written here rather than through `tarfile` because a shard on an object store is read through
ranged reads (`Store.read_ranges`), and because the parser must survive any bytes: every step
moves forward by at least one 512-byte block and stops at the object's end, so damaged or
hostile input ends the listing with a `problem`, never a crash or a hang (tests fuzz it).

Understood: ustar/POSIX (name + prefix), GNU long names (`L`), pax extended headers (`x`:
`path`, `size`), base-256 sizes; regular files (`0`, NUL, `7`) become members, directories,
links and others are passed over, global pax headers (`g`) ignored. A member whose data runs
past the object's end, a header cut short, or no end-of-archive marker (a truncated shard) ends
the listing with a problem naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BLOCK = 512
#: Longest GNU long name or pax header read (real ones are a few hundred bytes).
MAX_META_BYTES = 1 << 20

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> bytes (short at the end)


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # of the data, in the tar object
    size: int


@dataclass
class Listing:
    members: list[Member]
    problem: str | None = None  # why the listing stopped early, if it did


def _number(field: bytes) -> int:
    """A header number: octal text (NUL/space padded) or GNU base-256 (high bit set)."""
    if field and field[0] & 0x80:
        value = field[0] & 0x3F
        for b in field[1:]:
            value = (value << 8) | b
        if field[0] & 0x40:
            raise ValueError("negative number")
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    return int(text, 8)  # ValueError for anything but octal digits


def _checksum_ok(header: bytes) -> bool:
    try:
        recorded = _number(header[148:156])
    except ValueError:
        return False
    unsigned = sum(header[:148]) + 32 * 8 + sum(header[156:])
    signed = unsigned - 2 * sum(b for b in header[:148] + header[156:] if b > 127)
    return recorded in (unsigned, signed)


#: The first bytes of compressed files a `.tar` name may hold (`tar czf x.tar`...).
_COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
    (b"\x04\x22\x4d\x18", "lz4"),
)


def _compression(head: bytes) -> str | None:
    return next((name for magic, name in _COMPRESSED_MAGIC if head.startswith(magic)), None)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """`len key=value\\n` records; malformed ones end the parse (ValueError)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break
        space = data.find(b" ", pos)
        if space < 0:
            raise ValueError("pax record without a length")
        length = int(data[pos:space])
        if length <= space - pos + 1 or pos + length > len(data):
            raise ValueError("pax record length out of range")
        record = data[space + 1 : pos + length]
        if not record.endswith(b"\n") or b"=" not in record:
            raise ValueError("malformed pax record")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def list_members(read_at: ReadAt, size: int) -> Listing:
    """The regular-file members of a tar object of `size` bytes, in order."""
    members: list[Member] = []
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos + BLOCK <= size:
        header = read_at(pos, BLOCK)
        if len(header) < BLOCK:
            return Listing(members, f"header at byte {pos} cut short (truncated tar)")
        if header.count(0) == BLOCK:
            return Listing(members)  # end-of-archive marker
        if not _checksum_ok(header):
            packed = _compression(header) if pos == 0 else None
            if packed is not None:
                return Listing(
                    members,
                    f"{packed}-compressed, not a tar: a sample is one read at its member's "
                    "offset, which a compressed stream does not allow; decompress it",
                )
            return Listing(members, f"damaged tar header at byte {pos}")
        try:
            member_size = _number(header[124:136])
        except ValueError:
            return Listing(members, f"damaged size field in the tar header at byte {pos}")
        kind = header[156:157]
        data_at = pos + BLOCK
        if "size" in pax:
            try:
                member_size = int(pax["size"])
            except ValueError:
                return Listing(members, f"damaged pax size before byte {pos}")
        if member_size < 0:
            return Listing(members, f"negative size in the tar header at byte {pos}")
        following = data_at + (member_size + BLOCK - 1) // BLOCK * BLOCK
        if kind in (b"L", b"x", b"g"):
            if member_size > MAX_META_BYTES or data_at + member_size > size:
                return Listing(members, f"oversized or cut extended header at byte {pos}")
            data = read_at(data_at, member_size)
            if len(data) < member_size:
                return Listing(members, f"extended header at byte {pos} cut short")
            if kind == b"L":
                long_name = _text(data)
            elif kind == b"x":
                try:
                    pax = _pax(data)
                except ValueError as exc:
                    return Listing(members, f"damaged pax header at byte {pos}: {exc}")
            pos = following
            continue
        name = _text(header[0:100])
        if header[257:262] == b"ustar":
            prefix = _text(header[345:500])
            if prefix:
                name = f"{prefix}/{name}"
        name = pax.get("path", long_name if long_name is not None else name)
        long_name, pax = None, {}
        if kind in (b"0", b"\0", b"7"):
            if data_at + member_size > size:
                return Listing(
                    members,
                    f"member {name!r} at byte {data_at} needs {member_size} bytes, the tar "
                    f"ends at {size} (truncated tar)",
                )
            members.append(Member(name, data_at, member_size))
        pos = following
    return Listing(members, _cut_end(read_at, pos, size))


def _cut_end(read_at: ReadAt, pos: int, size: int) -> str | None:
    """Why a listing that ran to the object's end without an end-of-archive marker is short,
    or None: every tar writer ends with zero blocks, so a tar that stops at a header (part
    of one, or right before one, as a copy cut at a block boundary does) lost whatever came
    after, and is named rather than served short in silence. Zero bytes shorter than a block
    are a cut end marker: nothing lost."""
    if size == 0:
        return "empty file (no tar header)"
    if pos >= size:
        return f"no end-of-archive marker: the tar ends at byte {size} (truncated tar)"
    tail = read_at(pos, size - pos)
    if tail.count(0) == len(tail):
        return None
    return f"header at byte {pos} cut short: {size - pos} of {BLOCK} bytes (truncated tar)"
