"""Object storage: the client libraries, and the server on a bucket against a local folder.

    python -m batchwire.bench.bench_storage [--dir ../shared/imagenet-sample] [--latency-ms 20]
        [--json out.json] [--samples-patch /tmp/storage-samples.patch-applied-copy.py]

A real S3 store on this machine (SeaweedFS, `weed` from the dev extra, started as the tests
start it: tests/objectstore.py) holds the same JPEGs as a local ImageFolder. Rows:

- `client`: GETs/s and client CPU per object for the JPEGs, one at a time and 64 in flight,
  for obstore (what `pipeline.storage.ObjectStore` uses) and fsspec/s3fs (the older
  convention, when installed: `pip install s3fs`), against the same store in the same run;
- `server`: a real `pipeline-server` fed to a RemoteLoader, epoch 1 timed (epoch 0 warms up):
  images/s and CPU ms per image of the server and of the `weed` process, and the store's GETs
  (its own Prometheus counter): local folder, bucket on loopback, bucket behind
  `--latency-ms` (a TCP proxy in this process holding every chunk for half of it each way:
  `tc netem` needs the kernel's sch_netem, absent here), and the bucket with `--cache-dir`
  (epoch 1 must make zero GETs);
- `--formats`: the same JPEGs as WebDataset tar shards (`pipeline-prepare --shards 16MB`,
  written straight to the bucket and to a local folder) and as one Parquet file (row groups of
  100, `datasets`' default for images): local, loopback and behind `--latency-ms` rows, epoch 0
  (cold: every byte fetched) and epoch 1 both timed (`--skip-folder` leaves out the S3
  ImageFolder rows).
- `--shard-rounds N`: only the tar shard rows, local and on S3 over loopback, in N interleaved
  rounds (local, s3, local, s3, ...), then their medians: images/s, server CPU ms per image and
  the store's GETs per batch, with each ratio to the local shards of the same round.
  `--pin-store CPU` runs the store on that core alone and this process, the servers and their
  loader on the others (as a deployment has the store on another machine); `--images N` keeps
  only the first N JPEGs; `--baseline-site DIR` adds a row per round whose server imports
  `batchwire` from DIR (another commit's tree laid out as a package: before against after,
  same run, same store); `--site NAME=DIR` (repeatable) adds a row "s3 shards, NAME" so.
- `--request-costs`: the coalescing rule's constants (`pipeline/storage/coalesce.py`): client
  and store CPU of one `get_ranges` of 8 members of 110 kB 2 MB apart (8 GETs), adjacent (1
  GET) and 1.5 MB apart in one GET: the cost of a GET, and of a MB of gap read in vain.

Every figure is one run on a shared machine: compare rows of the same run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO.parent / "shared" / "imagenet-sample"
BUCKET = "bench"


def _seaweed() -> Any:
    """tests/objectstore.py's SeaweedS3 (the bench runs from a checkout)."""
    sys.path.insert(0, str(REPO / "tests"))
    from objectstore import SeaweedS3

    return SeaweedS3


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float | None:
    """Process `pid`'s peak resident memory so far (VmHWM), MiB; None without /proc."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


# -- latency ----------------------------------------------------------------------------------


class DelayProxy:
    """127.0.0.1:port -> target, every chunk forwarded `delay_s` after it arrived (in order):
    each direction gets that much latency, bandwidth is untouched."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target, self.delay_s = target, delay_s
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((self.loop.time() + self.delay_s, chunk))
        except ConnectionError:
            pass
        queue.put_nowait((0.0, b""))
        await sender

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True
        )


# -- client libraries -------------------------------------------------------------------------


def _time(fn: Callable[[], int]) -> tuple[int, float, float]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0, time.process_time() - cpu0


