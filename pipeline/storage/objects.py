"""`ObjectStore`: S3, GCS and Azure buckets as a `Store`, over obstore (Rust `object_store`).

Why obstore (bench/RESULTS.md, "Object storage"): one API for the three clouds; requests run
on a Rust runtime with the GIL released, so decoding threads keep running while reads wait;
and it costs the client 0.2 ms of CPU per object against s3fs's 1.8 ms (1,766 GETs/s against
207 with 64 in flight, same store, same run). Credentials, region and
endpoint come from the standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true; GOOGLE_*, AZURE_*) or an
instance role, as obstore reads them: exporting them is all a user does. Local emulators are
reached the same way (tested against fake-gcs-server and Azurite): GOOGLE_SERVICE_ACCOUNT_KEY
holding `{"gcs_base_url": URL, "disable_oauth": true, ...}` (or GOOGLE_BASE_URL), and
AZURE_STORAGE_USE_EMULATOR=true with AZURITE_BLOB_STORAGE_URL.

Latency, not bandwidth, is what an object store costs a sample loader: 10-50 ms a request
against ~2 ms of decode. So `read_many` keeps up to `concurrency` GETs in flight (async
requests on a private event-loop thread, one semaphore per store, shared by every caller),
and `read_ranges` asks for all ranges of one object in one call: neighbours whose gap costs
less to read than a request are one GET (`coalesce.plan_requests`, the measured cost model;
obstore's own 1 MiB rule is off), the GETs of one object run in parallel, and each range is
cut back out of its GET's bytes. A single `read` is a plain blocking GET (the GIL released
while it waits). Objects read at offsets indexed at open (tar shards, Parquet files) are pinned
to the version seen then (`pin_versions`): their GETs are made one by one, so that each
answer's ETag can be checked (about 0.14 ms more client CPU a GET, measured on SeaweedFS).

Errors leave here as the `OSError`s the sample loader already handles (`errors.to_os_error`):
transient after obstore's own retries (`StoreOptions`), or the object's (missing, forbidden).

Writes (`pipeline-prepare --shards` to `s3://...`, checksum manifests): `put` is one PUT;
`open_writer` streams an object of any size as a multipart upload (obstore's `put` fed from a
bounded queue on an upload thread: parts go up while the next ones are written, memory stays at
a few parts). Either way S3 makes the object visible only when the upload completes: a writer
aborted, or a process killed mid-shard, leaves nothing under the key (an abandoned multipart
upload's parts are the store's to expire: a bucket lifecycle rule).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from batchwire.pipeline.storage.base import ObjectInfo
from batchwire.pipeline.storage.coalesce import Request, plan_requests, slice_members
from batchwire.pipeline.storage.errors import ObjectChanged, describe, to_os_error
from batchwire.pipeline.storage.local import AbortOnExit
from batchwire.pipeline.storage.options import StoreOptions
from batchwire.pipeline.storage.urls import StoreURL, parse_url, redact_url

log = logging.getLogger("batchwire.pipeline")

T = TypeVar("T")
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_AZURE_ENDPOINT_ENV = ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")
_AZURITE_DEFAULT = ("http://127.0.0.1:10000", "devstoreaccount1")  # object_store's defaults


# Client settings obstore reads from the environment only when it is given no client options
# at all: passing our timeouts would drop them, so they are carried over (AWS_ALLOW_HTTP=true
# for an S3-compatible store over plain http above all).
_ENV_CLIENT_KEYS = ("allow_http", "allow_invalid_certificates", "proxy_url", "proxy_excludes")
_ENV_PREFIX = {"s3": "AWS", "s3a": "AWS", "gs": "GOOGLE"}
_TRUE = ("1", "true", "yes", "on")


def _client_options(options: StoreOptions, scheme: str = "s3") -> dict[str, Any]:
    out: dict[str, Any] = {
        "timeout": timedelta(seconds=options.timeout_s),
        "connect_timeout": timedelta(seconds=options.connect_timeout_s),
    }
    prefix = _ENV_PREFIX.get(scheme, "AZURE")
    for key in _ENV_CLIENT_KEYS:
        value = os.environ.get(f"{prefix}_{key.upper()}")
        if value is None:
            continue
        out[key] = value.strip().lower() in _TRUE if key.startswith("allow_") else value
    return out


def _endpoint(scheme: str) -> str:
    """The service a bucket URL of `scheme` reaches, as the environment sets it (no credential):
    two buckets of the same name on two services (a local emulator and the cloud, two Azure
    accounts) must not share a cached listing or object. Read the way obstore reads it."""
    env = os.environ
    if scheme in ("s3", "s3a"):
        return next((env[n] for n in _ENDPOINT_ENV if env.get(n)), "")
    if scheme == "gs":
        return env.get("GOOGLE_BASE_URL") or _service_account_base_url()
    account = env.get("AZURE_STORAGE_ACCOUNT_NAME", "")
    if env.get("AZURE_STORAGE_USE_EMULATOR", "").strip().lower() in _TRUE:
        url = env.get("AZURITE_BLOB_STORAGE_URL") or _AZURITE_DEFAULT[0]
        return f"{url.rstrip('/')}/{account or _AZURITE_DEFAULT[1]}"
    explicit = next((env[n] for n in _AZURE_ENDPOINT_ENV if env.get(n)), "")
    return explicit or (f"https://{account}.blob.core.windows.net" if account else "")


def _service_account_base_url() -> str:
    """`gcs_base_url` of the GOOGLE_SERVICE_ACCOUNT_KEY JSON (how an emulator is named); only
    that field is kept, never the key."""
    try:
        value = json.loads(os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY") or "{}")
    except ValueError:
        return ""
    url = value.get("gcs_base_url") if isinstance(value, dict) else None
    return url if isinstance(url, str) else ""


def _retry_config(options: StoreOptions) -> dict[str, Any]:
    return {
        "max_retries": int(options.max_retries),
        "retry_timeout": timedelta(seconds=options.retry_timeout_s),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=options.backoff_max_s),
            "base": 2,
        },
    }


def _planned(ranges: Sequence[tuple[int, int]]) -> tuple[list[Request], list[int], list[int]]:
    """The GETs that read `ranges` (`coalesce.plan_requests`: neighbours merged where the gap
    costs less than a request), with their starts and ends. An empty range (a 0-byte tar
    member) is in none: obstore refuses one ("Invalid range requested"), which would fail the
    whole object's read, and `b""` needs no request."""
    plan = plan_requests(ranges)
    return plan, [r.start for r in plan], [r.end for r in plan]


