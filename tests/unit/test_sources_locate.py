"""pipeline.sources.locate: what a `--train`/`--val` argument names (kind, store, keys), told by
name, first bytes and first line, over real files, folders, symlinks, list files and patterns.

tests/unit/test_sources.py covers `source_kind` over each kind and the basic brace patterns; these
cover the rest: brace details and bounds, keys and stores, folders, shard lists, symlinks, odd
names, missing files, and URLs (only what needs no network) whose credentials must not show."""

from __future__ import annotations

import importlib
import logging
import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from batchwire.pipeline.sources.locate import (
    expand_braces,
    is_classic,
    local_kind,
    locate,
    sniff_bytes,
    sniff_text,
)

# the module (the package's `locate` attribute is the function of that name)
loc = importlib.import_module("batchwire.pipeline.sources.locate")
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"


def _tar(path: Path) -> Path:
    """A real (empty-member) USTAR tar: what a shard's first bytes look like."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        t.addfile(tarfile.TarInfo("s0.cls"))
    return path


def _parquet_head(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PAR1" + bytes(60) + b"PAR1")
    return path


# --------------------------------------------------------------------------- brace patterns


def test_zero_padding_pads_to_the_wider_bound_as_bash_does() -> None:
    """`echo {0..010}` is 000 .. 010 and `echo {00..100}` is 000 .. 100 in bash (WebDataset's
    braceexpand too); no leading zero, no padding."""
    assert expand_braces("t-{0..010}.tar")[:2] == ["t-000.tar", "t-001.tar"]
    assert expand_braces("t-{00..100}.tar")[::50] == ["t-000.tar", "t-050.tar", "t-100.tar"]
    assert expand_braces("{08..10}") == ["08", "09", "10"]
    assert expand_braces("{8..10}") == ["8", "9", "10"]
    assert expand_braces("{0..0}{5..5}") == ["05"]


def test_alternatives_keep_their_order_and_empty_items() -> None:
    assert expand_braces("d/{val,train}{,-extra}.tar") == [
        "d/val.tar",
        "d/val-extra.tar",
        "d/train.tar",
        "d/train-extra.tar",
    ]
    assert expand_braces("a{}.tar") == ["a.tar"]


@pytest.mark.parametrize(
    "bad",
    [
        "x-{0..²}.tar",  # str.isdigit() is True for '²', int() refuses it
        "x-{٠..٣}.tar",  # Arabic-Indic digits: not a shard number
        "x-{0.." + "9" * 5000 + "}.tar",  # beyond int()'s digit limit
        "x-{1..2..3}.tar",
        "x-{a..c}.tar",
        "x-{-1..2}.tar",
    ],
    ids=["superscript", "arabic-indic", "5000-digits", "two-dots", "letters", "negative"],
)
def test_a_malformed_range_is_a_value_error_naming_the_pattern(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        expand_braces(bad)
    assert str(err.value).startswith(repr(bad)[:40]), err.value


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ("s/t-{0..1}-{x..y}.tar", "a range must be"),
        ("s/t-{0..1}}.tar", "unbalanced or nested"),
        ("s/t-{0..1}-{a,{b,c}}.tar", "unbalanced or nested"),
        ("s/t-}{0..1}.tar", "unbalanced or nested"),
    ],
)
def test_an_error_in_a_later_group_names_the_whole_pattern(bad: str, what: str) -> None:
    """Not the fragment after the first group ('-{x..y}.tar', '}.tar')."""
    with pytest.raises(ValueError, match=what) as err:
        expand_braces(bad)
    assert str(err.value).startswith(repr(bad) + ":"), err.value


def test_the_name_count_is_bounded_before_names_are_made(monkeypatch) -> None:
    """At most MAX_PATTERN_ITEMS names, counted over all groups (a typo like {0..99}{0..99}
    for {00..99} must not eat memory); exactly the bound is fine."""
    monkeypatch.setattr(loc, "MAX_PATTERN_ITEMS", 1000)
    assert len(expand_braces("{0..9}{0..99}")) == 1000
    assert len(expand_braces("{000..999}")) == 1000
    for bad in ("{0..99}{0..99}", "{0..1000}", "{a,b}{000..999}"):
        with pytest.raises(ValueError, match=r"too large|more than 1000 names"):
            expand_braces(bad)


def test_huge_products_are_refused_without_building_them() -> None:
    """Three groups of a thousand (a billion names) at the real bound: refused from the counts,
    with next to nothing allocated (making a million names first would take ~100 MB)."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="more than 1000000 names"):
            expand_braces("{000..999}{000..999}{000..999}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 1e6:.1f} MB allocated to refuse it: names were made first"


def test_a_credential_in_a_url_pattern_is_not_echoed() -> None:
    with pytest.raises(ValueError) as err:
        expand_braces(f"s3://AKIDEXAMPLE:{SECRET}@bucket/t-{{0..}}.tar")
    assert SECRET not in str(err.value) and "s3://bucket/t-{0..}.tar" in str(err.value)


# --------------------------------------------------------------------------- sniffing


def test_sniff_bytes_needs_the_magic_where_it_belongs() -> None:
    ustar = bytes(257) + b"ustar" + bytes(250)
    assert sniff_bytes(ustar) == "tar"
    assert sniff_bytes(b"PAR1" + bytes(10)) == "parquet"
    assert sniff_bytes(ustar[:261]) is None  # cut short inside the magic
    assert sniff_bytes(b"ustar" + bytes(300)) is None  # at the wrong offset
    assert sniff_bytes(b"") is None


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (b"\n# a comment\n\n   \nimgs/a.jpg 3\n", "list"),
        (b"imgs/a.jpg -1\n", "list"),
        (b"my photos/a b.jpg 12\n", "list"),  # a space in the path: the label is the last word
        (b"imgs/a.jpg tench\n", "namedlist"),
        (b"path,label\n", "csv"),
        (b'  {"path": "a.jpg", "label": 1}\n', "jsonl"),
        (b"train-000.tar\n", "shardlist"),
        (b"s3://bucket/p/train-000.TAR\n", "shardlist"),
        (b"data/part-0.parquet\n", "shardlist"),
        (b"readme\n", "list"),  # nothing recognisable: the list parser says what is wrong
        (b"", "list"),
        (b"# only a comment\n", "list"),
        (b"\xff\xfe\x00garbage \x80\x81 7\n", "list"),  # not UTF-8: no crash
    ],
)
def test_sniff_text_reads_the_first_content_line(text: bytes, kind: str) -> None:
    assert sniff_text(text) == kind


