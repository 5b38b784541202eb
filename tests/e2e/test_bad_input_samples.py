"""Bad input through SampleLoader and LocalLoader: corrupt files, FIFOs and devices are bad files
(logged once, counted once, replaced); a transient read error is not.

The corpus is a list file of real files: good JPEGs, the corrupt kinds of `oddfiles`, a FIFO
(named twice, and once more through a symlink), a directory, /dev/null, and a symlink to a good
JPEG (which must keep working). Loads use the validation crop, which reaches 94 % of an image's
height, so every corrupt file's damage is read (the ROI decoder stops at the crop's last row:
see test_bad_input_decode.test_roi_reads_only_to_the_crops_last_row).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from badinputcorpus import write_corpus
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.samples import BadFileTally, SampleLoader
from oddfiles import jpeg_bytes, smooth_image

VAL = AugmentConfig(image_size=24, train=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[ImageDataset, set[str]]:
    listing, bad = write_corpus(tmp_path_factory.mktemp("corpus"))
    return open_dataset(listing, allow_outside_root=True), bad


@pytest.mark.timeout(60)  # a FIFO opened for reading would block here forever
def test_corrupt_files_and_fifos_are_bad_replaced_and_counted_once(
    corpus: tuple[ImageDataset, set[str]], caplog: pytest.LogCaptureFixture
) -> None:
    ds, bad_paths = corpus
    bad = {i for i, p in enumerate(ds.paths) if p in bad_paths}
    assert len(bad) == len(bad_paths) + 1  # pipe.jpg is listed twice
    caplog.set_level(logging.WARNING, logger="batchwire.pipeline")
    with CpuBatchDecoder(threads=2) as dec:
        loader = SampleLoader(ds, VAL, seed=1, decoder=dec)
        everything = list(range(len(ds)))
        for epoch in (0, 1):
            samples = loader.load(epoch, everything)
            assert [s.requested for s in samples] == everything
            for s in samples:
                assert s.replaced == (s.requested in bad), ds.paths[s.requested]
                assert s.index not in bad
        counts = loader.counts()
        assert counts == {
            "bad_total": len(bad_paths),
            "replaced_total": 2 * len(bad),
            "transient_total": 0,
        }
        assert set(loader.known_bad) == bad
        assert set(loader.bad_files()) == bad_paths
    reasons = loader.known_bad
    assert "FIFO" in reasons[ds.paths.index(str(Path(ds.root).parent / "pipe.jpg"))]
    assert "directory" in reasons[ds.paths.index(str(Path(ds.root).parent / "folder.jpg"))]
    assert "character device" in reasons[ds.paths.index("/dev/null")]
    assert "9000x9000" in reasons[ds.paths.index(str(Path(ds.root).parent / "claims_9000.jpg"))]
    for path in bad_paths:
        logged = [r for r in caplog.records if f"image {path} (" in r.getMessage()]
        assert len(logged) == 1, path


@pytest.mark.timeout(60)
def test_local_loader_counts_every_bad_file_once(corpus: tuple[ImageDataset, set[str]]) -> None:
    ds, bad_paths = corpus
    bad = {i for i, p in enumerate(ds.paths) if p in bad_paths}
    with LocalLoader(
        ds, split="val", batch_size=4, image_size=16, seed=2, threads=2, with_indices=True
    ) as loader:
        seen = []
        for _images, labels, indices in loader:
            seen += [i for i in indices.tolist() if i >= 0]
            assert len(labels) == 4
        counts = loader.counts()
    assert sorted(seen) == list(range(len(ds)))
    assert counts["bad_total"] == len(bad_paths)
    assert counts["replaced_total"] == len(bad)


def test_bad_file_tally_counts_a_file_two_loaders_hold_once(
    corpus: tuple[ImageDataset, set[str]],
) -> None:
    ds, bad_paths = corpus
    tally = BadFileTally()
    with CpuBatchDecoder(threads=1) as dec:
        a = SampleLoader(ds, VAL, seed=1, decoder=dec)
        b = SampleLoader(ds, AugmentConfig(image_size=24, train=True), seed=2, decoder=dec)
        assert tally.add(a.take_bad_files()) + tally.add(b.take_bad_files()) == 0
        a.load(0, range(len(ds)))
        b.load(0, range(len(ds)))
        found = tally.add(a.take_bad_files()) + tally.add(b.take_bad_files())
        assert found == len(bad_paths) == tally.total
        assert tally.add(a.take_bad_files()) + tally.add(b.take_bad_files()) == 0


# Runs in its own process: it lowers RLIMIT_NOFILE and then takes every descriptor left, so
# each open() in the loader meets a real EMFILE from the kernel. The loader's `sleep` (its
# backoff) is where the test frees the descriptors, so "freed during the backoff" needs no
# timing; the delays themselves are a few milliseconds.
_EMFILE_SCRIPT = r"""
import errno, json, os, resource, sys
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.samples import SampleLoader, TransientReadError

ds = open_dataset(sys.argv[1], allow_outside_root=True)
held, on_sleep, slept = [], [], []

def exhaust():
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE, e
            return

def release():
    while held:
        os.close(held.pop())

def sleep(seconds):
    slept.append(seconds)
    while on_sleep:
        on_sleep.pop()()

out = {}
with CpuBatchDecoder(threads=1) as dec:
    loader = SampleLoader(
        ds, AugmentConfig(image_size=16, train=False), seed=0, decoder=dec,
        retry_delays=(0.001, 0.002, 0.004), sleep=sleep,
    )
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
    everything = list(range(len(ds)))

    exhaust()  # 1: no descriptor comes back: the batch fails, transiently
    try:
        loader.load(0, everything)
        out["failed"] = None
    except TransientReadError as e:
        out["failed"] = [e.errno, str(e)]
    release()
    out["after_failure"] = [loader.counts(), sorted(loader.known_bad)]
    out["slept"] = list(slept)

    samples = loader.load(0, everything)  # 2: the same files, now readable, are not "bad"
    out["second"] = [[s.requested, s.index, s.replaced] for s in samples]

    exhaust()  # 3: descriptors come back during the backoff: the retry reads the file
    on_sleep.append(release)
    samples = loader.load(1, everything)
    out["third"] = [[s.requested, s.index, s.replaced] for s in samples]
    out["final"] = [loader.counts(), sorted(loader.known_bad)]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_descriptor_exhaustion_is_retried_and_never_marks_files_bad(tmp_path: Path) -> None:
    for k in range(6):
        (tmp_path / f"{k}.jpg").write_bytes(jpeg_bytes(smooth_image(40, 48, seed=k)))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{k}.jpg {k % 2}\n" for k in range(6)))
    proc = subprocess.run(
        [sys.executable, "-c", _EMFILE_SCRIPT, str(listing)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    errno_, message = out["failed"]
    assert errno_ == 24 and "Too many open files" in message and "not marked bad" in message
    counts, known_bad = out["after_failure"]
    assert known_bad == [] and counts["bad_total"] == 0 and counts["replaced_total"] == 0
    assert counts["transient_total"] == 4  # the first file: 1 try + 3 retries
    assert out["slept"] == [0.001, 0.002, 0.004]  # exponential backoff, bounded
    expected = [[k, k, False] for k in range(6)]
    assert out["second"] == expected
    assert out["third"] == expected
    counts, known_bad = out["final"]
    assert known_bad == [] and counts["bad_total"] == 0 and counts["transient_total"] == 5