def _version(meta: Any) -> str:
    """An object's version as `list` and `head` report it and a GET's answer carries: its
    ETag, else its size and modification time."""
    return str(meta.get("e_tag") or f"{meta['size']}-{meta['last_modified']}")


class _LoopThread:
    """A private asyncio loop on a daemon thread: `run(coro)` from any thread, blocking.

    obstore's async calls need a running loop; keeping one per store (rather than
    `asyncio.run` per call) costs nothing per call and lets one semaphore bound every
    caller's requests together."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


class ObjectStore:
    """Objects under `scheme://bucket/prefix`; keys are relative to the prefix.

    Counters (`counters()`): `requests` (GETs made: a `read_ranges` makes one per planned
    request, as the store counts them), `objects`
    (whole objects and range sets returned), `bytes`, `errors` (reads that failed after
    retries). They tell a cache's effect from the outside (a second epoch served from a
    `CachedStore` adds none)."""

    def __init__(self, url: str, options: StoreOptions | None = None) -> None:
        from obstore.store import from_url

        self.url: StoreURL = parse_url(url)
        self.options = options or StoreOptions()
        try:
            self._store = from_url(
                self.url.root,
                client_options=_client_options(self.options, self.url.scheme),
                retry_config=_retry_config(self.options),
            )
        except Exception as exc:  # obstore's configuration errors: bad env values, bad URL
            raise ValueError(
                f"{self.display}: cannot configure the store: {describe(exc)}"
            ) from None
        self._loop: _LoopThread | None = None
        self._loop_lock = threading.Lock()
        self._sem: asyncio.Semaphore | None = None
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "objects": 0, "bytes": 0, "errors": 0}
        self._pinned: dict[str, str] = {}  # key -> the version its ranged reads must find

    # -- identity ---------------------------------------------------------------------------

    @property
    def display(self) -> str:
        return self.url.root

    @property
    def namespace(self) -> str:
        """What tells this store's objects apart from another's with the same keys: the URL
        and the endpoint (no credentials), for caches keyed by object."""
        return f"{self.display}|{redact_url(_endpoint(self.url.scheme))}"

    def where(self, key: str) -> str:
        """The URL of `key`, for messages."""
        return self.url.child(key)

    def __repr__(self) -> str:
        return f"ObjectStore({self.display!r})"

    def pin_versions(self, versions: dict[str, str]) -> None:
        """Ranged reads of these objects must find the versions given (what `head` said when
        a tar shard or Parquet file was indexed): a sample is read at an offset taken from
        that version, and an object rewritten since holds other bytes there (another photo,
        served under the old sample's label). Every answer carries the object's version (its
        ETag), so checking costs no request; a changed object is `ObjectChanged`."""
        with self._lock:
            self._pinned.update(versions)

    def _check_version(self, key: str, meta: Any) -> None:
        with self._lock:
            pinned = self._pinned.get(key)
        now = _version(meta)
        if pinned is not None and now != pinned:
            self._count(0, 0, 0, 1)
            raise ObjectChanged(
                f"{self.where(key)}: changed since it was opened (version {pinned}, now {now}): "
                "its samples are not read at the old offsets; restart to serve the new object"
            )

    # -- counters ---------------------------------------------------------------------------

    def _count(self, requests: int, objects: int, nbytes: int, errors: int) -> None:
        with self._lock:
            c = self._counts
            c["requests"] += requests
            c["objects"] += objects
            c["bytes"] += nbytes
            c["errors"] += errors

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # -- blocking calls ---------------------------------------------------------------------

    def _fail(self, exc: BaseException, key: str) -> OSError:
        self._count(0, 0, 0, 1)
        return to_os_error(exc, self.where(key))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        import obstore

        out: list[ObjectInfo] = []
        # obstore lists whole path segments ("a/b" lists "a/b/..."): list the folder the
        # prefix ends in, keep the keys that start with it (the contract: a string prefix).
        folder = prefix if prefix.endswith("/") else prefix.rpartition("/")[0]
        try:
            for chunk in obstore.list(self._store, prefix=folder or None, chunk_size=1000):
                for meta in chunk:
                    if not meta["path"].startswith(prefix):
                        continue
                    out.append(ObjectInfo(meta["path"], int(meta["size"]), _version(meta)))
        except Exception as exc:
            raise self._fail(exc, prefix) from None
        out.sort(key=lambda o: o.key)
        return out

    def list_top(self, prefix: str = "") -> tuple[list[str], list[ObjectInfo]]:
        """One level under `prefix` (a folder listing: '/' as the delimiter): the
        sub-prefixes (without their trailing '/') and the objects there, in one request per
        1,000 entries; what tells an ImageFolder (class prefixes) from a prefix of shards."""
        import obstore

        try:
            got = obstore.list_with_delimiter(self._store, prefix=prefix or None)
        except Exception as exc:
            raise self._fail(exc, prefix) from None
        prefixes = sorted(p.rstrip("/") for p in got["common_prefixes"])
        objects = [
            ObjectInfo(m["path"], int(m["size"]), str(m.get("e_tag") or m["size"]))
            for m in got["objects"]
        ]
        return prefixes, sorted(objects, key=lambda o: o.key)

    def head(self, key: str) -> ObjectInfo:
        import obstore

        try:
            meta = obstore.head(self._store, key)
        except Exception as exc:
            raise self._fail(exc, key) from None
        return ObjectInfo(key, int(meta["size"]), _version(meta))

    def read(self, key: str) -> bytes:
        import obstore

        try:
            data = bytes(obstore.get(self._store, key).bytes())
        except Exception as exc:
            raise self._fail(exc, key) from None
        self._count(1, 1, len(data), 0)
        return data

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        import obstore

        plan, starts, ends = _planned(ranges)
        if not plan:
            return [b""] * len(ranges)
        try:
            if self._is_pinned(key):
                parts = [self._get_range(key, r) for r in plan]
            else:
                parts = obstore.get_ranges(self._store, key, starts=starts, ends=ends, coalesce=0)
        except ObjectChanged:
            raise
        except Exception as exc:
            raise self._fail(exc, key) from None
        out = slice_members(ranges, plan, parts)
        self._count(len(plan), 1, sum(len(p) for p in out), 0)
        return out

    def _is_pinned(self, key: str) -> bool:
        with self._lock:
            return key in self._pinned

    def _get_range(self, key: str, request: Request) -> Any:
        """One planned GET of a pinned object, its answer's version checked."""
        import obstore

        result = obstore.get(self._store, key, options={"range": (request.start, request.end)})
        self._check_version(key, result.meta)
        return result.bytes()  # a buffer: `slice_members` cuts its members out, one copy each

    async def _get_range_async(self, key: str, request: Request) -> Any:
        import obstore

        options = {"range": (request.start, request.end)}
        result = await obstore.get_async(self._store, key, options=options)
        self._check_version(key, result.meta)
        return await result.bytes_async()

    # -- concurrent calls -------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._loop_lock:
            if self._loop is None:
                self._loop = _LoopThread(f"store-{self.url.bucket}")
        return self._loop.run(coro)

    async def _bounded(self, make: Awaitable[T]) -> T:
        if self._sem is None:  # created on the loop's thread, once
            self._sem = asyncio.Semaphore(int(self.options.concurrency))
        async with self._sem:
            return await make

    async def _get_one(self, key: str) -> bytes | OSError:
        import obstore

        async def fetch() -> bytes:
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async())

        try:
            data = await self._bounded(fetch())
        except Exception as exc:
            return self._fail(exc, key)
        self._count(1, 1, len(data), 0)
        return data

    async def _ranges_one(
        self, key: str, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | OSError:
        import obstore

        plan, starts, ends = _planned(ranges)
        if not plan:
            return [b""] * len(ranges)
        try:
            if self._is_pinned(key):
                parts = list(
                    await asyncio.gather(
                        *(self._bounded(self._get_range_async(key, r)) for r in plan)
                    )
                )
            else:
                parts = await self._bounded(
                    obstore.get_ranges_async(self._store, key, starts=starts, ends=ends, coalesce=0)
                )
        except ObjectChanged as exc:
            return exc
        except Exception as exc:
            return self._fail(exc, key)
        out = slice_members(ranges, plan, parts)
        self._count(len(plan), 1, sum(len(p) for p in out), 0)
        return out

    def read_many(self, keys: Sequence[str]) -> list[bytes | OSError]:
        if not keys:
            return []
        if len(keys) == 1:
            try:
                return [self.read(keys[0])]
            except OSError as exc:
                return [exc]

        async def gather() -> list[bytes | OSError]:
            return list(await asyncio.gather(*(self._get_one(k) for k in keys)))

        return self._run(gather())

    def read_ranges_many(
        self, requests: Sequence[tuple[str, Sequence[tuple[int, int]]]]
    ) -> list[list[bytes] | OSError]:
        if not requests:
            return []

        async def gather() -> list[list[bytes] | OSError]:
            return list(await asyncio.gather(*(self._ranges_one(k, r) for k, r in requests)))

        return self._run(gather())

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._store, key, data, use_multipart=False)
        except Exception as exc:
            raise self._fail(exc, key) from None

    def open_writer(self, key: str) -> UploadWriter:
        return UploadWriter(self, key)

    def close(self) -> None:
        """Stop the event-loop thread (a later concurrent read starts another)."""
        with self._loop_lock:
            if self._loop is not None:
                self._loop.close()
                self._loop = None
                self._sem = None