def test_the_extension_wins_over_the_content(tmp_path) -> None:
    """A shard named .tar is a tar before anything is read (even an empty one); a file without
    a known extension is told by its bytes, then its text."""
    (tmp_path / "empty.TAR").touch()
    assert local_kind(tmp_path / "empty.TAR") == "tar"
    assert local_kind(_parquet_head(tmp_path / "x.pq")) == "parquet"
    tsv = tmp_path / "m.tsv"
    tsv.write_text("not even tab separated\n")
    assert local_kind(tsv) == "csv"
    ndjson = tmp_path / "m.ndjson"
    ndjson.write_text("a.jpg 1\n")
    assert local_kind(ndjson) == "jsonl"
    blob = tmp_path / "blob"
    blob.write_bytes(_tar(tmp_path / "t.tar").read_bytes())
    assert local_kind(blob) == "tar"


def test_a_fifo_is_not_opened_to_sniff_it(tmp_path) -> None:
    """A FIFO named like a list file: refused as not a regular file, never read (which would
    block); `is_classic` leaves it to the classic code, which says so."""
    fifo = tmp_path / "list.txt"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        local_kind(fifo)
    assert is_classic(fifo) is True


# --------------------------------------------------------------------------- is_classic


def test_is_classic(tmp_path) -> None:
    (tmp_path / "imgs" / "cls").mkdir(parents=True)
    (tmp_path / "list.txt").write_text("imgs/cls/a.jpg 0\n")
    (tmp_path / "m.csv").write_text("path,label\n")
    (tmp_path / "shards.txt").write_text("t.tar\n")
    assert is_classic(tmp_path / "imgs") and is_classic(str(tmp_path / "list.txt"))
    assert is_classic(tmp_path / "missing")  # the classic code names what is missing
    assert not is_classic(_tar(tmp_path / "t.tar"))
    assert not is_classic(tmp_path / "m.csv")
    assert not is_classic(tmp_path / "shards.txt")
    assert not is_classic(str(tmp_path / "missing-{0..1}.tar"))  # a pattern: never classic
    assert not is_classic("s3://bucket/imgs")
    assert not is_classic(["a.tar"]) and not is_classic(None)


