"""`pipeline-server` as a real process over real sockets, spoken to by raw zmq DEALERs.

One server (module fixture) serves the protocol tests; shutdown tests start their own.
Small batches of 32 px images from the embedded dataset keep the whole file fast.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from batchwire import wire as p
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.raw_client import RawClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serverproc import running_server

BATCH, SIZE, SEED, DEPTH = 4, 32, 11, 3
ARGS = (
    "--batch-size",
    BATCH,
    "--image-size",
    SIZE,
    "--seed",
    SEED,
    "--output-dtype",
    "uint8",
    "--prefetch-depth",
    DEPTH,
    "--workers",
    1,
    "--log-level",
    "WARNING",
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Settings from a TOML file, some overridden on the command line (which wins)."""
    cfg = tmp_path_factory.mktemp("cfg") / "server.toml"
    cfg.write_text(
        f"batch-size = {BATCH}\nimage_size = {SIZE}\nseed = 999\n"
        f'output-dtype = "uint8"\nprefetch-depth = {DEPTH}\n'
    )
    with running_server("--config", str(cfg), "--seed", str(SEED), "--workers", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def train_set():
    return open_dataset(default_dataset().train_root)


def raw_client(srv, endpoint=None, sock=None, **hello) -> RawClient:
    """A raw DEALER speaking the protocol by hand (``hello``: fields of its Hello)."""
    return RawClient(sock if sock is not None else srv.dealer(endpoint), **hello)


def _client_rows(srv, split, rank, epoch, world_size=None):
    return [
        c
        for c in srv.stats()["clients"]
        if c["split"] == split
        and c["rank"] == rank
        and c["epoch"] == epoch
        and (world_size is None or c["world_size"] == world_size)
    ]


def _client_row(srv, split, rank, epoch, world_size=None):
    rows = _client_rows(srv, split, rank, epoch, world_size)
    assert len(rows) == 1, rows
    return rows[0]


def _expected(dataset, plan, dtype: str, layout: str, train: bool = True) -> bytes:
    """The batch's bytes as the in-process producer makes them (what the wire must carry)."""
    aug = AugmentConfig(image_size=(SIZE, SIZE), train=train, output_dtype=dtype, layout=layout)
    out = torch.empty(BATCH, 3, SIZE, SIZE, dtype=p.torch_dtype(dtype)).contiguous(
        memory_format=aug.memory_format
    )
    BatchProducer(dataset, aug, SEED, CpuBatchDecoder(1)).produce(plan, out)
    memory = out.permute(0, 2, 3, 1) if layout == "nhwc" else out
    return memory.contiguous().view(torch.uint8).numpy().tobytes()


def test_help_documents_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "batchwire.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for opt in (
        "--train",
        "--val",
        "--bind",
        "--batch-size",
        "--image-size",
        "--seed",
        "--workers",
        "--output-dtype",
        "--layout",
        "--scale",
        "--ratio",
        "--flip-prob",
        "--brightness",
        "--contrast",
        "--saturation",
        "--hue",
        "--mean",
        "--std",
        "--val-crop-fraction",
        "--decoder",
        "--device",
        "--max-pixels",
        "--prefetch-depth",
        "--metrics-port",
        "--max-buffers",
        "--max-clients",
        "--handshake-timeout",
        "--stall-timeout",
        "--config",
        "--log-level",
    ):
        assert opt in out, opt


def test_decode_threads_default_to_none_beyond_the_producers_when_they_fill_the_cores(
    monkeypatch,
):
    """CPU decoding with at least as many producers as cores: each producer decodes its own
    batch (no pool); fewer producers, another decoder or an explicit --workers: as asked."""
    from batchwire.server import config as server_config
    from batchwire.server.config import ServerConfig

    monkeypatch.setattr(server_config, "available_cores", lambda: 2)
    assert ServerConfig(producers=3).decode_threads() == 1
    assert ServerConfig(producers=2, decoder="cpu").decode_threads() == 1
    assert ServerConfig(producers=1).decode_threads() == 2
    assert ServerConfig(producers=3, decoder="dali").decode_threads() == 2
    assert ServerConfig(producers=3, device="cuda").decode_threads() == 2
    assert ServerConfig(producers=3, workers=2).decode_threads() == 2
    monkeypatch.setattr(server_config, "available_cores", lambda: 16)
    assert ServerConfig(producers=3).decode_threads() == 16


