"""The README's recipes, run as written under real frameworks with 2 CPU DDP ranks (gloo).

Lightning ``Trainer(strategy="ddp", devices=2)`` and HF Accelerate and plain DDP under
torchrun, each with the loader itself and with ``DataLoader(loader, batch_size=None)``:
every epoch's order differs, each validation pass sees every image exactly once (Lightning's
sanity check on), and a run resumed from a mid-epoch checkpoint yields exactly the
uninterrupted run's batches from that step on, on every rank. `recipe_harness` records what
each rank's loaders hand out; nothing of ours is replaced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from batchwire.pipeline.synthetic import default_dataset
from forkserver import ForkServer
from serverproc import running_server

# Found, not imported: importing Lightning costs each worker that collects this file 1.4 s.
FRAMEWORKS = ("lightning", "accelerate")
missing = [name for name in FRAMEWORKS if find_spec(name) is None]

pytestmark = [
    pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the dev extra)"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parents[1] / "recipe_harness.py"
BIN = Path(sys.executable).parent
B = 16
RANKS = 2
CKPT_STEP = 17  # epoch 1, batch 5: 12 batches per rank and epoch (400 images, 2 x 16)


@pytest.fixture(scope="module")
def lightning_fork_server(fork_server: ForkServer | None) -> Iterator[ForkServer | None]:
    """A fork server that imported Lightning once: each Lightning process here (the launcher and
    each rank) would import it again, 1.4 s of CPU. Only for the Lightning tests: the torchrun
    and Accelerate ranks fork from the worker's fork server, as they did (with Lightning, and
    torch._dynamo that it imports, loaded in them, one in six Accelerate runs on a loaded
    host hung at its end)."""
    if fork_server is None:  # BATCHWIRE_TEST_FORKSERVER=0: fresh interpreters throughout
        yield None
        return
    with ForkServer.start(preload=("lightning",)) as server:
        yield server


@pytest.fixture
def lightning_forks(lightning_fork_server: ForkServer | None) -> Iterator[ForkServer | None]:
    """The test's children fork from `lightning_fork_server`."""
    if lightning_fork_server is None:
        yield None
        return
    lightning_fork_server.install()
    try:
        yield lightning_fork_server
    finally:
        lightning_fork_server.uninstall()


def test_lightnings_children_start_with_lightning_imported(
    lightning_forks: ForkServer | None,
) -> None:
    if lightning_forks is None:
        pytest.skip("the fork server is off (BATCHWIRE_TEST_FORKSERVER=0)")
    code = "import sys; print('lightning' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


@pytest.fixture(scope="module")
def num_images() -> int:
    return sum(1 for p in default_dataset().val_root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def server():
    root = str(default_dataset().val_root)  # 400 real JPEGs, both splits: short epochs
    args = ("--train", root, "--val", root, "--batch-size", str(B), "--image-size", "32")
    with running_server(*args, "--output-dtype", "uint8", "--workers", "1") as srv:
        yield srv


def run(
    recipe: str, record: Path, *args: str, torchrun: bool = True
) -> subprocess.CompletedProcess:
    record.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "BATCHWIRE_RECIPE": str(ROOT / "examples" / recipe)}
    env.update(RECORD_DIR=str(record), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["ACCELERATE_USE_CPU"] = "true"  # Accelerate runs DDP over gloo on CPU only when told
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launcher = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}"]
    cmd = [*(launcher if torchrun else [sys.executable]), str(HARNESS), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def check_feedback(proc: subprocess.CompletedProcess, epochs: int, accuracy: str) -> None:
    """One line per epoch with the loss and an accuracy (rank 0 only), and a progress bar."""
    for epoch in range(epochs):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"epoch {epoch}: ")]
        assert len(lines) == 1, proc.stdout[-3000:]
        assert "train loss " in lines[0] and f"{accuracy} " in lines[0], lines[0]
    out = proc.stdout + proc.stderr  # tqdm: stderr; Lightning's bar (tqdm or rich): stdout
    assert "it/s" in out or "s/it" in out, out[-2000:]  # a progress bar: tqdm or rich


def rows(record: Path, split: str, rank: int) -> list[tuple[int, int, list[int]]]:
    files = sorted(record.glob(f"{split}-rank{rank}-*.jsonl"))
    assert len(files) == 1, f"expected one recording of rank {rank}'s {split}, got {files}"
    lines = files[0].read_text().splitlines()
    return [(r["epoch"], r["batch"], r["idx"]) for r in map(json.loads, lines)]