def client_rows(store: Any, keys: list[str], concurrency: int) -> list[dict[str, Any]]:
    """GETs/s and client CPU ms per object, each library on the same objects."""
    import obstore
    from batchwire.pipeline.storage import StoreOptions
    from batchwire.pipeline.storage.objects import ObjectStore

    rows = []
    ours = ObjectStore(f"s3://{BUCKET}/photos", StoreOptions(concurrency=concurrency))
    raw = ours._store

    def obstore_seq() -> int:
        return sum(len(bytes(obstore.get(raw, k).bytes())) > 0 for k in keys)

    def obstore_conc() -> int:
        return sum(isinstance(b, bytes) for b in ours.read_many(keys))

    cases: list[tuple[str, str, Callable[[], int]]] = [
        ("obstore", "sequential", obstore_seq),
        ("obstore", f"{concurrency} in flight", obstore_conc),
    ]
    try:
        import s3fs
    except ImportError:
        s3fs = None
    if s3fs is not None:
        fs = s3fs.S3FileSystem(
            key=store.env()["AWS_ACCESS_KEY_ID"],
            secret=store.env()["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": store.endpoint, "region_name": "us-east-1"},
            max_concurrency=concurrency,
        )
        paths = [f"{BUCKET}/photos/{k}" for k in keys]

        def s3fs_seq() -> int:
            return sum(len(fs.cat_file(p)) > 0 for p in paths)

        def s3fs_conc() -> int:
            got = fs.cat(paths, batch_size=concurrency, on_error="return")
            return sum(isinstance(v, bytes) for v in got.values())

        cases += [("s3fs", "sequential", s3fs_seq), ("s3fs", f"{concurrency} in flight", s3fs_conc)]
    for lib, mode, fn in cases:
        fn()  # warm: connections, credentials
        weed0 = proc_cpu_s(store.proc.pid)
        n, wall, cpu = _time(fn)
        weed = proc_cpu_s(store.proc.pid) - weed0
        row = {
            "row": "client",
            "library": lib,
            "mode": mode,
            "objects": n,
            "gets_per_s": round(n / wall, 1),
            "client_cpu_ms_per_object": round(1e3 * cpu / n, 3),
            "store_cpu_ms_per_object": round(1e3 * weed / n, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    ours.close()
    return rows


# -- the server --------------------------------------------------------------------------------


@contextmanager
def server(train: str, env: dict[str, str], extra: list[str], patched: str | None) -> Iterator[Any]:
    """A `pipeline-server` (optionally with a patched pipeline/samples.py loaded first)."""
    from batchwire.common.launcher import PipelineServer

    class Server(PipelineServer):
        @property
        def command(self) -> list[str]:  # type: ignore[override]
            base = super().command
            if patched is None:
                return base
            shim = (
                "import importlib.util as u, sys; "
                f"s = u.spec_from_file_location('batchwire.pipeline.samples', {patched!r}); "
                "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); "
                "from batchwire.server.cli import main; sys.argv[0] = 'pipeline-server'; "
                "sys.exit(main())"
            )
            return [sys.executable, "-c", shim, *base[base.index("--bind") :]]

    args = [
        *("--train", train, "--batch-size", "50", "--image-size", "224"),
        *("--output-dtype", "uint8", "--log-level", "WARNING", "--listing-ttl", "0", *extra),
    ]
    with tempfile.TemporaryDirectory(prefix="bw-bench-") as tmp:
        srv = Server(args, f"ipc://{tmp}/s.sock", env=env, log_path=Path(tmp) / "server.log")
        srv.start(180)
        try:
            yield srv
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{srv.log(tail_chars=3000)}") from exc
        finally:
            srv.stop(grace=15.0)


def epoch_images(endpoint: str, epoch: int) -> int:
    from batchwire.client import RemoteLoader

    with RemoteLoader(
        endpoint, "train", rank=0, world_size=1, device="cpu", timeout=300,
        prefetch_next_epoch=False, normalize_on_device=False,
    ) as loader:  # fmt: skip
        loader.set_epoch(epoch)
        return sum(int(images.shape[0]) for images, _ in loader)


def server_row(
    name: str,
    train: str,
    store: Any,
    env: dict[str, str],
    extra: list[str],
    patched: str | None,
    batch: int = 50,
) -> dict[str, Any]:
    with server(train, env, extra, patched) as srv:
        cpu0, t0 = proc_cpu_s(srv.pid), time.perf_counter()
        n0 = epoch_images(srv.endpoint, 0)  # warm-up (and fills a cache)
        wall0, cpu_0 = time.perf_counter() - t0, proc_cpu_s(srv.pid) - cpu0
        gets0, weed0 = store.s3_requests("GET"), proc_cpu_s(store.proc.pid)
        cpu0, t0 = proc_cpu_s(srv.pid), time.perf_counter()
        n = epoch_images(srv.endpoint, 1)
        wall = time.perf_counter() - t0
        cpu = proc_cpu_s(srv.pid) - cpu0
        weed, gets = proc_cpu_s(store.proc.pid) - weed0, store.s3_requests("GET") - gets0
        peak = peak_rss_mib(srv.pid)
    row = {
        "row": "server",
        "source": name,
        "images": n,
        "images_per_s": round(n / wall, 1),
        "server_cpu_ms_per_img": round(1e3 * cpu / n, 2),
        "store_cpu_ms_per_img": round(1e3 * weed / n, 3),
        "store_gets_epoch1": gets,
        "store_gets_per_batch": round(gets * batch / n, 1),
        "epoch0_images_per_s": round(n0 / wall0, 1),
        "epoch0_server_cpu_ms_per_img": round(1e3 * cpu_0 / n0, 2),
        "server_peak_rss_mib": peak,
        "samples_patch": patched is not None,
    }
    print(json.dumps(row), flush=True)
    return row


def image_folder(src: Path, dst: Path, classes: int = 10, limit: int | None = None) -> Path:
    """An ImageFolder of `src`'s JPEGs (symlinks; the first `limit`), `classes` classes
    round-robin."""
    files = sorted(p for p in src.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))[:limit]
    for k, path in enumerate(files):
        cls = dst / f"class{k % classes}"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / path.name).symlink_to(path.resolve())
    return dst