# --------------------------------------------------------------------------- local sources


def test_a_pattern_keeps_its_order_under_the_common_folder(tmp_path, monkeypatch) -> None:
    """Keys in the order the pattern gives them (not sorted), relative to the folder holding
    them all; relative paths and `..` are taken from the working directory."""
    for name in ("b/t-0.tar", "b/t-1.tar", "a/t-0.tar"):
        _tar(tmp_path / "data" / name)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    got = locate("../data/{b,a}/t-0.tar")
    assert got.kind == "tar" and got.store.display == str(tmp_path / "data")
    assert got.keys == ["b/t-0.tar", "a/t-0.tar"]
    assert got.name(got.keys[1]) == str(tmp_path / "data" / "a" / "t-0.tar")
    assert got.display == "../data/{b,a}/t-0.tar"  # the argument as given
    listed = locate(["../data/b/t-1.tar", str(tmp_path / "data" / "b" / "t-0.tar")])
    assert listed.store.display == str(tmp_path / "data" / "b")
    assert listed.keys == ["t-1.tar", "t-0.tar"]


def test_odd_names(tmp_path) -> None:
    """Spaces, non-ASCII letters, commas and a '#' in shard and folder names."""
    folder = tmp_path / "jeu de données, v2 #1"
    for i in range(2):
        _tar(folder / f"écharde {i}.tar")
    got = locate(str(folder / "écharde {0..1}.tar"))
    assert got.keys == ["écharde 0.tar", "écharde 1.tar"]
    assert got.store.display == str(folder)
    assert locate(folder).keys == ["écharde 0.tar", "écharde 1.tar"]


def test_missing_shards_are_named(tmp_path) -> None:
    _tar(tmp_path / "t-0.tar")
    spec = str(tmp_path / "t-{0..2}.tar")
    with pytest.raises(FileNotFoundError) as err:
        locate(spec)
    msg = str(err.value)
    assert msg.startswith(spec) and "2 of 3 files do not exist" in msg
    assert str(tmp_path / "t-1.tar") in msg
    with pytest.raises(FileNotFoundError, match=f"does not exist: {tmp_path / 'gone.tar'}$"):
        locate(str(tmp_path / "gone.tar"))


def test_names_that_are_not_shards_or_mix_kinds_or_places(tmp_path) -> None:
    _tar(tmp_path / "t.tar")
    _parquet_head(tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"readme\.txt: a pattern or list of objects must name"):
        locate([str(tmp_path / "t.tar"), str(tmp_path / "readme.txt")])
    with pytest.raises(ValueError, match="mixes tar shards and Parquet files"):
        locate([str(tmp_path / "t.tar"), str(tmp_path / "p.parquet")])
    with pytest.raises(ValueError, match="mixes local paths and URLs"):
        locate([str(tmp_path / "t.tar"), "s3://bucket/t.tar"])
    with pytest.raises(ValueError, match="an empty list of shards"):
        locate([])