def check_train_epochs(record: Path, epochs: int) -> dict[int, list]:
    """Each rank: every epoch complete and in order, a new order each epoch; ranks disjoint."""
    per_rank = {rank: rows(record, "train", rank) for rank in range(RANKS)}
    for rank, got in per_rank.items():
        by_epoch: dict[int, list] = {}
        for epoch, batch, idx in got:
            by_epoch.setdefault(epoch, []).append((batch, idx))
        assert sorted(by_epoch) == list(range(epochs)), rank
        orders = [[i for _, idx in by_epoch[e] for i in idx] for e in range(epochs)]
        for e in range(epochs):
            assert [b for b, _ in by_epoch[e]] == list(range(12)), (rank, e)
        assert len({tuple(o) for o in orders}) == epochs, f"rank {rank} repeats an epoch's order"
    for e in range(epochs):
        seen = [{i for ep, _, idx in per_rank[r] if ep == e for i in idx} for r in range(RANKS)]
        assert not seen[0] & seen[1], f"ranks overlap in epoch {e}"
    return per_rank


def val_passes(record: Path) -> list[list[int]]:
    """Each validation pass (a pass starts at batch 0): the images all ranks saw, padding out."""
    per_rank = []
    for rank in range(RANKS):
        passes: list[list[list[int]]] = []
        for _, batch, idx in rows(record, "val", rank):
            if batch == 0:
                passes.append([])
            passes[-1].append(idx)
        per_rank.append(passes)
    assert len({len(p) for p in per_rank}) == 1, "ranks ran different numbers of val passes"
    merged = []
    for passes in zip(*per_rank, strict=True):
        merged.append([i for batches in passes for idx in batches for i in idx if i >= 0])
    return merged


def assert_resumed_exactly(full: Path, resumed: Path, step: int) -> None:
    for rank in range(RANKS):
        want = rows(full, "train", rank)[step:]
        assert rows(resumed, "train", rank) == want, f"rank {rank} resumed differently"


@pytest.mark.parametrize("form", ["loader", "dataloader"])
def test_lightning_ddp_recipe(server, tmp_path, num_images, form, lightning_forks):
    """Slow (2 DDP launches): the direct form resumes through Lightning's loader state and the
    callback, the wrapped one through the callback alone; each form is a user's path."""
    wrap = ["--wrap"] if form == "dataloader" else []
    common = ["--server", server.endpoint, "--devices", str(RANKS), "--epochs", "2", *wrap]
    ckpt = tmp_path / "ckpt"
    common += ["--log-dir", str(tmp_path / "logs")]
    args = [*common, "--ckpt-dir", str(ckpt), "--every-n-steps", str(CKPT_STEP)]
    proc = run("lightning_ddp.py", tmp_path / "full", *args, torchrun=False)
    ok(proc)
    check_feedback(proc, epochs=2, accuracy="val accuracy")
    assert list((tmp_path / "logs").rglob("metrics.csv")), "the CSV logger wrote nothing"
    check_train_epochs(tmp_path / "full", epochs=2)
    passes = val_passes(tmp_path / "full")
    assert [len(p) for p in passes[:1]] == [2 * B * RANKS], "sanity check: 2 batches per rank"
    assert len(passes) == 3  # sanity check, then one full pass per epoch
    for images in passes[1:]:
        assert sorted(images) == list(range(num_images)), "a val pass missed or repeated images"

    (saved,) = ckpt.glob(f"*step={CKPT_STEP}.ckpt")
    args = [*common, "--ckpt-dir", str(tmp_path / "ckpt2"), "--resume", str(saved)]
    ok(run("lightning_ddp.py", tmp_path / "resumed", *args, torchrun=False))
    assert_resumed_exactly(tmp_path / "full", tmp_path / "resumed", CKPT_STEP)
    resumed_passes = val_passes(tmp_path / "resumed")
    assert sorted(resumed_passes[-1]) == list(range(num_images))


