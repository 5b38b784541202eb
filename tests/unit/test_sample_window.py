"""Per-client batch sizes (issue 23) and the sample window that shares samples across them.

The window relies on a sample's bytes not depending on the batch it lands in: checked here
first, on the producer itself (batches of 16 and of 8 cut from one epoch order, and a shuffled
subset), before the window's own behaviour and the core's handling of batch sizes.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from batchwire import wire
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.sample_window import SampleEntry, SampleWindow
from batchwire.pipeline.sampler import BatchPlan, ShardSampler
from batchwire.server.config import ServerConfig
from batchwire.server.core import SendBatch, Submit
from batchwire.server.sharing import sample_window_batches
from batchwire.wire import ErrorReply, Hello, ProtocolError, Welcome
from coresim import Server

SEED = 7


def _loader(**kw) -> LocalLoader:
    return LocalLoader(None, batch_size=4, image_size=24, seed=SEED, output_dtype="uint8", **kw)


def _produce(ll: LocalLoader, plan: BatchPlan, **kw) -> tuple[torch.Tensor, object]:
    out = ll.producer.config.batch_spec(len(plan.indices)).empty()
    meta = ll.producer.produce(plan, out, **kw)
    return out, meta


def _sampler(ll: LocalLoader, batch: int) -> ShardSampler:
    return ShardSampler(len(ll.producer.dataset), batch, seed=SEED, shuffle=True, drop_last=True)


def test_a_samples_bytes_do_not_depend_on_its_batch() -> None:
    with _loader() as ll:
        big = _sampler(ll, 16).plan(1, 3)
        whole, _ = _produce(ll, big)
        halves = [_produce(ll, _sampler(ll, 8).plan(1, k))[0] for k in (6, 7)]
        assert torch.equal(whole, torch.cat(halves))  # batch 3 of 16 = batches 6, 7 of 8
        # Any subset, in any order, any batch size: each sample's bytes are its own.
        pick = np.array([5, 0, 11, 3, 3])
        sub = BatchPlan(1, 0, big.indices[pick], np.ones(len(pick), dtype=bool))
        assert torch.equal(_produce(ll, sub)[0], whole[torch.from_numpy(pick)])


def test_batches_through_the_window_equal_batches_produced_whole() -> None:
    with _loader() as ll:
        window = SampleWindow(1 << 24)
        key = ("train", 24, 24, "uint8", "nchw")
        big = _sampler(ll, 16).plan(0, 0)
        plain, plain_meta = _produce(ll, big)
        first, meta = _produce(ll, big, reuse=(window, key))
        assert torch.equal(first, plain) and np.array_equal(meta.labels, plain_meta.labels)
        assert window.reused_total == 0 and window.produced_total == 16 and len(window) == 16
        for k in (0, 1):  # batches of 8 of the same samples: copied, nothing produced
            small = _sampler(ll, 8).plan(0, k)
            reused, m = _produce(ll, small, reuse=(window, key))
            assert torch.equal(reused, _produce(ll, small)[0])
            assert np.array_equal(m.labels, _produce(ll, small)[1].labels)
            assert np.array_equal(m.indices, small.indices)
        assert window.reused_total == 16 and window.produced_total == 16
        # Half found: the other half decoded as a smaller batch, the whole still exact.
        mixed = BatchPlan(
            0, 9, np.concatenate([big.indices[:4], _sampler(ll, 16).plan(0, 1).indices[:4]]),
            np.ones(8, dtype=bool),
        )  # fmt: skip
        out, _ = _produce(ll, mixed, reuse=(window, key))
        assert torch.equal(out, _produce(ll, mixed)[0])
        assert window.reused_total == 20 and window.produced_total == 20


def test_the_window_is_bounded_in_bytes_and_hands_each_sample_to_one_maker() -> None:
    img = torch.zeros(3, 4, 4, dtype=torch.uint8)  # 48 bytes
    w = SampleWindow(100)
    for i in range(3):
        assert w.take([i], 16) == [i]
        w.publish(i, SampleEntry(img, 0, i, False))
    assert len(w) == 2 and w.bytes == 96 and w.get(0) is None  # the oldest went
    assert list(w.found([2, 5])) == [2]
    assert w.take([2, 5, 6, 7], 2) == [5, 6]  # 2 is there; at most 2 taken
    assert w.take([5, 6, 7], 16) == [7]  # 5 and 6 are being made elsewhere
    (event,) = w.events([5])
    threading.Timer(0.05, lambda: w.abandon([5])).start()  # the other producer failed
    t0 = time.monotonic()
    assert event.wait(5) and time.monotonic() - t0 < 5 and w.get(5) is None
    assert w.take([5], 16) == [5]  # abandoned: anyone may make it now


def test_two_producers_on_overlapping_batches_split_the_work() -> None:
    with _loader() as ll:
        window = SampleWindow(1 << 24)
        key = ("train", 24, 24, "uint8", "nchw")
        big = _sampler(ll, 16).plan(2, 0)
        smalls = [_sampler(ll, 8).plan(2, k) for k in (0, 1)]
        got: dict[str, torch.Tensor] = {}

        def run(name: str, plan: BatchPlan) -> None:
            got[name] = _produce(ll, plan, reuse=(window, key))[0]

        threads = [threading.Thread(target=run, args=("big", big))]
        threads += [threading.Thread(target=run, args=(f"s{k}", p)) for k, p in enumerate(smalls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert torch.equal(got["big"], _produce(ll, big)[0])
        assert torch.equal(torch.cat([got["s0"], got["s1"]]), got["big"])
        assert window.produced_total == 16 and window.reused_total == 16


def test_the_hello_carries_a_batch_size_only_when_asked() -> None:
    plain = Hello("train", 0, 1, 0, (0,), 1)
    assert "batch_size" not in plain.to_map()
    sized = Hello("train", 0, 1, 0, (0,), 1, batch_size=32)
    assert sized.to_map()["batch_size"] == 32
    assert wire.decode_client_message(sized.pack()) == sized
    for bad in (0, -1, True, "32", 1 << 30):
        with pytest.raises(ProtocolError, match="batch_size"):
            Hello.from_map({**plain.to_map(), "batch_size": bad})


def test_max_batch_size_sizes_the_buffers_and_the_sample_window() -> None:
    config = ServerConfig(train="/d", batch_size=32, max_batch_size=128, image_size=16)
    assert config.capacity_spec().shape == [128, 3, 16, 16]
    assert config.batch_spec().shape == [32, 3, 16, 16]
    assert sample_window_batches(config, 64) == 8  # half of the batch window (16)
    assert sample_window_batches(ServerConfig(train="/d"), 64) == 0  # one batch size
    assert (
        sample_window_batches(ServerConfig(train="/d", max_batch_size=99, share_window=0), 64) == 0
    )
    with pytest.raises(ValueError, match="at least --batch-size"):
        ServerConfig(train="/d", batch_size=64, max_batch_size=32)


def test_a_session_of_another_batch_size_gets_its_welcome_batches_and_sample_sharing() -> None:
    s = Server(config={"max_batch_size": 8, "share_window": 8})
    w4 = s.hello(b"a", batches=(0,), session=1)
    assert isinstance(w4, Welcome) and w4.batch_size == 4
    assert s.core.sessions[b"a"].sampler.num_batches == w4.num_batches
    solo = [a for a in s.tick() if isinstance(a, Submit)]
    # Published even alone: a job of another batch size may come a moment later.
    assert len(solo) == 1 and solo[0].order.share_samples
    w8 = s.hello(b"b", batches=(0,), session=2, batch_size=8)
    assert isinstance(w8, Welcome) and w8.batch_size == 8 and w8.shape[0] == 8
    assert w8.num_batches == w4.num_batches // 2
    submits = [a for a in s.tick() if isinstance(a, Submit)]
    # Another batch size: its own production (the key has the size), through the window.
    assert len(submits) == 1 and submits[0].order.spec.batch_size == 8
    s.finish()
    sends = {a.identity: a for a in s.tick() if isinstance(a, SendBatch)}
    assert sends[b"b"].header.shape[0] == 8 and sends[b"b"].header.nbytes == w8.spec.nbytes
    # The server's own batch size asked for is the server's stream: shared with the first.
    s.hello(b"c", batches=(0,), session=3, batch_size=4)
    assert not [a for a in s.tick() if isinstance(a, Submit)]


def test_a_batch_size_beyond_the_bound_is_refused_naming_it() -> None:
    s = Server(config={"max_batch_size": 8})
    err = s.hello(b"a", session=1, batch_size=9)
    assert isinstance(err, ErrorReply) and err.session == 1 and err.reason == "refused"
    assert "batch_size 9 is larger than this server's --max-batch-size 8" in err.message


def test_the_loaders_state_records_its_batch_size() -> None:
    from batchwire.client import RemoteLoader

    loader = RemoteLoader("tcp://127.0.0.1:1", "train", device="cpu", batch_size=32)
    try:
        state = loader.state_dict()
        assert state["batch_size"] == 32
        other = RemoteLoader("tcp://127.0.0.1:1", "train", device="cpu")
        try:
            other.load_state_dict(state)
            assert other.state_dict()["batch_size"] == 32
        finally:
            other.close()
        with pytest.raises(ValueError, match="batch_size"):
            RemoteLoader("tcp://127.0.0.1:1", "train", device="cpu", batch_size=0)
    finally:
        loader.close()


def test_the_monitor_says_how_many_samples_were_reused() -> None:
    from batchwire.monitor.render import render
    from monitorsnaps import SNAP

    counters = dataclasses.replace(
        SNAP.counters,
        batches_produced_total=10,
        samples_produced_total=640,
        samples_reused_total=320,
    )
    text = render(dataclasses.replace(SNAP, counters=counters), 200)
    assert "samples reused 320 of 960" in text


def test_multilabel_rows_through_the_window_equal_plain_production(tmp_path) -> None:
    import json
    import shutil

    from batchwire.pipeline.synthetic import default_dataset

    src = sorted(p for d in sorted(default_dataset().val_root.iterdir()) for p in d.iterdir())
    lines = []
    for k, f in enumerate(src[:12]):
        shutil.copyfile(f, tmp_path / f"img{k}.jpg")
        lines.append(
            json.dumps({"path": f"img{k}.jpg", "label": [k % 4, (k + 1) % 4][: 1 + k % 2]})
        )
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    with LocalLoader(
        str(tmp_path / "m.jsonl"), split="val", batch_size=5, image_size=16, threads=1,
        output_dtype="uint8", verify_checksums="off",
    ) as ll:  # fmt: skip
        window = SampleWindow(1 << 22)
        key = ("val", 16, 16, "uint8", "nchw")
        for k in range(ll.sampler.num_batches):  # the last one padded
            plan = ll.sampler.plan(0, k)
            out = ll.producer.config.batch_spec(5).empty()
            meta = ll.producer.produce(plan, out, reuse=(window, key))
            ref = ll.producer.config.batch_spec(5).empty()
            want = ll.producer.produce(plan, ref)
            assert torch.equal(out, ref) and meta.labels.shape == (5, 2)
            assert np.array_equal(meta.labels, want.labels)
            assert np.array_equal(meta.indices, want.indices)
        # 12 samples made once; the padded last batch's 3 slots repeat the first ones: reused.
        assert window.produced_total == 12 and window.reused_total == 3
