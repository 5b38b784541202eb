"""EXIF orientation from the bytes: the Orientation tag (0x0112) of a JPEG, PNG or WebP file.

Cameras store pixels in sensor order and record how to turn them in the EXIF Orientation tag;
every viewer (and PIL's `ImageOps.exif_transpose`, which most training code uses) honours it.
We read only that one tag, straight from the bytes, so the header pass stays cheap, and we never
trust the bytes: any malformed EXIF means "orientation 1", never an exception. What each value
does to the pixels is `orientation.py`'s business.
"""

from __future__ import annotations

import struct

ORIENTATION_TAG = 0x0112
_EXIF_MAGIC = b"Exif\x00\x00"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_MAX_IFD_ENTRIES = 1024  # a sane IFD0 has a few dozen; more means garbage


def orientation_from_tiff(tiff: bytes | memoryview) -> int:
    """Orientation from a TIFF structure (the payload after "Exif\\0\\0"); 1 if absent or bad."""
    try:
        buf = bytes(tiff)
        if len(buf) < 8:
            return 1
        if buf[:4] == b"II*\x00":
            endian = "<"
        elif buf[:4] == b"MM\x00*":
            endian = ">"
        else:
            return 1
        (ifd,) = struct.unpack_from(endian + "I", buf, 4)
        if ifd < 8 or ifd + 2 > len(buf):
            return 1
        (count,) = struct.unpack_from(endian + "H", buf, ifd)
        count = min(count, _MAX_IFD_ENTRIES, (len(buf) - ifd - 2) // 12)
        for k in range(count):
            tag, typ, n = struct.unpack_from(endian + "HHI", buf, ifd + 2 + 12 * k)
            if tag != ORIENTATION_TAG:
                continue
            # SHORT (3) is the standard type; some writers use LONG (4). Value sits inline.
            if typ == 3 and n >= 1:
                (value,) = struct.unpack_from(endian + "H", buf, ifd + 2 + 12 * k + 8)
            elif typ == 4 and n >= 1:
                (value,) = struct.unpack_from(endian + "I", buf, ifd + 2 + 12 * k + 8)
            else:
                return 1
            return int(value) if 1 <= value <= 8 else 1
        return 1
    except (struct.error, ValueError, IndexError):
        return 1


def _jpeg_exif(data: bytes) -> memoryview | None:
    """The TIFF payload of the first "Exif" APP1 segment (as PIL takes the first), or None."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    view = memoryview(data)
    pos = 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None  # lost sync: not a marker where one must be
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD9, 0xDA):  # EOI or start of scan: no more header segments
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers without length
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2:
            return None
        start, end = pos + 4, pos + 2 + length
        if marker == 0xE1 and end <= n and data[start : start + 6] == _EXIF_MAGIC:
            return view[start + 6 : end]
        pos = end
    return None


def _chunk_tiff(payload: memoryview) -> memoryview:
    """The TIFF structure of a PNG or WebP EXIF chunk: some writers keep the JPEG-style
    `_EXIF_MAGIC` prefix inside the chunk."""
    return payload[6:] if bytes(payload[:6]) == _EXIF_MAGIC else payload


def _png_exif(data: bytes) -> memoryview | None:
    """The payload of a PNG eXIf chunk (a bare TIFF structure), or None."""
    if not data.startswith(_PNG_MAGIC):
        return None
    view = memoryview(data)
    pos, n = len(_PNG_MAGIC), len(data)
    while pos + 8 <= n:
        (length,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4 : pos + 8]
        start, end = pos + 8, pos + 8 + length
        if end > n:
            return None
        if kind == b"eXIf":
            return _chunk_tiff(view[start:end])
        if kind == b"IEND":
            return None
        pos = end + 4  # skip the CRC
    return None


def _webp_exif(data: bytes) -> memoryview | None:
    """The payload of a WebP (RIFF) EXIF chunk, a TIFF structure, or None."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    view = memoryview(data)
    pos, n = 12, len(data)
    while pos + 8 <= n:
        kind = data[pos : pos + 4]
        (length,) = struct.unpack_from("<I", data, pos + 4)
        start, end = pos + 8, pos + 8 + length
        if end > n:
            return None
        if kind == b"EXIF":
            return _chunk_tiff(view[start:end])
        pos = end + (length & 1)  # chunks are padded to an even size
    return None


def read_orientation(data: bytes) -> int:
    """EXIF orientation (1-8) of a JPEG (APP1), PNG (eXIf) or WebP (EXIF chunk) file; 1 when
    absent or malformed."""
    try:
        for find in (_jpeg_exif, _png_exif, _webp_exif):
            tiff = find(data)
            if tiff is not None:
                return orientation_from_tiff(tiff)
        return 1
    except (IndexError, ValueError, struct.error):
        return 1
