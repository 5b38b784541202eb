"""pipeline-train's feedback: the epoch bar (tqdm, terminals only) and --log-dir's CSV files."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest
from batchwire.train.logbook import EPOCH_FIELDS, STEP_FIELDS, MetricsLog
from batchwire.train.progress import EpochBar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_shows_on_a_terminal_at_once_and_lines_go_above_it(capsys) -> None:
    term = FakeTerminal()
    bar = EpochBar(True, 10, initial=3, desc="epoch 2", stream=term)
    assert "epoch 2" in term.getvalue() and "3/10" in term.getvalue()  # before any batch
    bar.update(1)
    bar.write("step 1 (epoch 2 batch 4/10): loss 1.0")
    bar.close()
    assert "step 1 (epoch 2 batch 4/10)" in capsys.readouterr().out


@pytest.mark.parametrize("enabled, stream", [(True, io.StringIO()), (False, FakeTerminal())])
def test_no_bar_in_a_log_file_nor_on_other_ranks(enabled, stream, capsys) -> None:
    bar = EpochBar(enabled, 10, stream=stream)
    bar.update(5)
    bar.write("a line")
    bar.close()
    assert stream.getvalue() == ""
    assert capsys.readouterr().out == "a line\n"


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_log_appends_csv_rows_across_runs(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    step = dict(step=1, epoch=0, batch=1, loss=2.3, lr=0.1, images_per_s=100.0, data_wait=0.05)
    epoch = dict(epoch=0, train_loss=2.0, val_top1=None, val_top5=None, val_loss=None,
                 data_wait=0.1, images_per_s=90.0, seconds=3.0)  # fmt: skip
    for run in range(2):  # a resumed run appends, the header stays single
        log = MetricsLog(tmp_path)
        assert not log.tensorboard
        log.step({**step, "step": run + 1})
        log.epoch(epoch)
        log.close()
    assert "pip install tensorboard" in caplog.text
    steps = _rows(tmp_path / "steps.csv")
    assert list(steps[0]) == list(STEP_FIELDS) and [r["step"] for r in steps] == ["1", "2"]
    epochs = _rows(tmp_path / "epochs.csv")
    assert list(epochs[0]) == list(EPOCH_FIELDS) and epochs[0]["val_top1"] == ""


def test_metrics_log_of_other_ranks_writes_nothing(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "logs", enabled=False)
    log.step(dict.fromkeys(STEP_FIELDS, 1))
    log.close()
    assert not (tmp_path / "logs").exists()


def test_an_older_epochs_csv_keeps_its_header_and_gets_aligned_rows(tmp_path: Path, caplog) -> None:
    """A run resumed into a --log-dir an older pipeline-train started (without the multi-label
    columns): its rows go under the old header, each value in its own column."""
    old = ["epoch", "train_loss", "val_top1", "val_top5", "val_loss", "data_wait",
           "images_per_s", "seconds"]  # fmt: skip
    (tmp_path / "epochs.csv").write_text(",".join(old) + "\n0,2.0,10.0,50.0,1.9,0.1,90.0,3.0\n")
    log = MetricsLog(tmp_path)
    log.epoch(dict(epoch=1, train_loss=1.5, val_top1=None, val_top5=None, val_loss=0.4,
                   val_map=61.0, val_f1_micro=50.0, val_f1_macro=40.0, data_wait=0.2,
                   images_per_s=80.0, seconds=4.0))  # fmt: skip
    log.close()
    rows = _rows(tmp_path / "epochs.csv")
    assert list(rows[1]) == old
    assert (rows[1]["val_loss"], rows[1]["data_wait"], rows[1]["seconds"]) == ("0.4", "0.2", "4.0")
    assert "without the columns val_map, val_f1_micro, val_f1_macro" in caplog.text
