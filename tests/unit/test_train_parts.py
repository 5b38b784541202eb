"""The trainer's parts on their own: models, schedule, checkpoint files, accuracy counting, record.

No processes here; the whole file runs in about 10 s on 2 cores (shared, load 6-8).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from batchwire.train.checkpoint import (
    NoUsableCheckpoint,
    checkpoint_path,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from batchwire.train.evaluate import count_correct
from batchwire.train.models import build_model
from batchwire.train.record import (
    IndexRecorder,
    read_record,
    record_path,
    record_position,
    truncate_records,
)
from batchwire.train.schedule import build_scheduler, resume_schedule, step_schedule


@pytest.mark.parametrize(
    ("name", "params"),
    # The published parameter counts of the reference architectures (1000 classes).
    [("resnet18", 11_689_512), ("resnet50", 25_557_032)],
)
def test_resnets_have_the_reference_parameter_count(name: str, params: int) -> None:
    model = build_model(name, 1000)
    assert sum(p.numel() for p in model.parameters()) == params
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last))
    assert out.shape == (2, 1000)


def test_zero_init_residual_zeroes_the_last_norm_of_every_block() -> None:
    model = build_model("resnet18", 10, zero_init_residual=True)
    last_norms = [b.last_bn().weight for s in (model.layer1, model.layer4) for b in s]
    assert all(torch.count_nonzero(w) == 0 for w in last_norms)
    assert torch.count_nonzero(model.layer1[0].bn1.weight) > 0


def test_every_model_name_the_cli_offers_builds() -> None:
    """config.MODEL_NAMES is argparse's list of choices: each one builds, none is left over."""
    from batchwire.train.config import MODEL_NAMES
    from batchwire.train.models import _BUILDERS

    assert tuple(_BUILDERS) == MODEL_NAMES


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        build_model("vgg", 10)


def _lrs(kind: str, total: int, warmup: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_scheduler(opt, kind, total_steps=total, warmup_steps=warmup)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_cosine_warms_up_linearly_then_decays_to_zero() -> None:
    lrs = _lrs("cosine", total=100, warmup=10)
    assert lrs[0] == pytest.approx(0.1)
    assert all(a < b for a, b in itertools.pairwise(lrs[:11]))
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[-1] < 0.001


def test_onecycle_starts_low_peaks_at_warmup_and_ends_near_zero() -> None:
    lrs = _lrs("onecycle", total=100, warmup=0)  # no warm-up given: 30% of training
    assert lrs[0] == pytest.approx(1 / 25)
    assert max(lrs) == pytest.approx(1.0)
    assert lrs.index(max(lrs)) == 30
    assert lrs[-1] < 0.001


def test_scheduler_state_resumes_on_the_same_curve(tmp_path) -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched = build_scheduler(opt, "cosine", total_steps=50, warmup_steps=5)
    for _ in range(20):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched2 = build_scheduler(opt2, "cosine", total_steps=50, warmup_steps=5)
    sched2.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_a_changed_curve_is_followed_from_the_same_place(tmp_path) -> None:
    """Resumed with twice the optimizer steps per epoch (half the ranks), the run follows its
    own curve from the equivalent step instead of the checkpoint's, which would end the decay
    halfway; with the same curve it restores the saved state exactly."""

    def scheduler(steps_per_epoch: int):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        return build_scheduler(
            opt, "cosine", total_steps=4 * steps_per_epoch, warmup_steps=steps_per_epoch // 2
        )

    old = scheduler(8)
    for _ in range(16):  # two epochs of 8 steps
        old.optimizer.step()
        old.step()
    saved = old.state_dict()

    same = scheduler(8)
    assert resume_schedule(same, saved, position=16)
    assert same.get_last_lr() == old.get_last_lr() and same.last_epoch == 16

    changed = scheduler(16)
    assert not resume_schedule(changed, saved, position=2 * 16)
    fresh = scheduler(16)
    for _ in range(32):
        fresh.optimizer.step()
        fresh.step()
    assert changed.get_last_lr() == pytest.approx(fresh.get_last_lr())
    assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(fresh.get_last_lr()[0])
    assert changed.curve["total_steps"] == 64  # type: ignore[attr-defined]


@pytest.mark.parametrize("warmup_epochs", [0, 2])
def test_a_changed_curve_seeks_from_its_own_start_not_the_restored_optimizer_lr(
    warmup_epochs: int,
) -> None:
    """As pipeline-train resumes: the optimizer's state is loaded first (with the old curve's lr
    in it), then the schedule. The seek must still land on this curve's value: the schedulers
    step from the current lr, so an old lr carried its ratio into every later step (a warm-up
    past the peak; a cosine without warm-up kept 15 % low for good)."""

    def scheduler(steps_per_epoch: int):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
        return build_scheduler(
            opt, "cosine", total_steps=4 * steps_per_epoch,
            warmup_steps=warmup_epochs * steps_per_epoch,
        )  # fmt: skip

    old = scheduler(23)  # 2 ranks
    for _ in range(7):
        old.optimizer.step()
        old.step()
    resumed = scheduler(46)  # 1 rank: twice the steps per epoch
    resumed.optimizer.load_state_dict(old.optimizer.state_dict())
    assert not resume_schedule(resumed, old.state_dict(), position=14)
    fresh = scheduler(46)
    for _ in range(14):
        fresh.optimizer.step()
        fresh.step()
    for _ in range(60):  # and every later step: the same curve
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(fresh.get_last_lr()[0])
        for sched in (resumed, fresh):
            sched.optimizer.step()
            sched.step()


@pytest.mark.parametrize("kind", ["cosine", "onecycle"])
def test_no_scheduler_step_past_the_curve(kind: str) -> None:
    """A pass resumed at another world size may take a step or two more than the rebuilt curve
    counts: OneCycleLR would raise, a cosine would climb again; the lr holds at its end."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_scheduler(opt, kind, total_steps=10, warmup_steps=2)
    for _ in range(10):
        opt.step()
        step_schedule(sched)
    end = opt.param_groups[0]["lr"]
    for _ in range(3):
        opt.step()
        step_schedule(sched)
    assert opt.param_groups[0]["lr"] == end and sched.last_epoch == 10


def test_an_unreadable_newer_file_never_costs_the_new_checkpoints(tmp_path) -> None:
    """A higher-numbered file that does not load is skipped, and the checkpoints written after
    resuming from an older one are kept even though their step numbers are lower."""
    save_checkpoint(tmp_path, 10, {"step": 10}, keep=1)
    checkpoint_path(tmp_path, 50).write_bytes(b"torn")
    assert load_latest(tmp_path)[1]["step"] == 10
    for step in (12, 14):
        save_checkpoint(tmp_path, step, {"step": step}, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [14, 50]
    assert load_latest(tmp_path)[1]["step"] == 14


def test_a_folder_of_only_unreadable_checkpoints_is_an_error(tmp_path) -> None:
    """Starting over from step 0 without a word would throw the run's progress away."""
    checkpoint_path(tmp_path, 7).write_bytes(b"torn")
    with pytest.raises(NoUsableCheckpoint, match="move them aside"):
        load_latest(tmp_path)


def test_checkpoints_are_found_by_step_and_old_ones_pruned(tmp_path) -> None:
    assert load_latest(tmp_path) is None
    for step in (5, 40, 300):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((3,), step)}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 300]
    path, state = load_latest(tmp_path)
    assert path == checkpoint_path(tmp_path, 300)
    assert torch.equal(state["w"], torch.full((3,), 300))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_torn_or_foreign_newest_file_falls_back_to_the_previous_one(tmp_path) -> None:
    save_checkpoint(tmp_path, 7, {"step": 7}, keep=0)
    checkpoint_path(tmp_path, 9).write_bytes(b"PK\x03\x04 half a zip")  # e.g. a full disk
    (tmp_path / ".ckpt-000000011.pt.abc.tmp").write_bytes(b"an interrupted write")
    path, state = load_latest(tmp_path)
    assert (path, state["step"]) == (checkpoint_path(tmp_path, 7), 7)
    save_checkpoint(tmp_path, 12, {"step": 12}, keep=0)  # the next save clears the killed write
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000007.pt", "ckpt-000000009.pt", "ckpt-000000012.pt",
    ]  # fmt: skip


