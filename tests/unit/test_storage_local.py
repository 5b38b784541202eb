"""pipeline/storage/local.py (and the `Store` protocol of base.py it implements): a folder on
this host as a store, on real files, folders, symlinks and FIFOs. Keys stay under the root
whatever they say (``..``, absolute paths); only regular files are objects (a FIFO is never
opened for reading, so it cannot block); symlinks are followed, a linked folder walked once;
range reads come back short past the end; writes appear whole or not at all."""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from batchwire.pipeline.decode.files import NotARegularFile
from batchwire.pipeline.storage.base import ObjectInfo, ObjectWriter, Store
from batchwire.pipeline.storage.local import AbortOnExit, LocalStore, LocalWriter

DATA = bytes(range(256)) * 4  # 1 KiB, every byte value


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ with a.bin (DATA), ab.txt, empty, sub/c.bin, sub/deep/d.bin; outside/ beside it."""
    root = tmp_path / "root"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "a.bin").write_bytes(DATA)
    (root / "ab.txt").write_bytes(b"ab")
    (root / "empty").write_bytes(b"")
    (root / "sub" / "c.bin").write_bytes(b"c" * 10)
    (root / "sub" / "deep" / "d.bin").write_bytes(b"d")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"not yours")
    return root


def keys(store: LocalStore, prefix: str = "") -> list[str]:
    return [o.key for o in store.list(prefix)]


def finishes(call: Callable[[], object], fifo: Path) -> object:
    """`call()`'s result or exception, failing (not hanging) if it blocks on `fifo`: after 5 s a
    writer opens the FIFO, which releases a reader blocked in open."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    blocked = thread.is_alive()
    if blocked:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
    assert not blocked, f"blocked opening the FIFO {fifo}"
    return result[0]


# -- the protocol ----------------------------------------------------------------------------


def test_a_local_store_and_its_writer_are_the_protocols(tree: Path) -> None:
    store = LocalStore(tree)
    assert isinstance(store, Store)
    with store.open_writer("w.bin") as writer:
        assert isinstance(writer, ObjectWriter)
    info = ObjectInfo("a.bin", 3, "v")
    assert info == ObjectInfo("a.bin", 3, "v") and hash(info) == hash(ObjectInfo("a.bin", 3, "v"))
    with pytest.raises(AttributeError):
        info.size = 4  # type: ignore[misc]  # frozen: an index keyed by it cannot drift


def test_abort_on_exit_needs_the_writers_abort() -> None:
    with pytest.raises(NotImplementedError), AbortOnExit():
        pass


# -- the root and keys -----------------------------------------------------------------------