def test_a_single_file_is_its_folder_and_name(tmp_path) -> None:
    """One shard, one Parquet file, one manifest: the store is its folder, the key its name;
    a shard told by its bytes alone (no extension) too."""
    blob = tmp_path / "d" / "shard-without-suffix"
    blob.write_bytes(_tar(tmp_path / "d" / "t.tar").read_bytes())
    for path, kind in (
        (tmp_path / "d" / "t.tar", "tar"),
        (blob, "tar"),
        (_parquet_head(tmp_path / "d" / "p.parquet"), "parquet"),
    ):
        got = locate(str(path))
        assert (got.kind, got.store.display, got.keys) == (kind, str(path.parent), [path.name])
    manifest = tmp_path / "d" / "m.jsonl"
    manifest.write_text('{"path": "a.jpg", "label": 0}\n')
    got = locate(manifest)
    assert (got.kind, got.keys) == ("jsonl", ["m.jsonl"]) and got.name("") == str(manifest.parent)


def test_a_folder_of_shards(tmp_path, caplog) -> None:
    """Its visible regular .tar files, sorted; hidden files and other files left out, and a
    FIFO named as a shard left out with a warning that names it."""
    folder = tmp_path / "shards"
    for name in ("t-2.tar", "t-10.TAR", "t-1.tar", ".t-0.tar"):
        _tar(folder / name)
    (folder / "classes.txt").write_text("a\n")
    (folder / "._t-1.tar").write_bytes(b"AppleDouble")
    os.mkfifo(folder / "fifo.tar")
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline.sources.locate"):
        got = locate(folder)
    assert got.kind == "tar" and got.store.display == str(folder)
    assert got.keys == ["t-1.tar", "t-10.TAR", "t-2.tar"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "1 name(s) of tar shards left out" in warned[0]
    assert "fifo.tar" in warned[0] and str(folder) in warned[0]


def test_folders_that_are_not_shard_folders(tmp_path) -> None:
    """A sub-folder makes it an ImageFolder; so do shards and Parquet files together. A folder
    of compressed tars alone is a tar folder with no keys: opening it says why."""
    mixed = tmp_path / "mixed"
    _tar(mixed / "t.tar")
    _parquet_head(mixed / "p.parquet")
    assert is_classic(mixed) and local_kind(mixed) == "folder"
    nested = tmp_path / "nested"
    _tar(nested / "t.tar")
    (nested / "cls").mkdir()
    assert local_kind(nested) == "folder"
    (nested / "cls").rmdir()
    (nested / ".cache").mkdir()  # hidden: not a class
    assert local_kind(nested) == "tar"
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "t-0.tar.gz").write_bytes(b"\x1f\x8b")
    (packed / "t-1.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    got = locate(packed)
    assert (got.kind, got.keys) == ("tar", [])


def test_a_shard_list_file_is_read_relative_to_its_folder(tmp_path, monkeypatch) -> None:
    """Comments and blank lines skipped, relative lines (`..` too) from the list's folder,
    not the working directory; absolute lines as written."""
    a = _tar(tmp_path / "other" / "a.tar")
    b = _tar(tmp_path / "lists" / "sub" / "b.tar")
    c = _tar(tmp_path / "c.tar")
    lst = tmp_path / "lists" / "shards.txt"
    lst.write_text(f"# the shards\n\n../other/a.tar\n  sub/b.tar  \n{c}\n")
    monkeypatch.chdir(tmp_path / "other")
    got = locate(lst)
    assert got.kind == "tar" and got.store.display == str(tmp_path)
    assert [got.name(k) for k in got.keys] == [str(a), str(b), str(c)]
    lst.write_text("../other/a.tar\nmissing.tar\n")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "lists" / "missing.tar")):
        locate(lst)