def test_bad_option_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "batchwire.server", "--batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--batch-size must be >= 1" in r.stderr
    cfg = tmp_path / "server.toml"
    cfg.write_text("batch-size = 8\nbogus = 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "batchwire.server", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown setting 'bogus'" in r.stderr


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        pytest.param(
            ["--device", "cuda"],
            ["--device cuda", "CUDA"],
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="checks the error on a machine without CUDA"
            ),
        ),
        (["--train", "/nonexistent/train"], ["--train /nonexistent/train", "does not exist"]),
        (["--seed", "-1"], ["--seed must be >= 0"]),
        (["--metrics-port", "BUSY"], ["cannot serve metrics on --metrics-port"]),
    ],
)
def test_startup_errors_are_clear(args, needles):
    with socket.socket() as busy:  # a port something else already listens on
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        args = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
        r = subprocess.run(
            [sys.executable, "-m", "batchwire.server", "--bind", "tcp://127.0.0.1:0", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def test_hello_welcome_batches_match_the_files(server, train_set):
    c = raw_client(server, epoch=2, batches=(0, 1), session=77)
    try:
        w = c.start()
        sampler = ShardSampler(len(train_set), BATCH, seed=SEED, shuffle=True, drop_last=True)
        assert (w.session, w.num_batches, w.num_samples, w.batch_size) == (
            77,
            sampler.num_batches,
            len(train_set),
            BATCH,
        )
        assert w.shape == [BATCH, 3, SIZE, SIZE] and w.dtype == "uint8" and w.layout == "nchw"
        assert w.num_classes == train_set.num_classes
        got = [c.batch() for _ in range(2)]  # the two batches the hello asked for
        for k, (head, images, labels) in enumerate(got):
            assert (head.session, head.split, head.epoch, head.batch_index) == (77, "train", 2, k)
            plan = sampler.plan(2, k)
            assert head.indices == plan.indices.tolist()
            assert head.replaced == 0
            for i, label in zip(head.indices, labels, strict=True):
                assert Path(train_set.paths[i]).parent.name == train_set.classes[label]
            assert bytes(images) == _expected(train_set, plan, "uint8", "nchw")
        # nothing more asked for: nothing more sent
        row = _client_row(server, "train", 0, 2)
        assert row["sent"] == 2 and row["credits"] == 0
        c.credit([2], stats={"prefetch_depth": 2, "data_wait_fraction": 0.25})
        head, _, _ = c.batch()
        assert head.batch_index == 2
        row = _client_row(server, "train", 0, 2)
        assert row["loader"]["data_wait_fraction"] == 0.25
        assert row["ready"] <= DEPTH
        c.send(p.Bye())
    finally:
        c.close()


def test_any_batches_in_the_order_asked_and_a_replaced_hello(server):
    """Any server produces any batch: a client asks for batches by index, in any order, and
    the server sends exactly those, in that order; a new hello replaces the stream."""
    c = raw_client(server, batches=(7, 3), epoch=5, session=1)
    try:
        c.start()
        c.credit([5])
        assert [c.batch()[0].batch_index for _ in range(3)] == [7, 3, 5]
        # a new hello replaces the stream: new session, new batches, nothing stale arrives
        c.hello = dataclasses.replace(c.hello, split="val", epoch=0, batches=(1, 2), session=2)
        c.start()
        heads = [c.batch()[0] for _ in range(2)]
        assert [(h.session, h.split, h.batch_index) for h in heads] == [
            (2, "val", 1),
            (2, "val", 2),
        ]
        c.credit([10_000])  # beyond the epoch: refused, nothing sent
        msg, _ = c.recv()
        assert isinstance(msg, p.ErrorReply) and "out of range" in msg.message
        c.send(p.Bye())
    finally:
        c.close()


def test_world_size_mismatch_is_an_error_not_a_crash(server):
    a = raw_client(server, world_size=2, rank=0, epoch=7, session=1)
    b = raw_client(server, world_size=4, rank=1, epoch=7, session=2)
    try:
        a.start()
        errors_before = server.stats()["counters"]["errors_total"]
        b.send(b.hello)
        msg, _ = b.recv()
        assert isinstance(msg, p.ErrorReply)
        assert "world_size" in msg.message and "4" in msg.message and "2" in msg.message
        assert server.stats()["counters"]["errors_total"] == errors_before + 1
        assert [a.batch()[0].batch_index for _ in range(2)] == [0, 1]
        a.send(p.Bye())
    finally:
        a.close()
        b.close()


def test_jobs_agree_on_world_size_each_on_its_own(server):
    """Two jobs sharing a server (a notebook beside a torchrun job): world sizes must agree
    within a job only, so neither blocks the other; within one job a mismatch is refused."""
    a = raw_client(server, world_size=2, rank=0, epoch=21, session=1, job="run-a")
    b = raw_client(server, world_size=4, rank=3, epoch=21, session=2, job="run-b")
    c = raw_client(server, world_size=3, rank=0, epoch=21, session=3, job="run-a")
    try:
        a.start()
        b.start()  # another job, another world size: served
        assert [a.batch()[0].batch_index, b.batch()[0].batch_index] == [0, 0]
        c.send(c.hello)
        msg, _ = c.recv()
        assert isinstance(msg, p.ErrorReply) and "of job 'run-a'" in msg.message, msg
    finally:
        for x in (a, b, c):
            x.send(p.Bye())
            x.close()


def test_unservable_hello_is_an_error_for_that_client_only(server):
    """More ranks x batch than the split has samples leaves no batch to serve: that client
    gets an error naming the cause, and the server serves the next client as usual."""
    greedy = raw_client(server, world_size=10_000, rank=0, epoch=13, session=4)
    good = raw_client(server, epoch=13, session=3)
    try:
        greedy.send(greedy.hello)
        msg, _ = greedy.recv()
        assert isinstance(msg, p.ErrorReply) and "cannot serve this hello" in msg.message, msg
        assert "no batch" in msg.message, msg
        good.start()
        assert [good.batch()[0].batch_index for _ in range(2)] == [0, 1]
    finally:
        for c in (greedy, good):
            c.send(p.Bye())
            c.close()


def test_asking_for_everything_without_reading_pins_no_more_than_the_servers_depth():
    """A peer that asks for a whole epoch but never reads holds at most --prefetch-depth
    batches in flight (each pins a buffer until ZeroMQ is done with it) and as many produced:
    what it asks for does not decide the server's memory, the server's setting does. Batches
    of 768 KiB overflow the socket buffers, so unread batches really stay with the server."""
    root = str(default_dataset().val_root)
    args = ("--train", root, "--batch-size", "4", "--image-size", "256", "--workers", "1")
    with running_server(*args, "--output-dtype", "uint8", "--prefetch-depth", "4") as srv:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvhwm = 1
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(srv.endpoint)
        flood = raw_client(srv, sock=sock, batches=range(64))
        try:
            flood.send(flood.hello)
            # A peer whose socket is full answers no heartbeat either: after a few seconds the
            # server may drop it (freeing everything). Until then its row shows the bounds.
            deadline, full, dropped = time.monotonic() + 20, None, False
            while time.monotonic() < deadline and full is None:
                rows = _client_rows(srv, "train", 0, 0)
                if not rows:
                    dropped = True
                    break
                row = rows[0]
                assert row["ready"] <= 4 and row["in_flight"] <= 4, row  # asked for far more
                assert row["credits"] == 64 - row["sent"], row
                if row["ready"] == 4:
                    full = row
                time.sleep(0.05)
            assert full is not None or dropped
        finally:
            sock.close(0)


def test_malformed_frames_are_counted_and_the_server_keeps_serving(server):
    raw = server.dealer()
    good = raw_client(server, epoch=9, session=5)
    try:
        before = server.stats()["counters"]["malformed_total"]
        bad_frames = [
            [b"\x00garbage\xff"],
            [msgpack.packb([1, 2, 3])],
            [msgpack.packb({"v": 1, "type": "hello"})],
            [msgpack.packb({"v": 2, "type": "launch_missiles"})],
            [msgpack.packb({"v": 2, "type": "hello", "rank": "zero"})],
            [p.Bye().pack(), b"extra frame"],
            [os.urandom(10 * 1024 * 1024)],
        ]
        for frames in bad_frames:
            raw.send_multipart(frames)
        replies = []
        for _ in bad_frames:
            assert raw.poll(20000), "no error reply"
            replies.append(p.decode_server_message(raw.recv_multipart()[0]))
        assert all(isinstance(r, p.ErrorReply) for r in replies), replies
        assert "client speaks v1, server speaks v2" in replies[2].message
        assert "exceeds the limit" in replies[6].message
        # a healthy client is served as usual
        good.start()
        assert [good.batch()[0].batch_index for _ in range(2)] == [0, 1]
        assert server.stats()["counters"]["malformed_total"] == before + len(bad_frames)
        good.send(p.Bye())
    finally:
        raw.close(0)
        good.close()


def test_error_replies_stay_short_whatever_the_peer_sent(server):
    """A 64 KiB frame quoting a huge value gets a short reply any client can read (the value
    is shown abridged), not one several times the frame."""
    raw = server.dealer()
    huge_version = msgpack.packb({"v": [-32] * 60_000, "type": "stats"})
    huge_split = raw_client(server, sock=raw, split="\x00" * 60_000).hello.pack()
    try:
        for frame in (huge_version, huge_split):
            raw.send(frame)
            assert raw.poll(20000), "no reply"
            reply = raw.recv_multipart()[0]
            assert len(reply) <= 1100, len(reply)
            msg = p.decode_server_message(reply)
            assert isinstance(msg, p.ErrorReply) and "..." in msg.message, msg
    finally:
        raw.close(0)


def test_stopped_client_holds_bounded_memory_while_another_is_served(server):
    """A client that asked for many batches and stopped reading (its socket full: it takes
    nothing more) pins at most --prefetch-depth buffers produced and as many in flight, and
    the other client is served as usual."""
    sock = server.dealer()
    sock.rcvhwm = 1
    sock.setsockopt(zmq.RCVBUF, 4096)
    stalled = raw_client(
        server, sock=sock, rank=0, world_size=2, epoch=11, batches=range(20), session=1
    )
    healthy = raw_client(server, rank=1, world_size=2, epoch=11, session=2)
    try:
        stalled.start()
        total = healthy.start().num_batches
        for _ in range(2):
            stalled.batch()  # then it reads nothing more
        got = 0
        want = min(20, total)
        deadline = time.monotonic() + 60
        while got < want and time.monotonic() < deadline:
            head, _, _ = healthy.batch()
            assert head.batch_index == got
            got += 1
            if got + 1 < total:
                healthy.credit([got + 1])  # one more, as a training loop would
            for row in _client_rows(server, "train", 0, 11, world_size=2):  # until dropped
                assert row["ready"] <= DEPTH and row["in_flight"] <= DEPTH, row
        assert got == want
        stats = server.stats()
        ready = next(s for s in stats["stages"] if s["name"] == "ready")
        assert ready["depth"] <= ready["capacity"]
        healthy_row = _client_row(server, "train", 1, 11)
        assert got <= healthy_row["sent"] <= got + 2  # plus the ones it asked for ahead
        assert healthy_row["images_per_s"] > 0
    finally:
        for c in (stalled, healthy):
            c.send(p.Bye())
            c.close()


def test_stats_schema(server):
    stats = server.stats()
    assert stats["v"] == 1 and stats["uptime_s"] > 0
    assert [s["name"] for s in stats["stages"]] == ["read", "decode", "augment", "ready"]
    for s in stats["stages"]:
        assert 0 <= s["depth"] <= s["capacity"]
    assert stats["counters"]["batches_total"] > 0
    assert stats["counters"]["bytes_total"] >= stats["counters"]["batches_total"] * BATCH * (
        3 * SIZE * SIZE + 8
    )
    lat = {s["name"]: s["latency_ms"] for s in stats["stages"]}
    assert lat["decode"] > 0 and lat["augment"] > 0


def test_nhwc_float16_over_ipc_and_sigterm_tells_every_client(tmp_path):
    ipc = f"ipc://{tmp_path}/server.sock"
    args = (*map(str, ARGS), "--output-dtype", "float16", "--layout", "nhwc", "--bind", ipc)
    with running_server(*args) as srv:
        clients = [
            raw_client(srv, session=1),
            raw_client(srv, ipc, split="val", session=2),
        ]
        try:
            for c in clients:
                w = c.start()
                assert (w.dtype, w.layout) == ("float16", "nhwc")
                head, images, labels = c.batch()
                assert (head.dtype, head.layout, head.split) == ("float16", "nhwc", c.hello.split)
                train = c.hello.split == "train"
                dataset = open_dataset(getattr(default_dataset(), f"{c.hello.split}_root"))
                sampler = ShardSampler(
                    len(dataset), BATCH, seed=SEED, shuffle=train, drop_last=train
                )
                plan = sampler.plan(0, 0)
                assert bytes(images) == _expected(dataset, plan, "float16", "nhwc", train)
                np.testing.assert_array_equal(labels, dataset.labels[plan.indices])
            t0 = time.monotonic()
            assert srv.stop(timeout=10) == 0
            stopped_in = time.monotonic() - t0
            for c in clients:
                while True:  # a batch may still be on its way; then the shutdown notice
                    msg, _ = c.recv(timeout=5)
                    if not isinstance(msg, p.BatchHeader):
                        break
                assert isinstance(msg, p.Shutdown), msg
            assert stopped_in < 5, stopped_in
        finally:
            for c in clients:
                c.close()


def test_silent_client_is_dropped_and_can_come_back():
    with running_server(*map(str, ARGS), "--client-timeout", "1") as srv:
        c = raw_client(srv, batches=(0,), session=1)
        try:
            c.start()
            c.batch()
            t0 = time.monotonic()
            while srv.stats()["clients"]:  # silent from now on
                assert time.monotonic() - t0 < 10, "silent client never dropped"
                assert not c.sock.poll(100), "no credit was given, yet something arrived"
            assert time.monotonic() - t0 >= 0.9
            c.credit([1])  # unknown now: ignored, the client must say hello again
            assert srv.stats()["clients"] == []
            c.hello = p.Hello(**{**c.hello.__dict__, "batches": (1,), "session": 2})
            c.start()
            head, _, _ = c.batch()
            assert (head.session, head.batch_index) == (2, 1)
        finally:
            c.close()