def test_accuracy_counts_exclude_padding() -> None:
    logits = torch.tensor(
        [
            [9.0, 1.0, 0.0],  # predicts 0, label 0: top1
            [0.0, 1.0, 9.0],  # predicts 2, label 1: top2 only
            [9.0, 0.0, 1.0],  # predicts 0, label 0, but padding
            [0.0, 9.0, 1.0],  # predicts 1, label 0: miss at k=2 (0 is third)
        ]
    )
    labels = torch.tensor([0, 1, 0, 0])
    indices = torch.tensor([10, 11, -1, 12])
    assert count_correct(logits, labels, indices, k=2).tolist() == [1.0, 2.0, 3.0]
    # k larger than the class count means "any class": every valid sample counts
    assert count_correct(logits, labels, indices, k=5).tolist() == [1.0, 3.0, 3.0]


def test_record_truncates_to_a_resume_point_and_ignores_a_torn_line(tmp_path) -> None:
    truncate_records(tmp_path, 0, 0, 0)
    rec = IndexRecorder(tmp_path, rank=1)
    for epoch, batch in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        rec.append(epoch, batch, [epoch * 100 + batch])
    rec.close()
    with open(record_path(tmp_path, 1), "a") as f:
        f.write('{"epoch": 1, "batch": 2, "ind')  # killed mid-write
    assert len(read_record(record_path(tmp_path, 1))) == 5
    truncate_records(tmp_path, 1, 0, 1)
    kept = [(r["epoch"], r["batch"]) for r in read_record(record_path(tmp_path, 1))]
    assert kept == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_records_of_every_rank_are_cut_and_a_resumed_pass_orders_after_its_epoch_start(
    tmp_path,
) -> None:
    """An elastic restart: 2 ranks trained batches 0-3 of epoch 0, the checkpoint is at batch 2;
    the restarted single rank trains the rest as a pass from sample 128, numbered from 0."""
    for rank in (0, 1):
        rec = IndexRecorder(tmp_path, rank)
        for batch in range(4):
            rec.append(0, batch, [rank, batch])
        rec.close()
    truncate_records(tmp_path, 0, 0, 2)  # rank 0 cuts both files: rank 1 has no owner now
    for rank in (0, 1):
        assert [r["batch"] for r in read_record(record_path(tmp_path, rank))] == [0, 1]
    rec = IndexRecorder(tmp_path, 0)
    for batch in range(3):
        rec.append(0, batch, [9, batch], pass_start=128)
    rec.close()
    lines = read_record(record_path(tmp_path, 0))
    assert [record_position(r) for r in lines] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 128, 0),
        (0, 128, 1),
        (0, 128, 2),
    ]
    assert "pass" not in lines[0]  # the epoch's own pass: lines as before
    truncate_records(tmp_path, 0, 128, 1)  # a second restart, inside the resumed pass
    kept = [record_position(r) for r in read_record(record_path(tmp_path, 0))]
    assert kept == [(0, 0, 0), (0, 0, 1), (0, 128, 0)]
