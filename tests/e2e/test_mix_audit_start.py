"""Audit of a mix's start with a hostile part (docs/mixtures.md, docs/bad-input.md): an empty
part and a huge repeat stop the start with the reason (`pipeline-server` exits 2), not a start
that never ends; a part whose every file is bad stops it with its name (`pipeline-server` exits
2; `LocalLoader` raises), as a dataset with no readable image does alone, instead of a server
that starts and then fails every batch that draws from that part (the client's ServerError
after 3 tries)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR
from serverproc import free_tcp_endpoint

SAMPLE = SAMPLE_DIR
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A good part (8 real JPEGs), a part of 6 files that are all bad, an empty one."""
    files = sorted(SAMPLE.glob("*.JPEG"))[:8]
    if len(files) < 8:
        pytest.skip(f"{SAMPLE} holds too few JPEGs")
    tmp = tmp_path_factory.mktemp("mixstart")
    for k, f in enumerate(files):
        (tmp / "good" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        os.symlink(f, tmp / "good" / f"c{k % 2}" / f.name)
    for k in range(6):
        (tmp / "bad" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        (tmp / "bad" / f"c{k % 2}" / f"x{k}.jpg").write_bytes(b"\xff\xd8 not a jpeg " * 8)
    (tmp / "empty" / "c0").mkdir(parents=True)
    return tmp / "good", tmp / "bad", tmp / "empty"


def _start(train: str) -> tuple[int | None, str]:
    """The server's exit code (None: still running after 20 s, so it started) and output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [str(BIN / "pipeline-server"), "--train", train, "--batch-size", "4",
         "--image-size", "32", "--workers", "1", "--bind", free_tcp_endpoint()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=20)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, proc.communicate()[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("part", "said"),
    [("empty=1@{empty}", "no image files"), ("big=repeat:1e9@{good}", "too large")],
)
def test_an_empty_part_or_a_huge_repeat_stops_the_start(parts, part, said):
    good, _, empty = parts
    train = f"mix:web={'repeat:1' if 'repeat' in part else '1'}@{good},"
    code, out = _start(train + part.format(empty=empty, good=good))
    assert code == 2, out[-3000:]
    assert said in out, out[-3000:]


@pytest.mark.timeout(60)
def test_a_part_whose_every_file_is_bad_stops_the_start_naming_it(parts):
    good, bad, _ = parts
    code, out = _start(f"mix:web=1@{good},junk=1@{bad}")
    assert code == 2, out[-3000:]
    assert "junk" in out and "no readable image" in out, out[-3000:]


def test_local_loader_refuses_a_part_whose_every_file_is_bad(parts):
    good, bad, _ = parts
    with pytest.raises(ValueError, match=r"junk.*no readable image"):
        LocalLoader(f"mix:web=1@{good},junk=1@{bad}", batch_size=4, image_size=32)