#: Bytes per part of a streamed upload (S3 needs >= 5 MiB but for the last part), parts queued
#: ahead of the upload and uploaded at once: memory of one writer <= about 7 parts (56 MiB).
PART_BYTES = 8 << 20
_QUEUED_PARTS = 2
_PARTS_IN_FLIGHT = 4
_END = object()


class _Aborted(Exception):
    """Raised into obstore's upload by the part iterator: the upload fails, nothing visible."""


class UploadWriter(AbortOnExit):
    """`ObjectStore.open_writer`: bytes gathered into parts; the first full part starts
    `obstore.put` on an upload thread, fed by a bounded queue (a slow store slows `write`
    rather than filling memory). `commit` ends the stream and waits for the upload to
    complete: only then is the object visible. An object smaller than one part is one plain
    PUT at `commit`. `abort` makes the part iterator raise, so obstore fails (and aborts) the
    multipart upload. Errors are the store's `OSError`s (`errors.to_os_error`): the object's
    URL and the store's answer, never a credential."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key
        self._buf = bytearray()
        self._size = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=_QUEUED_PARTS)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = False

    # -- the upload thread ----------------------------------------------------------------------

    def _parts(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if not isinstance(item, bytes):
                raise _Aborted()
            yield item

    def _upload(self) -> None:
        import obstore

        try:
            obstore.put(
                self.store._store,
                self.key,
                self._parts(),
                use_multipart=True,
                chunk_size=PART_BYTES,
                max_concurrency=_PARTS_IN_FLIGHT,
            )
        except BaseException as exc:  # reported by the writing thread
            self._error = exc

    def _send(self, item: object) -> None:
        """Queue a part (or the end), raising the upload's error once it has failed."""
        assert self._thread is not None
        while True:
            if self._error is not None or not self._thread.is_alive():
                self._raise_failure()
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _raise_failure(self) -> None:
        self._done = True
        exc = self._error or OSError("the upload ended early")
        raise self.store._fail(exc, self.key) from None

    # -- the writer -----------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> int:
        if self._done:
            raise ValueError(f"{self.store.where(self.key)}: writer already committed or aborted")
        n = len(data)
        self._buf += data
        self._size += n
        while len(self._buf) >= PART_BYTES:
            part = bytes(self._buf[:PART_BYTES])
            del self._buf[:PART_BYTES]
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._upload, name=f"upload-{self.store.url.bucket}", daemon=True
                )
                self._thread.start()
            self._send(part)
        return n

    def tell(self) -> int:
        return self._size

    def commit(self) -> int:
        if self._done:
            raise ValueError(f"{self.store.where(self.key)}: writer already committed or aborted")
        if self._thread is None:  # smaller than a part: one PUT
            self._done = True
            self.store.put(self.key, bytes(self._buf))
            self._buf = bytearray()
            return self._size
        if self._buf:
            self._send(bytes(self._buf))
            self._buf = bytearray()
        self._send(_END)
        self._thread.join()
        self._done = True
        if self._error is not None:
            self._raise_failure()
        return self._size

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        if self._thread is None:
            return
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=0.2)  # not bytes: the iterator raises
                break
            except queue.Full:
                continue
        self._thread.join(60)