def test_the_root_is_resolved_once(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link = tree.parent / "link-to-root"
    link.symlink_to(tree)
    monkeypatch.chdir(tree.parent)
    for given in ("link-to-root", link, "./root/sub/..", str(tree) + "/"):
        store = LocalStore(given)
        assert store.root == tree.resolve() and store.display == str(tree.resolve())
        assert store.namespace == f"file://{tree.resolve()}"
        assert store.read("a.bin") == DATA
    monkeypatch.setenv("HOME", str(tree.parent))
    assert LocalStore("~/root").root == tree.resolve()


def test_keys_name_paths_under_the_root(tree: Path) -> None:
    store = LocalStore(tree)
    assert store.path("sub/c.bin") == str(tree / "sub" / "c.bin")
    assert store.path("sub/../a.bin") == str(tree / "a.bin")  # climbs, but stays inside
    assert store.path("./sub//deep/d.bin") == str(tree / "sub" / "deep" / "d.bin")
    assert store.read("sub/./deep/../c.bin") == b"c" * 10
    assert store.where("sub/c.bin") == os.path.join(tree, "sub/c.bin")


HOSTILE_KEYS = [
    "../outside/secret",
    "sub/../../outside/secret",
    "..",
    "../root-sibling/x",  # a sibling sharing the root's name as a prefix: still outside
    "sub/deep/../../../outside/secret",
]


@pytest.mark.parametrize("key", [*HOSTILE_KEYS, "/etc/passwd", "//etc/passwd"])
def test_a_key_cannot_climb_out_of_the_root(tree: Path, key: str) -> None:
    store = LocalStore(tree)
    outside = os.listdir(tree.parent)
    for call in (
        store.path,
        store.head,
        store.read,
        lambda k: store.read_ranges(k, [(0, 4)]),
        lambda k: store.put(k, b"overwritten"),
        store.open_writer,
    ):
        with pytest.raises(PermissionError, match="is outside"):
            call(key)
    [failed] = store.read_many([key])
    assert isinstance(failed, PermissionError)  # in place: a bad sample, not a failed batch
    [failed] = store.read_ranges_many([(key, [(0, 4)])])
    assert isinstance(failed, PermissionError)
    assert os.listdir(tree.parent) == outside  # nothing written beside the root
    assert (tree.parent / "outside" / "secret").read_bytes() == b"not yours"


def test_a_store_at_the_filesystem_root_takes_absolute_looking_keys(tree: Path) -> None:
    store = LocalStore("/")
    assert store.read(str(tree / "a.bin").lstrip("/")) == DATA
    assert store.path("../../etc") == "/etc"  # '..' of '/' is '/': nothing above to reach


# -- listing ---------------------------------------------------------------------------------


def test_list_is_every_file_sorted_by_key_with_its_size_and_version(tree: Path) -> None:
    store = LocalStore(tree)
    listed = store.list()
    assert [o.key for o in listed] == ["a.bin", "ab.txt", "empty", "sub/c.bin", "sub/deep/d.bin"]
    assert [o.size for o in listed] == [1024, 2, 0, 10, 1]
    for info in listed:
        assert store.head(info.key) == info  # head and list agree
        st = os.stat(tree / info.key)
        assert info.version == f"{st.st_size}-{st.st_mtime_ns}"


def test_list_prefixes_are_key_prefixes_not_folders(tree: Path) -> None:
    store = LocalStore(tree)
    assert keys(store, "a") == ["a.bin", "ab.txt"]
    assert keys(store, "sub/") == ["sub/c.bin", "sub/deep/d.bin"]
    assert keys(store, "sub/d") == ["sub/deep/d.bin"]
    assert keys(store, "a.bin") == ["a.bin"]
    assert keys(store, "zzz") == [] and keys(store, "/") == []


def test_a_version_changes_with_the_contents(tree: Path) -> None:
    store = LocalStore(tree)
    before = store.head("ab.txt").version
    (tree / "ab.txt").write_bytes(b"abc")
    assert store.head("ab.txt").version != before and store.head("ab.txt").size == 3
    os.utime(tree / "ab.txt", ns=(1, 1))
    same_size = store.head("ab.txt").version
    os.utime(tree / "ab.txt", ns=(2, 2))
    assert store.head("ab.txt").version != same_size  # rewritten in place: the mtime tells


def test_only_regular_files_are_listed(tree: Path) -> None:
    os.mkfifo(tree / "pipe.bin")
    os.mkfifo(tree / "sub" / "pipe.jpg")
    (tree / "dangling").symlink_to(tree / "gone")
    store = LocalStore(tree)
    assert keys(store) == ["a.bin", "ab.txt", "empty", "sub/c.bin", "sub/deep/d.bin"]


def test_symlinks_are_followed_and_a_linked_folder_listed_once(tree: Path) -> None:
    (tree / "link.bin").symlink_to(tree / "a.bin")
    (tree / "shared").symlink_to(tree.parent / "outside")  # a folder of links to a shared copy
    (tree / "sub" / "deep" / "up").symlink_to("../..")  # a loop back to the root
    (tree / "sub" / "deep" / "up2").symlink_to("..")  # a second loop: 2^depth paths if walked
    store = LocalStore(tree)
    assert keys(store) == [
        "a.bin",
        "ab.txt",
        "empty",
        "link.bin",
        "shared/secret",
        "sub/c.bin",
        "sub/deep/d.bin",
    ]
    assert store.read("link.bin") == DATA and store.head("link.bin").size == len(DATA)
    assert store.read("shared/secret") == b"not yours"


# -- reads -----------------------------------------------------------------------------------


def test_read_is_the_whole_file(tree: Path) -> None:
    store = LocalStore(tree)
    assert store.read("a.bin") == DATA and store.read("empty") == b""
    big = os.urandom(3 << 20)
    (tree / "big.bin").write_bytes(big)
    assert store.read("big.bin") == big


@pytest.mark.parametrize("key", ["gone.bin", "sub/gone/x", "a.bin/x"])
def test_a_missing_object_is_file_not_found(tree: Path, key: str) -> None:
    store = LocalStore(tree)
    for call in (store.head, store.read, lambda k: store.read_ranges(k, [(0, 1)])):
        with pytest.raises((FileNotFoundError, NotADirectoryError)):
            call(key)


def test_a_fifo_or_a_folder_is_refused_without_blocking(tree: Path) -> None:
    fifo = tree / "pipe.bin"
    os.mkfifo(fifo)
    store = LocalStore(tree)
    for call in (
        lambda: store.read("pipe.bin"),
        lambda: store.read_ranges("pipe.bin", [(0, 10)]),
        lambda: store.read_many(["pipe.bin"])[0],
        lambda: store.read_ranges_many([("pipe.bin", [(0, 10)])])[0],
    ):
        err = finishes(call, fifo)
        assert isinstance(err, NotARegularFile) and "a FIFO" in str(err), err
    for call in (store.read, lambda k: store.read_ranges(k, [(0, 1)])):
        for folder in ("sub", "", "."):
            with pytest.raises(NotARegularFile, match="a directory"):
                call(folder)


def test_read_ranges_in_the_order_given(tree: Path) -> None:
    store = LocalStore(tree)
    ranges = [(100, 110), (0, 4), (100, 110), (5, 5), (1020, 1024), (3, 300)]
    assert store.read_ranges("a.bin", ranges) == [DATA[a:b] for a, b in ranges]
    assert store.read_ranges("a.bin", []) == []
    assert store.read_ranges("empty", [(0, 0), (0, 10)]) == [b"", b""]


def test_ranges_at_and_past_the_end_come_back_short(tree: Path) -> None:
    store = LocalStore(tree)
    got = store.read_ranges("a.bin", [(1000, 2000), (1024, 1025), (5000, 6000), (0, 1 << 62)])
    assert got == [DATA[1000:], b"", b"", DATA]  # a corrupt size: never a 4 EiB allocation


@pytest.mark.parametrize("bad", [(10, 5), (-1, 4), (-10, -5)])
def test_an_inverted_or_negative_range_is_an_oserror(tree: Path, bad: tuple[int, int]) -> None:
    store = LocalStore(tree)
    with pytest.raises(OSError):
        store.read_ranges("a.bin", [(0, 4), bad])
    [failed] = store.read_ranges_many([("a.bin", [bad])])
    assert isinstance(failed, OSError)


def test_batched_reads_give_each_objects_error_in_place(tree: Path) -> None:
    os.mkfifo(tree / "pipe.bin")
    store = LocalStore(tree)
    got = store.read_many(["a.bin", "gone.bin", "../outside/secret", "pipe.bin", "empty", "a.bin"])
    assert got[0] == DATA and got[4] == b"" and got[5] == DATA
    assert isinstance(got[1], FileNotFoundError)
    assert isinstance(got[2], PermissionError)
    assert isinstance(got[3], NotARegularFile)
    got = store.read_ranges_many(
        [("a.bin", [(0, 2), (10, 12)]), ("gone.bin", [(0, 1)]), ("sub/c.bin", [(8, 20)])]
    )
    assert got[0] == [DATA[0:2], DATA[10:12]] and got[2] == [b"cc"]
    assert isinstance(got[1], FileNotFoundError)
    assert store.read_many([]) == [] and store.read_ranges_many([]) == []


# -- writes ----------------------------------------------------------------------------------


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*.tmp"))


def test_put_writes_whole_objects_creating_folders(tree: Path) -> None:
    store = LocalStore(tree)
    store.put("new/deeper/x.bin", b"x" * 7)
    assert (tree / "new" / "deeper" / "x.bin").read_bytes() == b"x" * 7
    store.put("a.bin", b"replaced")
    assert store.read("a.bin") == b"replaced"
    store.put("empty-object", b"")
    assert store.head("empty-object").size == 0
    big = os.urandom(4 << 20)
    store.put("big.bin", big)
    assert store.read("big.bin") == big
    assert leftovers(tree) == []


def test_put_replaces_a_symlink_not_what_it_points_at(tree: Path) -> None:
    (tree / "link").symlink_to(tree.parent / "outside" / "secret")
    LocalStore(tree).put("link", b"mine")
    assert not (tree / "link").is_symlink() and (tree / "link").read_bytes() == b"mine"
    assert (tree.parent / "outside" / "secret").read_bytes() == b"not yours"


def test_a_writer_is_invisible_until_commit(tree: Path) -> None:
    store = LocalStore(tree)
    writer = store.open_writer("shards/s-000.tar")
    assert isinstance(writer, LocalWriter)
    tmp = Path(writer.tmp)
    assert tmp.parent == tree / "shards" and tmp.name.startswith(".s-000.tar.")
    assert tmp.name.endswith(f".{os.getpid()}.{threading.get_ident()}.tmp")
    assert writer.write(b"a" * 100) == 100 and writer.write(memoryview(b"b" * 50)) == 50
    words = memoryview(array.array("q", [-1] * 4))  # 4 items, 32 bytes: tell counts bytes
    assert writer.write(words) == 32
    assert writer.tell() == 182
    assert not (tree / "shards" / "s-000.tar").exists()
    with pytest.raises(FileNotFoundError):
        store.head("shards/s-000.tar")
    assert writer.commit() == 182
    assert store.read("shards/s-000.tar") == b"a" * 100 + b"b" * 50 + b"\xff" * 32
    assert not tmp.exists()
    writer.abort()  # a no-op after commit: the object stays
    assert store.head("shards/s-000.tar").size == 182
    for call in (lambda: writer.write(b"more"), writer.commit):
        with pytest.raises(ValueError, match="already committed or aborted"):
            call()


def test_leaving_the_block_without_commit_drops_the_object(tree: Path) -> None:
    store = LocalStore(tree)
    store.put("kept.tar", b"old")
    with pytest.raises(RuntimeError), store.open_writer("kept.tar") as writer:
        writer.write(b"new, torn")
        raise RuntimeError("the producer failed mid-shard")
    with store.open_writer("kept.tar") as writer:
        writer.write(b"new, not committed")
    with store.open_writer("never.tar") as writer:
        writer.write(b"x")
    assert store.read("kept.tar") == b"old" and not (tree / "never.tar").exists()
    assert leftovers(tree) == []
    writer.abort()  # twice: still a no-op
    with pytest.raises(ValueError, match="already committed or aborted"):
        writer.commit()


def test_a_commit_that_fails_raises_and_leaves_no_temporary(tree: Path) -> None:
    store = LocalStore(tree)
    with store.open_writer("sub") as writer:  # a folder is in the way
        writer.write(b"x")
        with pytest.raises(IsADirectoryError):
            writer.commit()
    assert (tree / "sub").is_dir() and leftovers(tree) == []


def test_an_fsynced_writer_commits_the_same(tree: Path) -> None:
    with LocalWriter(str(tree / "synced.bin"), fsync=True) as writer:
        writer.write(DATA)
        assert writer.commit() == len(DATA)
    assert (tree / "synced.bin").read_bytes() == DATA


def test_writers_in_several_threads_each_land_whole(tree: Path) -> None:
    store = LocalStore(tree)
    payloads = {i: bytes([i]) * (1000 + i) for i in range(8)}
    start = threading.Barrier(len(payloads))

    def write(i: int) -> None:
        start.wait()
        store.put(f"own/{i}.bin", payloads[i])
        store.put("shared.bin", payloads[i])  # the same key from every thread

    threads = [threading.Thread(target=write, args=(i,)) for i in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [store.read(f"own/{i}.bin") for i in payloads] == list(payloads.values())
    assert store.read("shared.bin") in payloads.values()  # one writer's, whole
    assert leftovers(tree) == []