def pin(store: Any, cpu: int) -> None:
    """The store's threads on `cpu` alone, this process (and the servers it starts, which
    inherit it) on the other cores."""
    import subprocess

    subprocess.run(
        ["taskset", "-a", "-pc", str(cpu), str(store.proc.pid)], check=True, capture_output=True
    )
    others = os.sched_getaffinity(0) - {cpu}
    if not others:
        raise SystemExit(f"--pin-store {cpu}: no other core left for the server")
    os.sched_setaffinity(0, others)


def ratios(row: dict[str, Any]) -> dict[str, Any]:
    return {f: row[f] for f in ("vs_local_images_per_s", "vs_local_cpu")}


def shard_rounds(
    folder: Path,
    out: Path,
    store: Any,
    env: dict[str, str],
    rounds: int,
    baseline: Path | None,
    sites: dict[str, Path] | None = None,
) -> list[dict[str, Any]]:
    """Local tar shards against the same shards on S3 (loopback), `rounds` interleaved rounds;
    prints each round's rows and ratios, then the medians."""
    from statistics import median

    from batchwire.prepare.shards import write_shards

    remote = write_shards(str(folder), f"s3://{BUCKET}/shards", 16_000_000, jobs=2)
    write_shards(str(folder), str(out / "shards"), 16_000_000, jobs=2)
    last = len(remote.shards) - 1
    span = f"train-{{000000..{last:06d}}}.tar"
    s3 = f"s3://{BUCKET}/shards/{span}"
    cases = {"local shards": (str(out / "shards" / span), env), "s3 shards": (s3, env)}
    if baseline is not None:
        cases["s3 shards, baseline"] = (s3, {**env, "PYTHONPATH": str(baseline)})
    for name, site in (sites or {}).items():
        cases[f"s3 shards, {name}"] = (s3, {**env, "PYTHONPATH": str(site)})
    rows: list[dict[str, Any]] = []
    for k in range(rounds):
        got = {name: server_row(name, t, store, e, [], None) for name, (t, e) in cases.items()}
        local = got["local shards"]
        for row in got.values():
            row["round"] = k
            if row is not local:
                row["vs_local_images_per_s"] = round(row["images_per_s"] / local["images_per_s"], 3)
                row["vs_local_cpu"] = round(
                    local["server_cpu_ms_per_img"] / row["server_cpu_ms_per_img"], 3
                )
                print(json.dumps({"round": k, "source": row["source"], **ratios(row)}))
        rows += got.values()
    fields = ("images_per_s", "server_cpu_ms_per_img", "store_cpu_ms_per_img")
    fields += ("store_gets_per_batch", "server_peak_rss_mib", "vs_local_images_per_s")
    fields += ("vs_local_cpu",)
    for name in cases:
        mine = [r for r in rows if r["source"] == name]
        summary = {f: median(r[f] for r in mine) for f in fields if f in mine[0]}
        summary = {"row": "median", "source": name, "rounds": rounds, **summary}
        print(json.dumps(summary), flush=True)
        rows.append(summary)
    return rows


