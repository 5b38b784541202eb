"""A mixture served by a real `pipeline-server` (issue 33): `--train mix:a=0.75@A,b=0.25@B`
serves the mix's order (the in-process `MixSampler`'s, index for index, and `LocalLoader`'s
over the same text, pixel for pixel), labels in the union
of the parts' class names (`loader.classes`), each sample's part in its metadata
(`with_metadata=True`); a mid-epoch resume gives the same batches; `--val mix:...` visits every
sample of every part once over the ranks; the server's stats count each part's samples sent
against its weight; a bad `--mix-schedule` ends the server with exit 2. Repeat and choose
mixes: the welcome's num_samples is the epoch's draws, two jobs of one mix share production,
and a fleet of servers of other mixes is refused (`Welcome.mix_fingerprint`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.sampler import MixSampler
from batchwire.pipeline.sources.mix import open_mix, parse_mix
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire import ProtocolError
from batchwire.wire.stats_client import fetch_stats
from promtext import parse_metrics
from serverproc import free_tcp_endpoint, running_server, running_servers

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[Path, Path]:
    """Two folders: a with classes 0-3, b with classes 2-4 (two names shared)."""
    root = tmp_path_factory.mktemp("mixsrc")
    classes = sorted(p for p in default_dataset().val_root.iterdir() if p.is_dir())
    for name, picked, count in (("a", classes[:4], 10), ("b", classes[2:5], 6)):
        for cls in picked:
            (root / name / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:count]:
                shutil.copyfile(f, root / name / cls.name / f.name)
    return root / "a", root / "b"


def _batches(loader) -> list[tuple]:
    return [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in b) for b in loader]


@pytest.mark.timeout(180)
def test_mix_served_in_its_order_with_parts_and_union_labels(parts):
    a, b = parts
    train = f"mix:a=0.75@{a},b=0.25@{b}"
    mix = open_mix(parse_mix(train), open_dataset, train=True)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    args = (
        "--train", train, "--val", f"mix:a=1@{a},b=1@{b}", "--batch-size", "8",
        "--image-size", "32", "--workers", "1", "--seed", "3", "--metrics-port", str(port),
    )  # fmt: skip
    with running_server(*args) as srv:
        loader = RemoteLoader(
            srv.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True,
            with_metadata=True, normalize_on_device=False, prefetch_next_epoch=False, timeout=60,
        )  # fmt: skip
        try:
            assert loader.classes == mix.classes
            assert len(loader.classes) == 5  # a's 4 and b's 3, two shared by name
            loader.set_epoch(1)
            got = _batches(loader)
            want = MixSampler(mix.plan, 8, seed=3)
            assert len(got) == want.num_batches == mix.plan.epoch_length // 8
            parts_seen = []
            for k, (_, labels, indices, metadata) in enumerate(got):
                assert indices.tolist() == want.plan(1, k).indices.tolist(), k
                assert labels.tolist() == mix.labels[indices.numpy()].tolist()
                for i, meta in zip(indices.tolist(), metadata, strict=True):
                    assert meta == {"part": mix.names[mix.part_of(i)[0]]}
                    parts_seen.append(meta["part"])
            assert parts_seen.count("a") == round(0.75 * len(parts_seen))
            # The server's stats count each part's samples sent, against its weight.
            (train_mix, val_mix) = fetch_stats(srv.endpoint).mixes
            assert (train_mix.split, train_mix.epoch, val_mix.epoch) == ("train", 1, None)
            assert [
                (p.name, p.weight, p.served_this_epoch, p.served_total) for p in train_mix.parts
            ] == [
                (n, w, parts_seen.count(n), parts_seen.count(n))
                for n, w in (("a", 0.75), ("b", 0.25))
            ]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = parse_metrics(r.read().decode())
            for name in ("a", "b"):
                served = metrics[f'batchwire_mix_part_samples_total{{part="{name}",split="train"}}']
                assert served == parts_seen.count(name)
            # LocalLoader over the same mix text: the server's batches, pixel for pixel.
            with LocalLoader(
                train, batch_size=8, image_size=32, seed=3, output_dtype="uint8",
                with_indices=True, with_metadata=True,
            ) as local:  # fmt: skip
                local.set_epoch(1)
                here = _batches(local)
            assert len(here) == len(got)
            for k, (x, y) in enumerate(zip(here, got, strict=True)):
                assert all(torch.equal(p, q) for p, q in zip(x[:3], y[:3], strict=True)), k
                assert x[3] == y[3], k
            state = loader.state_dict()
            loader.load_state_dict({**state, "epoch": 1, "next_batch": 3})
            resumed = _batches(loader)
            assert len(resumed) == len(got) - 3
            for x, y in zip(resumed, got[3:], strict=True):
                assert all(torch.equal(p, q) for p, q in zip(x[:3], y[:3], strict=True))
                assert x[3] == y[3]
        finally:
            loader.close()
        seen = []
        for rank in range(2):
            val = RemoteLoader(
                srv.endpoint, "val", rank=rank, world_size=2, device="cpu", with_indices=True,
                timeout=60,
            )  # fmt: skip
            try:
                seen += [i for batch in _batches(val) for i in batch[2].tolist() if i >= 0]
            finally:
                val.close()
        assert sorted(seen) == list(range(len(open_dataset(a)) + len(open_dataset(b))))


@pytest.mark.timeout(60)
def test_bad_mix_schedule_exits_2(parts):
    a, b = parts
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [str(BIN / "pipeline-server"), "--train", f"mix:a=0.5@{a},b=0.5@{b}",
         "--mix-schedule", "2:c=0.1", "--bind", free_tcp_endpoint()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=50,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout
    assert "--mix-schedule: no part 'c'" in done.stdout, done.stdout


def _stream(endpoints: str | list[str], job: str) -> tuple[int, int, list[list[int]]]:
    """One job's train epoch 0: (len(loader), loader.num_samples, each batch's indices)."""
    loader = RemoteLoader(
        endpoints, "train", device="cpu", with_indices=True, prefetch_next_epoch=False,
        timeout=60, job=job,
    )  # fmt: skip
    try:
        return len(loader), loader.num_samples, [b[2].tolist() for b in loader]
    finally:
        loader.close()


@pytest.mark.timeout(180)
def test_repeat_and_choose_mixes_count_share_and_keep_fleets_apart(parts):
    """Two mixes of equal epoch length (a=40 and b=18 samples: repeat 2 and 0.5, or choose 40
    and 49: 89 draws, 11 batches of 8) but other index spaces (138, 112) and orders:
    - the welcome's num_samples is the epoch's 89 draws and len(loader) the batches served;
    - two jobs of one mix on one server get the same batches, produced once;
    - a loader over both servers stops with a ProtocolError naming the mix fingerprint; over
      two servers of the same mix it streams that mix's batches."""
    a, b = parts
    common = ("--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "5")
    repeat = ("--train", f"mix:a=repeat:2@{a},b=repeat:0.5@{b}", *common)
    choose = ("--train", f"mix:a=choose:40@{a},b=choose:49@{b}", *common)
    with running_servers(2, *repeat) as (srv, twin), running_server(*choose) as other:
        jobs: list[tuple[int, int, list[list[int]]] | BaseException] = [(0, 0, [])] * 2

        def job(i: int) -> None:
            try:
                jobs[i] = _stream(srv.endpoint, f"job{i}")
            except BaseException as exc:  # re-raised below, in the test thread
                jobs[i] = exc

        threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for got in jobs:
            if isinstance(got, BaseException):
                raise got
        (n0, samples0, stream0), (n1, samples1, stream1) = jobs  # type: ignore[misc]
        assert samples0 == samples1 == 89, "the welcome's num_samples is the mix epoch's draws"
        assert n0 == n1 == len(stream0) == len(stream1) == 89 // 8
        assert stream0 == stream1
        c = srv.stats()["counters"]
        assert c["batches_total"] == 2 * len(stream0)
        assert c["batches_produced_total"] < c["batches_total"], c
        with pytest.raises(ProtocolError, match=r"mix_fingerprint [0-9a-f]{16} vs [0-9a-f]{16}"):
            _stream([srv.endpoint, other.endpoint], "fleet")
        n, samples, fleet = _stream([srv.endpoint, twin.endpoint], "twins")
        assert (n, samples, fleet) == (n0, 89, stream0)
