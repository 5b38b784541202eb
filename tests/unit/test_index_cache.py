"""The .npz caches (`pipeline/index_cache.py`'s helpers): read from many threads at once.

numpy parses each member's header with `ast.literal_eval`, and on CPython 3.11 two threads
building ASTs at once can fail with "SystemError: AST constructor recursion depth mismatch"
when a garbage collection runs a finalizer inside (python/cpython#106905). A tar dataset reads
its shard indexes from a pool, so one such error failed a whole `open_dataset`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline.index_cache import pack_strings, read_npz
from batchwire.pipeline.sources import tarindex

THREADS = 8
READS = 300


class _Finalized:
    """Cyclic garbage with a finalizer: a collection runs Python code, so the GIL changes hands."""

    def __del__(self) -> None:
        sum(range(50))


@pytest.fixture
def switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _index() -> tarindex.ShardIndex:
    keys = [f"sample{i:03d}" for i in range(5)]
    return tarindex.ShardIndex(
        keys=keys,
        exts=["jpg"] * 5,
        offsets=np.arange(5, dtype=np.int64) * 1024,
        sizes=np.full(5, 1000, dtype=np.int64),
        label_text=["cat", "dog", "cat", "3", "dog"],
        label_is_name=np.array([True, True, True, False, True]),
        problems=[],
    )


def test_shard_indexes_read_from_many_threads_while_finalizers_run(
    tmp_path: Path, switch_often: None
) -> None:
    path = tmp_path / "index.npz"
    tarindex.save(path, _index())
    errors: list[BaseException] = []
    wrong: list[object] = []

    def reads() -> None:
        for _ in range(READS):
            for _ in range(10):
                garbage = _Finalized()
                garbage.self = garbage  # type: ignore[attr-defined]
            try:
                got = tarindex.load(path)
            except BaseException as exc:  # the test counts every kind
                errors.append(exc)
                continue
            if got is None or got.keys != _index().keys:
                wrong.append(got)

    threads = [threading.Thread(target=reads) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} of {THREADS * READS} reads failed: {errors[0]!r}"
    assert not wrong


def test_read_npz_returns_every_array_and_raises_what_np_load_raises(tmp_path: Path) -> None:
    path = tmp_path / "cache.npz"
    np.savez(path, version=np.array([1]), names=pack_strings(["a", "b"]))
    got = read_npz(path)
    assert sorted(got) == ["names", "version"]
    assert got["version"].tolist() == [1]
    with pytest.raises(FileNotFoundError):
        read_npz(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError):
        read_npz(tmp_path / "bad.npz")