def request_costs(store: Any, calls: int = 100) -> dict[str, Any]:
    """Client and store CPU (ms) of one GET and of one MB more in a request (see the doc)."""
    import obstore
    from batchwire.pipeline.storage.objects import ObjectStore

    member, apart, gap = 110_000, 2_000_000, 1_500_000
    store.put(BUCKET, "costs/blob.bin", os.urandom(16_000_000))
    raw = ObjectStore(f"s3://{BUCKET}/costs")._store

    def cpu(starts: list[int], ends: list[int]) -> tuple[float, float]:
        def run() -> None:
            for _ in range(calls):
                obstore.get_ranges(raw, "blob.bin", starts=starts, ends=ends, coalesce=0)

        run()  # warm: connections
        weed0, cpu0 = proc_cpu_s(store.proc.pid), time.process_time()
        run()
        return 1e3 * (time.process_time() - cpu0) / calls, 1e3 * (
            proc_cpu_s(store.proc.pid) - weed0
        ) / calls

    far = cpu([k * apart for k in range(8)], [k * apart + member for k in range(8)])
    near = cpu([0], [8 * member])
    span = cpu([0], [7 * (member + gap) + member])
    mb = 7 * gap / 1e6
    row = {
        "row": "request costs",
        "client_ms_per_get": round((far[0] - near[0]) / 7, 3),
        "store_ms_per_get": round((far[1] - near[1]) / 7, 3),
        "client_ms_per_mb": round((span[0] - near[0]) / mb, 3),
        "store_ms_per_mb": round((span[1] - near[1]) / mb, 3),
    }
    print(json.dumps(row), flush=True)
    return row