@pytest.mark.parametrize("form", ["loader", "dataloader"])
def test_accelerate_recipe(server, tmp_path, form):
    """Slow (2 torchrun launches, 1 wrapped): Accelerate's checkpoint carries the loader's state."""
    wrap = ["--wrap"] if form == "dataloader" else []
    common = ["--server", server.endpoint, "--epochs", "2", *wrap]
    ckpt = tmp_path / "ckpt"
    args = [*common, "--ckpt-dir", str(ckpt), "--every-n-steps", str(CKPT_STEP)]
    proc = run("accelerate_ddp.py", tmp_path / "full", *args, torchrun=True)
    ok(proc)
    check_feedback(proc, epochs=2, accuracy="accuracy")
    check_train_epochs(tmp_path / "full", epochs=2)
    if form == "dataloader":
        return  # the wrapped form resumes through the same state as the loader itself
    resume = ["--resume", str(ckpt / f"step_{CKPT_STEP}"), "--ckpt-dir", str(tmp_path / "c2")]
    ok(run("accelerate_ddp.py", tmp_path / "resumed", *common, *resume, torchrun=True))
    assert_resumed_exactly(tmp_path / "full", tmp_path / "resumed", CKPT_STEP)


def test_torchrun_recipe_resumes_after_a_crash(server, tmp_path):
    """Slow (3 torchrun launches): a crash after the checkpoint, then a resume, as a user has it."""
    common = ["--server", server.endpoint, "--epochs", "2", "--every-n-steps", str(CKPT_STEP)]
    proc = run("torchrun_ddp.py", tmp_path / "full", *common, "--ckpt", str(tmp_path / "a.pt"))
    ok(proc)
    check_feedback(proc, epochs=2, accuracy="accuracy")
    check_train_epochs(tmp_path / "full", epochs=2)
    crash = [*common, "--ckpt", str(tmp_path / "b.pt")]
    ok(
        run(
            "torchrun_ddp.py",
            tmp_path / "first",
            *crash,
            "--stop-after",
            str(CKPT_STEP),
            torchrun=True,
        )
    )
    ok(run("torchrun_ddp.py", tmp_path / "resumed", *crash, torchrun=True))
    assert_resumed_exactly(tmp_path / "full", tmp_path / "resumed", CKPT_STEP)


# Issue 29: training code written before the server's default wire became uint8, unchanged:
# a float model fed RemoteLoader batches created with only the arguments users passed then. It
# stopped at the first forward ("Input type (unsigned char) and bias type (float) should be
# the same"). One process, a few steps: what matters is the first forward and backward.
LEGACY_NET = """
import sys
import torch
import torch.nn.functional as F
from batchwire.client import RemoteLoader

def make_net(num_classes=10):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes),
    )
"""

LEGACY_LIGHTNING = (
    LEGACY_NET
    + """
import lightning as L

class Classifier(L.LightningModule):
    def __init__(self, server):
        super().__init__()
        self.net = make_net()
        self.loader = RemoteLoader(server, "train")

    def train_dataloader(self):
        return self.loader

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

trainer = L.Trainer(devices=1, max_steps=3, logger=False, enable_checkpointing=False)
trainer.fit(Classifier(sys.argv[1]))
print("steps", trainer.global_step)
"""
)

LEGACY_ACCELERATE = (
    LEGACY_NET
    + """
from accelerate import Accelerator

accelerator = Accelerator()
loader = RemoteLoader(sys.argv[1], "train", device=accelerator.device)
model = make_net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = accelerator.prepare(model, optimizer)
step = 0
for images, labels in loader:
    loss = F.cross_entropy(model(images), labels)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if step == 3:
        break
loader.close()
print("steps", step)
"""
)


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_code_written_before_the_uint8_wire_trains_unchanged(
    request: pytest.FixtureRequest, server, tmp_path, framework
):
    if framework == "lightning":
        request.getfixturevalue("lightning_forks")
    script = tmp_path / f"{framework}_user.py"
    script.write_text(LEGACY_LIGHTNING if framework == "lightning" else LEGACY_ACCELERATE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, str(script), server.endpoint]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    ok(proc)
    assert "steps 3" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("dispatch", ["default", "no-dispatch"])
def test_accelerate_prepare_of_the_loader_stops_with_the_fix(server, tmp_path, dispatch):
    """Accelerate's prepare() re-shards iterable datasets (rank 0's loader only, or every n-th
    sample of each shard): the loader refuses, naming the fix, instead of losing data."""
    script = tmp_path / "prepared.py"
    config = "None" if dispatch == "default" else "False"
    script.write_text(
        "import os\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import DataLoaderConfiguration\n"
        "from batchwire.client import RemoteLoader\n"
        "from torch.utils.data import DataLoader\n"
        f"acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches={config}))\n"
        f"loader = RemoteLoader({server.endpoint!r}, 'train', device=acc.device)\n"
        "for batch in acc.prepare(DataLoader(loader, batch_size=None)):\n"
        "    pass\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "do not pass it (or a DataLoader around it) to accelerator.prepare()" in proc.stderr
