"""Wire protocol v2: every message round-trips, and hostile frames fail with a clear error."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch
from batchwire import wire as p
from batchwire.wire import messages as wm
from batchwire.wire import tensor_bytes
from batchwire.wire.frames import pack

HELLO = p.Hello(
    split="train",
    rank=1,
    world_size=4,
    epoch=3,
    batches=(5, 7, 9, 11),
    session=2**62 + 7,
    job="run-42",
)
WELCOME = p.Welcome(
    session=9,
    num_batches=10,
    num_samples=1500,
    batch_size=8,
    shape=[8, 3, 32, 32],
    dtype="uint8",
    layout="nhwc",
    mean=[0.485, 0.456, 0.406],
    std=[0.229, 0.224, 0.225],
    num_classes=10,
    classes=[f"class {i}" for i in range(10)],
)
HEADER = p.BatchHeader(
    session=9,
    split="val",
    epoch=0,
    batch_index=7,
    shape=[2, 3, 4, 5],
    dtype="float16",
    layout="nchw",
    indices=[3, -1],
    replaced=1,
    nbytes=2 * 3 * 4 * 5 * 2,
)

# The smallest stats a server sends (test_stats_schema.py checks the schema itself).
STATS = p.ServerStats(
    v=p.STATS_VERSION,
    uptime_s=1.0,
    time=0.0,
    stages=(p.StageStats("read", 0, 2, 0.0),),
    throughput=p.Throughput(0.0, 0.0, 0.0),
    counters=p.Counters(0, 0, 0, 0, 0, 0, 0),
    clients=(),
)


@pytest.mark.parametrize(
    "msg",
    [
        HELLO,
        p.Credit(batches=(3, 1), stats={"images_per_s": 1.5}),
        p.Credit(),
        p.Bye(),
        p.StatsRequest(),
    ],
)
def test_client_messages_round_trip(msg):
    assert p.decode_client_message(msg.pack()) == msg


@pytest.mark.parametrize(
    "msg",
    [WELCOME, HEADER, p.ErrorReply("no"), p.Shutdown(), p.StatsReply(STATS)],
)
def test_server_messages_round_trip(msg):
    assert p.decode_server_message(msg.pack()) == msg


def test_every_frame_carries_version_and_type():
    for msg in (HELLO, WELCOME, HEADER, p.Bye()):
        raw = msgpack.unpackb(msg.pack())
        assert raw["v"] == p.PROTOCOL_VERSION == 2
        assert raw["type"] == msg.TYPE


def _hello_map(**changes):
    m = HELLO.to_map()
    m.update(changes)
    return msgpack.packb(m)


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"\xc1garbage", "not a valid msgpack"),
        (b"", "not a valid msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (msgpack.packb({"type": "hello"}), "no protocol version"),
        (msgpack.packb({"v": 2}), "'type'"),
        (msgpack.packb({"v": 2, "type": "launch"}), "unknown message type 'launch'"),
        (msgpack.packb({1: 2, "v": 1, "type": "bye"}), "not a valid msgpack"),
        (_hello_map(rank=True), "'rank' must be an integer"),
        (_hello_map(rank=4), "must be < world_size"),
        (_hello_map(world_size=0), "'world_size' must be >= 1"),
        (_hello_map(batches=[-1]), "'batches'"),
        (_hello_map(batches=[3, 3]), "lists a batch twice"),
        (_hello_map(batches=list(range(p.MAX_PREFETCH + 1))), "at most"),
        (_hello_map(batches="0"), "'batches'"),
        (_hello_map(split=""), "'split'"),
        (_hello_map(job="j" * (p.MAX_JOB_LEN + 1)), "'job'"),
        (_hello_map(session="x"), "'session'"),
        (msgpack.packb({"v": 2, "type": "credit", "batches": [True]}), "'batches'"),
        (msgpack.packb({"v": 2, "type": "credit", "batches": [], "stats": [1]}), "'stats'"),
        (b"\x91" * 5000, "not a valid msgpack"),  # deeply nested arrays
        (b"\xdd\xff\xff\xff\xff", "not a valid msgpack"),  # array claiming 4G items
        (b"\x81\xa1v" + b"\xc6\x7f\xff\xff\xff", "not a valid msgpack"),  # 2 GB bin claim
        (msgpack.packb({"v": 1, "type": "bye", "x": [0] * 70000}), "exceeds the limit"),
        (b"x" * (10 << 20), "exceeds the limit of 65536"),
    ],
)
def test_client_frame_rejected(frame, needle):
    with pytest.raises(p.ProtocolError, match=None) as info:
        p.decode_client_message(frame)
    assert needle in str(info.value)


def test_version_mismatch_names_both_versions():
    with pytest.raises(p.VersionMismatch) as info:
        p.decode_client_message(msgpack.packb({"v": 1, "type": "hello"}))
    assert info.value.peer_version == 1
    assert "v2" in str(info.value) and "v1" in str(info.value)


def test_client_cannot_send_server_messages():
    with pytest.raises(p.ProtocolError, match="unknown message type 'welcome'"):
        p.decode_client_message(WELCOME.pack())


def test_welcome_classes_are_optional_and_bounded():
    """An older server's welcome has no `classes`: it decodes with none. A list that is not
    one name per class, or beyond the bounds, is refused; `welcome_classes` sends [] rather
    than a list the client would refuse."""
    m = WELCOME.to_map()
    del m["classes"]
    old = p.decode_server_message(pack(m))
    assert isinstance(old, p.Welcome) and old.classes == [] and old.num_classes == 10
    for bad in (["a"] * 9, [1] * 10, "abc", ["x" * (wm.MAX_CLASS_NAME_LEN + 1)] + ["a"] * 9):
        with pytest.raises(p.ProtocolError, match="classes"):
            p.decode_server_message(pack({**WELCOME.to_map(), "classes": bad}))
    many = [str(i) for i in range(wm.MAX_CLASSES + 1)]
    with pytest.raises(p.ProtocolError, match="classes"):
        p.decode_server_message(pack({**m, "num_classes": len(many), "classes": many}))
    assert wm.welcome_classes(many) == []
    assert wm.welcome_classes(["tench", "goldfish"]) == ["tench", "goldfish"]
    long = ["n" * wm.MAX_CLASS_NAME_LEN] * (wm.MAX_CLASS_NAMES_CHARS // wm.MAX_CLASS_NAME_LEN + 1)
    assert wm.welcome_classes(long) == []


def test_sharing_fields_are_absent_by_default_and_read_from_older_maps():
    """`BatchHeader.shared` and `Welcome.share_window` are new: left out when False / 0, so a
    server that shares nothing sends the maps older clients know, and an older server's maps
    (without them) decode as not shared."""
    assert "shared" not in HEADER.to_map() and "share_window" not in WELCOME.to_map()
    old_header = p.decode_server_message(pack(HEADER.to_map()))
    old_welcome = p.decode_server_message(pack(WELCOME.to_map()))
    assert old_header.shared is False and old_welcome.share_window == 0
    shared = dataclasses.replace(HEADER, shared=True)
    window = dataclasses.replace(WELCOME, share_window=16)
    assert shared.to_map()["shared"] is True and window.to_map()["share_window"] == 16
    assert p.decode_server_message(shared.pack()) == shared
    assert p.decode_server_message(window.pack()) == window
    # Only a true bool is "shared"; the window is a count.
    assert p.decode_server_message(pack({**HEADER.to_map(), "shared": 1})).shared is False
    with pytest.raises(p.ProtocolError, match="'share_window'"):
        p.decode_server_message(pack({**WELCOME.to_map(), "share_window": -1}))


def test_batch_header_checks_sizes():
    bad = HEADER.to_map() | {"nbytes": 5}
    with pytest.raises(p.ProtocolError, match="'nbytes'"):
        p.decode_server_message(msgpack.packb(bad))
    bad = HEADER.to_map() | {"indices": [1, 2, 3]}
    with pytest.raises(p.ProtocolError, match="'indices' must have 2 items"):
        p.decode_server_message(msgpack.packb(bad))
    bad = HEADER.to_map() | {"shape": [2, 4, 4, 5]}
    with pytest.raises(p.ProtocolError, match="'shape'"):
        p.decode_server_message(msgpack.packb(bad))
    bad = HEADER.to_map() | {"dtype": "int32"}
    with pytest.raises(p.ProtocolError, match="'dtype'"):
        p.decode_server_message(msgpack.packb(bad))


def test_dtype_mapping():
    for name in p.DTYPES:
        dt = p.torch_dtype(name)
        assert p.dtype_name(dt) == name
        assert torch.empty(0, dtype=dt).element_size() == p.itemsize(name)
    assert p.numpy_dtype("float16") == np.float16
    with pytest.raises(p.ProtocolError, match="numpy has no bfloat16"):
        p.numpy_dtype("bfloat16")
    with pytest.raises(p.ProtocolError, match="cannot travel"):
        p.dtype_name(torch.int32)
    assert p.images_nbytes([64, 3, 224, 224], "uint8") == 64 * 3 * 224 * 224
    assert p.images_nbytes([2, 3, 4, 4], "float32") == 2 * 3 * 4 * 4 * 4


def test_labels_frame_is_little_endian_int64():
    labels = np.array([0, 1, 2**40, 7], dtype=np.int64)
    frame = p.labels_to_frame(labels).tobytes()
    assert frame == b"".join(int(v).to_bytes(8, "little", signed=True) for v in labels)
    np.testing.assert_array_equal(p.labels_from_frame(frame, 4), labels)
    with pytest.raises(p.ProtocolError, match="expected 32"):
        p.labels_from_frame(frame[:-1], 4)


def test_labels_frame_decodes_into_its_own_array_or_in_place():
    labels = np.array([0, 1, 2**40, -100], dtype=np.int64)
    frame = p.labels_to_frame(labels).tobytes()
    own = p.labels_from_frame(frame, 4)
    assert own.dtype == np.int64 and own.flags.writeable
    received = torch.empty(6, dtype=torch.int64)  # a receive slot larger than the batch
    buf = memoryview(received.view(torch.uint8).numpy())[:32]
    buf[:] = frame
    out = received[:4].numpy()
    assert p.labels_from_frame(buf, 4, out=out) is out
    np.testing.assert_array_equal(out, labels)
    # on a big-endian host the received bytes, viewed in its native order, are swapped in place
    raw = bytearray(frame)
    big = np.frombuffer(raw, dtype=">i8")
    np.testing.assert_array_equal(p.labels_from_frame(raw, 4, out=big), labels)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_tensor_bytes_follow_the_layout(dtype):
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5).to(dtype)
    nchw = tensor_bytes(t)
    assert nchw.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()
    cl = t.contiguous(memory_format=torch.channels_last)
    nhwc = tensor_bytes(cl)
    assert nhwc.tobytes() == t.permute(0, 2, 3, 1).contiguous().view(torch.uint8).numpy().tobytes()
    # zero copy: the array shares the tensor's memory
    assert nhwc.__array_interface__["data"][0] == cl.data_ptr()
    with pytest.raises(ValueError, match="neither NCHW nor NHWC"):
        tensor_bytes(t[:, :, ::2])


def test_mix_fingerprint_is_absent_unless_a_mix_and_checked():
    """`Welcome.mix_fingerprint` is new: left out for a split that is not a mix, so such a
    server sends the map older clients know and an older server's map decodes as no mix; a
    mix's travels and comes back; a non-string or overlong one is a ProtocolError."""
    assert "mix_fingerprint" not in WELCOME.to_map()
    assert p.decode_server_message(pack(WELCOME.to_map())).mix_fingerprint == ""
    mixed = dataclasses.replace(WELCOME, mix_fingerprint="0123456789abcdef")
    assert mixed.to_map()["mix_fingerprint"] == "0123456789abcdef"
    assert p.decode_server_message(mixed.pack()) == mixed
    for bad in (7, "f" * (wm.MAX_MIX_FINGERPRINT_LEN + 1)):
        with pytest.raises(p.ProtocolError, match="'mix_fingerprint'"):
            p.decode_server_message(pack({**WELCOME.to_map(), "mix_fingerprint": bad}))
