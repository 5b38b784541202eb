"""`PackedStrings`: many strings in one buffer, for sources of a million rows.

A Python list of a million paths costs about 110 MB (a 49-byte object header and an 8-byte
slot each, on top of the characters); the same paths as UTF-8 in one buffer, with the shared
folder written once and an int64 end offset per row, cost the characters plus 8 bytes a row
(about 40 MB for a 10^6-row manifest of ImageNet-style paths). `[i]` decodes one string when
asked (a fraction of a microsecond: sample reads and log lines, never a hot loop).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

# Marks a stored string that does not start with the prefix (kept whole). NUL is never in a
# path (sources refuse it), so it cannot clash with a stored tail.
_WHOLE = "\0"


class PackedStrings(Sequence[str]):
    """An append-only sequence of strings, each `prefix + tail` stored as its tail (or whole,
    when it does not start with `prefix`), in one UTF-8 buffer with end offsets."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._buf = bytearray()
        self._ends = array("q")

    def append(self, text: str) -> None:
        if text.startswith(self.prefix):
            stored = text[len(self.prefix) :]
            if stored.startswith(_WHOLE):  # cannot be told from the marker: keep it whole
                stored = _WHOLE + text
        else:
            stored = _WHOLE + text
        self._buf += stored.encode("utf-8", "surrogatepass")
        self._ends.append(len(self._buf))

    def __len__(self) -> int:
        return len(self._ends)

    def _get(self, i: int) -> str:
        start = self._ends[i - 1] if i > 0 else 0
        stored = self._buf[start : self._ends[i]].decode("utf-8", "surrogatepass")
        return stored[1:] if stored.startswith(_WHOLE) else self.prefix + stored

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._get(k) for k in range(*i.indices(len(self)))]
        n = len(self._ends)
        k = int(i)
        if not -n <= k < n:
            raise IndexError(f"index {i} out of range for {n} strings")
        return self._get(k % n)

    def __iter__(self) -> Iterator[str]:
        return (self._get(k) for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by contents

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings, prefix {self.prefix!r})"

    def nbytes(self) -> int:
        """Bytes held (the buffer and the offsets)."""
        return len(self._buf) + self._ends.itemsize * len(self._ends)
