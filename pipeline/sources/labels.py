"""Labels as sources write them (integer ids or class names) turned into int64 ids.

A source's labels are all integers (ids, and its classes are their names "0" .. "max") or all
class names (sorted names give ids, as torchvision's ImageFolder does, so a CSV of names and an
ImageFolder of the same classes give the same ids). A mix is an error naming where it happened:
"3" meaning class 3 in one row and "tench" a name in the next is a dataset bug, not a choice.

Multi-label: a sample's label may be a list of labels (`parse_labels`; ids or names, the same
rule over all of them). A source with any list is multi-label: `LabelTable.resolve_rows` gives
an int64 [N, K] table, K the largest count, short rows padded with `NO_LABEL` (-1).
"""

from __future__ import annotations

from array import array

import numpy as np
from batchwire.pipeline.listfile import MAX_LABEL  # the one bound, list files' too

#: Longest class name accepted (the names reach the trainer in the welcome).
MAX_CLASS_NAME = 256
#: Most labels one sample may have (a multi-label row): the wire carries [B, K] int64.
MAX_LABELS_PER_SAMPLE = 1024
#: What fills a multi-label row after its labels (never a class id).
NO_LABEL = -1


class LabelError(ValueError):
    """A label that is not an integer >= 0 or a class name; the message names where."""


def parse_label(value: object, where: str) -> int | str:
    """One label as written: an int >= 0, or a non-empty class name (a string that is an
    integer in text, as CSV and `.cls` members hold them, is an int)."""
    if isinstance(value, bool):
        raise LabelError(f"{where}: label must be an integer or a class name, got {value!r}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_LABEL:
            raise LabelError(f"{where}: label must be 0 to {MAX_LABEL}, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise LabelError(f"{where}: empty label")
        try:
            number = int(text)
        except ValueError:
            if len(text) > MAX_CLASS_NAME or "\0" in text:
                raise LabelError(f"{where}: class name too long or holding NUL") from None
            return text
        if not 0 <= number <= MAX_LABEL:
            raise LabelError(f"{where}: label must be 0 to {MAX_LABEL}, got {number}")
        return number
    if isinstance(value, list):
        raise LabelError(f"{where}: a list of labels where one label is expected")
    raise LabelError(
        f"{where}: label must be an integer or a class name, got {type(value).__name__}"
    )


def parse_labels(value: object, where: str) -> int | str | list[int | str]:
    """A sample's label as written: one label (`parse_label`), or a list of them (multi-label:
    a JSON array; in a CSV cell, a JSON array or names / ids separated by `|`). An empty list,
    a non-label member or more than `MAX_LABELS_PER_SAMPLE` labels is a `LabelError`."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            try:
                value = json.loads(text)
            except ValueError as exc:
                raise LabelError(f"{where}: label list is not a JSON array ({exc})") from None
            if not isinstance(value, list):
                raise LabelError(f"{where}: label list is not a JSON array")
        elif "|" in text:
            value = text.split("|")
    if not isinstance(value, list):
        return parse_label(value, where)
    if not value:
        raise LabelError(f"{where}: empty list of labels (give at least one)")
    if len(value) > MAX_LABELS_PER_SAMPLE:
        raise LabelError(
            f"{where}: {len(value)} labels, more than the {MAX_LABELS_PER_SAMPLE} a sample may have"
        )
    return [parse_label(v, f"{where}: label {k}") for k, v in enumerate(value)]


class LabelTable:
    """Collects one label per sample, then `resolve()`s them all to ids and class names.

    Kept compact for million-row manifests: integer labels in an int64 array, class names
    once each (a dict of first-seen codes) with an int32 code per label, counts per sample in
    an int32 array: a few bytes a row, never a Python object per row."""

    def __init__(self) -> None:
        self._ints = array("q")
        self._codes = array("i")  # a class name's first-seen code, per label
        self._name_code: dict[str, int] = {}
        self._first_int: str | None = None
        self._first_name: str | None = None
        self._counts = array("i")  # labels per sample
        self._multi = False  # some sample had a list of labels

    def add(self, label: int | str | list[int | str], where: str) -> None:
        """One sample's label, or its list of labels (multi-label)."""
        if isinstance(label, list):
            for one in label:
                self._add_one(one, where)
            self._counts.append(len(label))
            self._multi = True
            return
        self._add_one(label, where)
        self._counts.append(1)

    def _add_one(self, label: int | str, where: str) -> None:
        if isinstance(label, int):
            if self._first_name is not None:
                raise LabelError(
                    f"{where}: integer label {label} in a dataset labelled by class names "
                    f"(first name at {self._first_name}); use one or the other"
                )
            self._first_int = self._first_int or where
            self._ints.append(label)
        else:
            if self._first_int is not None:
                raise LabelError(
                    f"{where}: class name {label!r} in a dataset labelled by integers (first "
                    f"integer at {self._first_int}); use one or the other"
                )
            self._first_name = self._first_name or where
            code = self._name_code.setdefault(label, len(self._name_code))
            self._codes.append(code)

    def extend_ints(self, ids: np.ndarray, where: str) -> None:
        """Many integer labels at once, e.g. a Parquet label column."""
        bad = np.flatnonzero((ids < 0) | (ids > MAX_LABEL))
        if bad.size:
            row, value = int(bad[0]), int(ids[bad[0]])
            raise LabelError(f"{where}: row {row}: label must be 0 to {MAX_LABEL}, got {value}")
        if self._first_name is not None and len(ids):
            raise LabelError(f"{where}: integer labels in a dataset labelled by class names")
        self._first_int = self._first_int or where
        self._ints.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        self._counts.frombytes(np.ones(len(ids), dtype=np.int32).tobytes())

    def __len__(self) -> int:
        return len(self._counts)

    def resolve(self, names: list[str] | None = None) -> tuple[np.ndarray, list[str]]:
        """(int64 ids, class names). `names`: class names known from elsewhere (Parquet
        features, a dataset card) that integer labels index; names seen are sorted otherwise."""
        if self._name_code:
            classes = sorted(self._name_code)
            sorted_id = np.empty(len(classes), dtype=np.int64)  # first-seen code -> id
            for i, c in enumerate(classes):
                sorted_id[self._name_code[c]] = i
            return sorted_id[np.frombuffer(self._codes, dtype=np.int32)], classes
        ids = np.frombuffer(self._ints, dtype=np.int64).copy()
        count = int(ids.max()) + 1 if ids.size else 0
        if names is not None and len(names) >= count:
            return ids, list(names)
        return ids, [str(c) for c in range(count)]

    def resolve_rows(
        self, names: list[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
        """(int64 [N] ids, int64 [N, K] rows or None, class names): `resolve`, and for a
        multi-label source each sample's ids in the order written, padded with `NO_LABEL` to
        K, the largest count; [N] then holds each sample's first label."""
        flat, classes = self.resolve(names)
        if not self._multi:
            return flat, None, classes
        counts = np.frombuffer(self._counts, dtype=np.int32).astype(np.int64)
        width = int(counts.max())
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        rows = np.full((len(counts), width), NO_LABEL, dtype=np.int64)
        col = np.arange(len(flat), dtype=np.int64) - np.repeat(starts, counts)
        rows[np.repeat(np.arange(len(counts)), counts), col] = flat
        return flat[starts], rows, classes
