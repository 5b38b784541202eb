"""pipeline/storage/stores.py: `open_store` picks the store a location names: a plain path or
``file://`` a `LocalStore`, a bucket URL an `ObjectStore` (built offline: obstore makes no
request until a read), behind a `CachedStore` when the options given, or else the process's,
hold a cache. A URL that cannot be opened is a ValueError naming the problem, never quoting a
credential."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from batchwire.pipeline.storage.cache import CachedStore
from batchwire.pipeline.storage.local import LocalStore
from batchwire.pipeline.storage.objects import ObjectStore
from batchwire.pipeline.storage.options import StoreOptions, default_options, set_default_options
from batchwire.pipeline.storage.stores import open_store


@pytest.fixture
def process_defaults() -> Iterator[None]:
    """Restores the process's default options after a test that sets them."""
    before = default_options()
    yield
    set_default_options(before)


class Where:
    """An `os.PathLike` that is not a `Path` (a user's own path type)."""

    def __fspath__(self) -> str:
        return "data"


def test_a_path_is_a_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for location in (
        tmp_path / "data",
        str(tmp_path / "data"),
        "data",
        "./data/",
        "~/data",
        Where(),
    ):
        store = open_store(location)
        assert type(store) is LocalStore and store.root == tmp_path / "data", location


@pytest.mark.parametrize("scheme", ["file", "FILE", "File"])
def test_a_file_url_is_a_local_store(tmp_path: Path, scheme: str) -> None:
    (tmp_path / "x.bin").write_bytes(b"x")
    store = open_store(f"{scheme}://{tmp_path}")
    assert type(store) is LocalStore and store.root == tmp_path
    assert store.read("x.bin") == b"x"


def test_a_path_that_only_looks_like_a_url_stays_a_path(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s3:" / "bucket")  # one slash: a folder named 's3:'
    assert type(store) is LocalStore and store.root == tmp_path / "s3:" / "bucket"


@pytest.mark.parametrize(
    ("url", "display"),
    [
        ("s3://bucket/train/", "s3://bucket/train"),
        ("gs://bucket", "gs://bucket"),
        ("S3://bucket/x", "s3://bucket/x"),
    ],
)
def test_a_bucket_url_is_an_object_store(url: str, display: str) -> None:
    store = open_store(url, StoreOptions())
    assert type(store) is ObjectStore and store.display == display


def test_a_cache_in_the_options_wraps_the_object_store(tmp_path: Path) -> None:
    options = StoreOptions(cache_dir=str(tmp_path / "cache"), cache_size=1 << 20)
    store = open_store("s3://bucket/train", options)
    assert type(store) is CachedStore and type(store.inner) is ObjectStore
    assert store.inner.display == "s3://bucket/train"
    assert type(open_store(tmp_path, options)) is LocalStore  # a folder is never cached


def test_without_options_the_process_defaults_apply(tmp_path: Path, process_defaults: None) -> None:
    assert type(open_store("s3://bucket/x")) is ObjectStore
    set_default_options(StoreOptions(cache_dir=str(tmp_path / "cache"), cache_size=1 << 20))
    assert type(open_store("s3://bucket/x")) is CachedStore
    assert type(open_store("s3://bucket/x", StoreOptions())) is ObjectStore  # explicit wins


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://host/x", "unsupported URL scheme 'ftp'"),
        ("http://host/x", "unsupported URL scheme 'http'"),
        ("s3://AKIDEXAMPLE:not-a-real-secret@bucket/x", "credentials in the URL"),
    ],
)
def test_a_url_that_cannot_be_opened_is_a_value_error(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        open_store(url)
    assert "not-a-real-secret" not in str(info.value)


def test_credentials_from_the_environment_stay_out_of_the_display(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE0000TEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-for-tests")
    store = open_store("s3://bucket/train", StoreOptions())
    shown = f"{store.display} {getattr(store, 'namespace', '')} {store!r}"
    assert "not-a-real-secret-for-tests" not in shown and "AKIDEXAMPLE0000TEST" not in shown
    assert os.environ["AWS_SECRET_ACCESS_KEY"]  # set: the store was built with it


def test_a_file_url_naming_localhost_is_the_absolute_path(tmp_path: Path) -> None:
    """RFC 8089: `file://localhost/p` is `file:///p` (it opened the relative `localhost/p`)."""
    for url in (f"file://localhost{tmp_path}", f"file://LOCALHOST{tmp_path}", f"file://{tmp_path}"):
        store = open_store(url)
        assert isinstance(store, LocalStore) and store.root == tmp_path.resolve(), url
