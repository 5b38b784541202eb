"""pipeline/storage/options.py: `StoreOptions`, the one set of object-store read settings the
server's flags, `open_store` and `open_store_dataset` share: its documented defaults, every
bad value refused at construction with all problems named at once (NaN too), and the process's
default options (`set_default_options`, what the server sets once from its flags)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
from batchwire.pipeline.storage.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_LISTING_TTL_S,
    StoreOptions,
    default_options,
    set_default_options,
)

NAN, INF = math.nan, math.inf


@pytest.fixture
def process_defaults() -> Iterator[StoreOptions]:
    """The process's default options as they were; restored after the test."""
    before = default_options()
    yield before
    set_default_options(before)


def test_the_defaults_are_the_documented_ones() -> None:
    options = StoreOptions()
    assert options.concurrency == DEFAULT_CONCURRENCY == 64
    assert options.listing_ttl_s == DEFAULT_LISTING_TTL_S == 3600.0
    assert (options.max_retries, options.retry_timeout_s, options.backoff_max_s) == (5, 15.0, 2.0)
    assert (options.timeout_s, options.connect_timeout_s) == (30.0, 5.0)
    assert options.cache_dir is None and options.cache_size is None  # no cache


def test_options_are_frozen_and_compare_by_value() -> None:
    options = StoreOptions(concurrency=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.concurrency = 9  # type: ignore[misc]
    assert options == StoreOptions(concurrency=8) != StoreOptions()
    assert dataclasses.replace(options, concurrency=9).concurrency == 9


def test_credentials_are_not_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials come from the environment as every S3 tool reads them, never through here,
    so no options object (logged, compared, passed around) can carry one."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-for-tests")
    names = {f.name for f in dataclasses.fields(StoreOptions)}
    assert not {n for n in names if any(w in n for w in ("key", "secret", "token", "endpoint"))}
    assert "not-a-real-secret-for-tests" not in repr(StoreOptions())


@pytest.mark.parametrize(
    "good",
    [
        {"concurrency": 1},
        {"concurrency": 100_000},
        {"max_retries": 0},  # no retries: the loader's own transient path only
        {"retry_timeout_s": 0.001, "backoff_max_s": 1e-6},
        {"timeout_s": INF, "connect_timeout_s": INF},
        {"listing_ttl_s": 0},  # list again at every open
        {"listing_ttl_s": INF},
        {"cache_dir": "/tmp/cache", "cache_size": 1},
        {"cache_dir": "/tmp/cache", "cache_size": 1 << 50},
    ],
)
def test_values_at_the_edges_are_accepted(good: dict[str, object]) -> None:
    options = StoreOptions(**good)  # type: ignore[arg-type]
    assert all(getattr(options, k) == v for k, v in good.items())


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"concurrency": 0}, "store concurrency must be >= 1, got 0"),
        ({"concurrency": -64}, "store concurrency must be >= 1, got -64"),
        ({"max_retries": -1}, "max_retries must be >= 0, got -1"),
        ({"retry_timeout_s": 0}, "retry_timeout_s must be > 0, got 0"),
        ({"backoff_max_s": -2.0}, "backoff_max_s must be > 0, got -2.0"),
        ({"timeout_s": NAN}, "timeout_s must be > 0, got nan"),
        ({"connect_timeout_s": 0.0}, "connect_timeout_s must be > 0, got 0.0"),
        ({"timeout_s": -INF}, "timeout_s must be > 0, got -inf"),
        ({"cache_dir": "/tmp/c", "cache_size": 0}, "cache size must be >= 1 byte, got 0"),
        ({"cache_dir": "/tmp/c"}, "a local cache needs both a directory and a size"),
        ({"cache_size": 1 << 30}, "a local cache needs both a directory and a size"),
        ({"listing_ttl_s": -1}, "listing TTL must be >= 0 s, got -1"),
        ({"listing_ttl_s": NAN}, "listing TTL must be >= 0 s, got nan"),
    ],
)
def test_a_bad_value_is_refused_naming_it(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        StoreOptions(**bad)  # type: ignore[arg-type]
    assert str(info.value) == message or str(info.value).startswith(message + " (")


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError) as info:
        StoreOptions(concurrency=0, max_retries=-1, timeout_s=0, cache_size=0, listing_ttl_s=-5)
    assert str(info.value).split("; ") == [
        "store concurrency must be >= 1, got 0",
        "max_retries must be >= 0, got -1",
        "timeout_s must be > 0, got 0",
        "cache size must be >= 1 byte, got 0",
        "a local cache needs both a directory and a size (--cache-dir DIR --cache-size BYTES)",
        "listing TTL must be >= 0 s, got -5",
    ]


@pytest.mark.usefixtures("process_defaults")
def test_the_process_default_is_what_was_set_last() -> None:
    mine = StoreOptions(concurrency=3, cache_dir="/tmp/cache", cache_size=1 << 20)
    set_default_options(mine)
    assert default_options() is mine
    set_default_options(StoreOptions(concurrency=5))
    assert default_options() == StoreOptions(concurrency=5)