def make_formats(folder: Path, out: Path, store: Any) -> dict[str, str]:
    """The ImageFolder as tar shards (written by `pipeline-prepare --shards`' code to the
    bucket and to `out`) and as one Parquet file (uploaded): name -> --train argument."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from batchwire.pipeline.dataset import open_dataset
    from batchwire.prepare.shards import write_shards

    t0 = time.perf_counter()
    remote = write_shards(str(folder), f"s3://{BUCKET}/shards", 16_000_000, jobs=4)
    print(f"{len(remote.shards)} shards to s3 in {time.perf_counter() - t0:.1f} s", flush=True)
    local = write_shards(str(folder), str(out / "shards"), 16_000_000, jobs=4)
    last = len(local.shards) - 1
    ds = open_dataset(folder, verify_checksums="off")
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ds.classes}}
    table = pa.table(
        {
            "image": [{"bytes": ds.read_bytes(i), "path": None} for i in range(len(ds))],
            "label": pa.array(ds.labels.tolist(), pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    (out / "pq").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "pq" / "train.parquet", row_group_size=100)
    store.upload_folder(out / "pq", BUCKET, "pq")
    return {
        "local shards": str(out / "shards" / f"train-{{000000..{last:06d}}}.tar"),
        "s3 shards": f"s3://{BUCKET}/shards/train-{{000000..{last:06d}}}.tar",
        "local parquet": str(out / "pq" / "train.parquet"),
        "s3 parquet": f"s3://{BUCKET}/pq/train.parquet",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchwire.bench.bench_storage")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="a folder of JPEGs")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="round trip added")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--skip-client", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-folder", action="store_true", help="no S3 ImageFolder rows")
    parser.add_argument("--formats", action="store_true", help="tar shard and Parquet rows")
    parser.add_argument(
        "--shard-rounds", type=int, metavar="N", help="only local vs S3 tar shards, N rounds"
    )
    parser.add_argument("--pin-store", type=int, metavar="CPU", help="the store on this core")
    parser.add_argument("--images", type=int, help="only the first N JPEGs of --dir")
    parser.add_argument("--baseline-site", type=Path, help="a baseline tree (--shard-rounds)")
    parser.add_argument(
        "--site",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="one more tree's S3 shards row (--shard-rounds; repeatable)",
    )
    parser.add_argument("--request-costs", action="store_true", help="GET and MB costs only")
    parser.add_argument(
        "--samples-patch",
        metavar="FILE.py",
        help="also run the latency row with this pipeline/samples.py (a patched copy)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bw-bench-storage-"))
    store = _seaweed()(tmp / "weed")
    rows: list[dict[str, Any]] = []
    try:
        store.start()
        if args.pin_store is not None:
            pin(store, args.pin_store)
        folder = image_folder(args.dir, tmp / "photos", limit=args.images)
        count = store.upload_folder(folder, BUCKET, "photos")
        print(f"{count} objects in s3://{BUCKET}/photos ({store.endpoint})", flush=True)
        env = store.env()
        os.environ.update(env)  # this process's own clients
        keys = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink())
        if args.request_costs:
            rows.append(request_costs(store))
            args.skip_client = args.skip_server = True
        if args.shard_rounds:
            sites = {n: Path(d) for n, _, d in (s.partition("=") for s in args.site)}
            rows += shard_rounds(
                folder, tmp / "formats", store, env, args.shard_rounds, args.baseline_site, sites
            )
            args.skip_client = args.skip_server = True
        if not args.skip_client:
            rows += client_rows(store, keys, args.concurrency)
        if not args.skip_server:
            url = f"s3://{BUCKET}/photos"
            rows.append(server_row("local folder", str(folder), store, env, [], None))
            proxy = DelayProxy(("127.0.0.1", store.ports["s3"]), args.latency_ms / 2e3)
            slow = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
            if args.formats:
                made = make_formats(folder, tmp / "formats", store)
                lat = f"+{args.latency_ms:g} ms"
                for name, train, row_env in (
                    ("local shards", made["local shards"], env),
                    ("s3 shards, loopback", made["s3 shards"], env),
                    (f"s3 shards, {lat}", made["s3 shards"], slow),
                    ("local parquet", made["local parquet"], env),
                    ("s3 parquet, loopback", made["s3 parquet"], env),
                    (f"s3 parquet, {lat}", made["s3 parquet"], slow),
                ):
                    rows.append(server_row(name, train, store, row_env, [], None))
        if not args.skip_server and not args.skip_folder:
            rows.append(server_row("s3 folder, loopback", url, store, env, [], None))
            name = f"s3 folder, +{args.latency_ms:g} ms"
            rows.append(server_row(name, url, store, slow, [], None))
            if args.samples_patch:
                rows.append(server_row(name, url, store, slow, [], args.samples_patch))
            cache = ["--cache-dir", str(tmp / "cache"), "--cache-size", "2G"]
            rows.append(server_row(f"{name}, --cache-dir", url, store, slow, cache, None))
    finally:
        store.kill()
        store.remove_sockets()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