def test_symlinked_shards_keep_their_own_names_and_folder(tmp_path) -> None:
    """Shards that are links into a content-addressed store (as a Hugging Face cache lays them
    out): the shard names and folder the user gave, as when the folder itself is given, so
    `classes.txt` beside them is the one read and errors name the link, not `blobs/<hash>`."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"train-{i}.tar").symlink_to(_tar(tmp_path / "blobs" / f"9f{i}e1c"))
    whole = locate(shards)
    for spec in (str(shards / "train-{0..1}.tar"), [str(shards / "train-0.tar")]):
        got = locate(spec)
        assert got.store.display == whole.store.display == str(shards)
        assert got.keys == whole.keys[: len(got.keys)]
    one = locate(str(shards / "train-1.tar"))
    assert (one.kind, one.store.display, one.keys) == ("tar", str(shards), ["train-1.tar"])
    linked_folder = tmp_path / "via-link"
    linked_folder.symlink_to(shards, target_is_directory=True)
    got = locate(str(linked_folder / "train-{0..1}.tar"))
    assert got.keys == ["train-0.tar", "train-1.tar"] and Path(got.store.display) == shards


def test_a_dangling_symlink_is_a_missing_shard(tmp_path) -> None:
    _tar(tmp_path / "t-0.tar")
    (tmp_path / "t-1.tar").symlink_to(tmp_path / "deleted-blob")
    with pytest.raises(FileNotFoundError, match=f"e.g. {tmp_path / 't-1.tar'}$"):
        locate(str(tmp_path / "t-{0..1}.tar"))


# --------------------------------------------------------------------------- URLs (no network)


def test_url_patterns_and_lists_share_one_prefix() -> None:
    got = locate("s3://bucket/data/train-{00..02}.tar")
    assert got.kind == "tar" and got.store.display == "s3://bucket/data"
    assert got.keys == ["train-00.tar", "train-01.tar", "train-02.tar"]
    assert got.name("train-01.tar") == "s3://bucket/data/train-01.tar"
    two = locate(["gs://bucket/a/x/p-0.parquet", "gs://bucket/a/y/p-1.parquet"])
    assert two.kind == "parquet" and two.store.display == "gs://bucket/a"
    assert two.keys == ["x/p-0.parquet", "y/p-1.parquet"]
    for name, kind in (("train.csv", "csv"), ("val.jsonl", "jsonl")):
        manifest = locate(f"s3://bucket/lists/{name}")  # a manifest: no listing
        got_manifest = (manifest.kind, manifest.store.display, manifest.keys)
        assert got_manifest == (kind, "s3://bucket/lists", [name])


def test_objects_of_one_source_must_be_in_one_bucket() -> None:
    for urls in (
        ["s3://one/t-0.tar", "s3://two/t-1.tar"],
        ["s3://one/t-0.tar", "gs://one/t-1.tar"],
    ):
        with pytest.raises(
            ValueError, match=r"s3://one/t-0\.tar: objects of one source must be in"
        ):
            locate(urls)


@pytest.mark.parametrize(
    "spec",
    [
        f"s3://AKIDEXAMPLE:{SECRET}@bucket/t-{{0..1}}.txt",  # not shards
        f"s3://AKIDEXAMPLE:{SECRET}@bucket/t-{{0..}}.tar",  # malformed range
        [f"s3://AKIDEXAMPLE:{SECRET}@one/t.tar", "gs://two/t.tar"],  # two buckets
        [f"s3://AKIDEXAMPLE:{SECRET}@one/t.tar", "/data/t.tar"],  # URL and path
        [f"s3://AKIDEXAMPLE:{SECRET}@one/t.tar", f"s3://AKIDEXAMPLE:{SECRET}@one/p.parquet"],
        [f"s3://bucket/t-0.tar?X-Amz-Signature={SECRET}", "s3://bucket/t-1.tar"],  # presigned
        f"s3://AKIDEXAMPLE:{SECRET}@bucket/train.csv",  # refused by the store
    ],
    ids=["not-shards", "bad-range", "buckets", "url-and-path", "kinds", "query", "manifest"],
)
def test_credentials_in_urls_never_reach_an_error(spec) -> None:
    with pytest.raises(ValueError) as err:
        locate(spec)
    assert SECRET not in str(err.value) and "AKIDEXAMPLE" not in str(err.value), err.value
