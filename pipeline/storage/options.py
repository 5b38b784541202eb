"""`StoreOptions`: how object stores are read (concurrency, retries, local cache, listing age).

One dataclass shared by `open_store`, `open_store_dataset` and the server's flags, so their
names and defaults cannot drift apart. Credentials and endpoints are not here: they come from
the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL...), as every S3 tool reads them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Reads in flight per store: at 20 ms a request, 64 give ~3,200 objects/s, above what two
# cores decode (~600 img/s) and what a 16-core server decodes (~4,000 ImageNet img/s needs ~80).
DEFAULT_CONCURRENCY = 64
# A cached bucket listing is reused for this long (seconds); 0 lists again at every open.
DEFAULT_LISTING_TTL_S = 3600.0


@dataclass(frozen=True)
class StoreOptions:
    """Settings of object-store reads.

    `concurrency`: requests in flight per store (`read_many`, `read_ranges_many`).
    `max_retries`, `retry_timeout_s`, `backoff_max_s`: obstore's retry of 5xx, timeouts and
    dropped connections (exponential backoff from 100 ms with jitter). Kept short by default:
    once they are used up the sample loader's own transient path takes over (it retries for
    about a second, then the batch fails `transient` and the client asks again), so a store
    that is down for a while costs waiting, never a bad sample, and no read holds a producer
    thread for minutes (obstore's own default is up to 3 minutes).
    `timeout_s`: one request, start to end of the body; `connect_timeout_s`: the connect.
    `cache_dir`, `cache_size`: a bounded local cache of fetched objects (`CachedStore`);
    None: no cache.
    `listing_ttl_s`: how long a cached bucket listing is reused (`listing`).
    """

    concurrency: int = DEFAULT_CONCURRENCY
    max_retries: int = 5
    retry_timeout_s: float = 15.0
    backoff_max_s: float = 2.0
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    cache_dir: str | None = None
    cache_size: int | None = None
    listing_ttl_s: float = DEFAULT_LISTING_TTL_S

    def __post_init__(self) -> None:
        problems = []
        if int(self.concurrency) < 1:
            problems.append(f"store concurrency must be >= 1, got {self.concurrency}")
        if int(self.max_retries) < 0:
            problems.append(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("retry_timeout_s", "backoff_max_s", "timeout_s", "connect_timeout_s"):
            if not float(getattr(self, name)) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cache_size is not None and int(self.cache_size) < 1:
            problems.append(f"cache size must be >= 1 byte, got {self.cache_size}")
        if (self.cache_size is None) != (self.cache_dir is None):
            problems.append(
                "a local cache needs both a directory and a size (--cache-dir DIR "
                "--cache-size BYTES)"
            )
        if not float(self.listing_ttl_s) >= 0:  # NaN too: it would list at every open, silently
            problems.append(f"listing TTL must be >= 0 s, got {self.listing_ttl_s}")
        if problems:
            raise ValueError("; ".join(problems))


_default = StoreOptions()
_default_lock = threading.Lock()


def set_default_options(options: StoreOptions) -> None:
    """Make `options` what every store opened without explicit options uses in this process.

    The server calls it once at start with its flags (--cache-dir, --cache-size,
    --store-concurrency, --listing-ttl), so every source kind that opens a store (folders and
    list files in a bucket here, tar shards and Parquet in `pipeline.sources`) reads with the
    same settings without each passing them along."""
    global _default
    with _default_lock:
        _default = options


def default_options() -> StoreOptions:
    with _default_lock:
        return _default
