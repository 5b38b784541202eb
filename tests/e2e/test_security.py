"""Keys on the wire, secure defaults off-host, nothing leaked to a client (real processes).

A server started with ``--keys`` (a `pipeline-keys` folder) serves only holders of its keys,
encrypted; anonymous peers get no reply at all. A tcp bind beyond loopback without keys is a
start-up error; metrics listen on 127.0.0.1 and answer only /metrics; error replies carry no
server path; list files cannot climb out of their folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq
from batchwire import wire
from batchwire.client import RemoteLoader, ServerError
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.keys import create_keys
from serverproc import free_tcp_endpoint, running_server, small_server_args

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return create_keys(tmp_path_factory.mktemp("keys") / "keys")


@pytest.fixture(scope="module")
def keyed_server(keys):
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    args = (*small_server_args(seed=2), "--keys", str(keys), "--metrics-port", str(port))
    with running_server(*args) as srv:
        srv.metrics_port = port
        yield srv


def loader(endpoint, **kw) -> RemoteLoader:
    return RemoteLoader(endpoint, "train", rank=0, world_size=1, device="cpu", **kw)


def test_a_key_holder_is_served_and_an_anonymous_peer_gets_nothing(keyed_server, keys):
    with loader(keyed_server.endpoint, keys=keys, timeout=30) as holder:
        images, labels = next(iter(holder))
        assert images.shape[0] == 16 and labels.dtype == torch.int64
    ctx = zmq.Context()
    try:
        anonymous = ctx.socket(zmq.DEALER)
        anonymous.linger = 0
        anonymous.connect(keyed_server.endpoint)
        hello = wire.Hello(split="train", rank=0, world_size=1, epoch=0, batches=(0,), session=1)
        for msg in (wire.StatsRequest(), hello):
            anonymous.send(msg.pack())
        assert not anonymous.poll(1500), "an anonymous peer got a reply"
        anonymous.close()
    finally:
        ctx.destroy(linger=0)


def test_an_anonymous_loader_and_a_wrong_key_fail_clearly_and_fast(keyed_server, keys, tmp_path):
    match = "security handshake failed: .*one side uses keys and the other does not"
    with (
        loader(keyed_server.endpoint, timeout=30) as anonymous,
        pytest.raises(ServerError, match=match),
    ):
        len(anonymous)
    other = create_keys(tmp_path / "other")
    shutil.copy(keys / "server.key", other / "server.key")  # right server, our key unknown
    with (
        loader(keyed_server.endpoint, keys=other, timeout=30) as wrong,
        pytest.raises(ServerError, match="the server rejected our key"),
    ):
        len(wrong)


@pytest.mark.timeout(60)
def test_the_server_says_keys_are_on_and_logs_and_counts_rejected_handshakes(
    keyed_server, keys, tmp_path
):
    """pipeline-monitor names the key problem as the loader does; the server says at start
    that keys are on, logs the rejected handshakes and counts them by reason."""
    monitor = [str(BIN / "pipeline-monitor"), keyed_server.endpoint, "--once", "--timeout", "3"]
    other = create_keys(tmp_path / "other")
    shutil.copy(keys / "server.key", other / "server.key")  # right server, our key unknown
    for extra in ([], ["--keys", str(other)]):
        proc = subprocess.run([*monitor, *extra], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 1, proc.stdout
        err = proc.stderr
        key_problem = "security handshake failed" in err or "rejected our key" in err
        assert key_problem and "--keys DIR" in proc.stderr, proc.stderr
        assert "is pipeline-server running" not in proc.stderr, proc.stderr
    log = keyed_server.log()
    assert f"keys: on (--keys {keys})" in log, log
    assert "in the security handshake (--keys is on): " in log, log
    url = f"http://127.0.0.1:{keyed_server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    counts = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("batchwire_handshake_failures_total{")
    }
    # Which reason the server sees for a client without keys depends on who hangs up first.
    assert set(counts) == {"no_keys", "wrong_server_key", "unauthorized_key", "other"}
    assert counts["unauthorized_key"] >= 1 and sum(counts.values()) >= 2, counts


def test_an_off_host_bind_without_keys_is_refused_with_the_two_ways_out():
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    args = [str(BIN / "pipeline-server"), *small_server_args(seed=1)]
    r = subprocess.run(
        [*args, "--bind", f"tcp://0.0.0.0:{port}"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "pipeline-keys" in r.stderr and "--insecure" in r.stderr, r.stderr


def test_metrics_listen_on_loopback_and_answer_only_their_path():
    with (
        socket_port() as port,
        running_server(*small_server_args(seed=1), "--metrics-port", str(port)),
    ):
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            assert b"batchwire_images_total" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/", timeout=10)
        assert err.value.code == 404
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        assert f"127.0.0.1:{port}" in listening and f"0.0.0.0:{port}" not in listening


def test_an_error_reply_names_no_server_path(tmp_path):
    """A batch that cannot be produced (every file gone after start) is refused with its index
    and a reason class; the paths are in the server's log only."""
    root = tmp_path / "data"
    shutil.copytree(default_dataset().val_root / "circle", root / "circle")
    with running_server(*small_server_args(seed=1, root=str(root))) as srv:
        shutil.rmtree(root / "circle")
        # ServerError, or ServerUnavailable quoting it: either way the text a client sees
        with loader(srv.endpoint, timeout=20) as gone, pytest.raises(Exception) as err:
            next(iter(gone))
        assert str(root) not in str(err.value), err.value
        assert str(root) in srv.log()


def test_list_files_cannot_climb_out_but_a_symlink_farm_serves(tmp_path):
    val = default_dataset().val_root
    farm = tmp_path / "farm"
    for cls in ("circle", "cross"):
        (farm / cls).mkdir(parents=True)
        for src in sorted((val / cls).iterdir())[:8]:
            (farm / cls / src.name).symlink_to(src)  # an ImageFolder subset by symlinks
    with (
        running_server(*small_server_args(seed=1, root=str(farm))) as srv,
        loader(srv.endpoint, timeout=30) as ok,
    ):
        assert len(ok) == 1
    escaping = tmp_path / "lists" / "train.txt"
    escaping.parent.mkdir()
    src = next((val / "circle").iterdir())
    for entry in (str(src), f"../farm/circle/{src.name}"):
        escaping.write_text(f"{entry} 0\n")
        args = ["--train", str(escaping), "--bind", free_tcp_endpoint()]
        r = subprocess.run([str(BIN / "pipeline-server"), *args], capture_output=True, text=True)
        assert r.returncode == 2 and "outside the list file's folder" in r.stderr, r.stderr


class socket_port:
    """A TCP port on 127.0.0.1 that was free a moment ago."""

    def __enter__(self) -> int:
        return int(free_tcp_endpoint().rsplit(":", 1)[1])

    def __exit__(self, *exc: object) -> None:
        pass
