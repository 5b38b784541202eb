"""batchwire.train: `pipeline-train`, the reference DDP loop that trains from pipeline-server.

    torchrun --nproc_per_node=8 --no-python pipeline-train --server tcp://127.0.0.1:5555 ...
    python -m batchwire.train.demo      # the embedded dataset, 2 CPU ranks, a few minutes

Programmatic use: `batchwire.train.cli.run(TrainConfig(...))` returns one `EpochResult` per
epoch. (The CLI module is not imported here, so `python -m batchwire.train.cli` runs cleanly.)
"""

from batchwire.train.config import ConfigError, TrainConfig
from batchwire.train.loop import EpochResult, Trainer
from batchwire.train.models import build_model

__all__ = ["ConfigError", "EpochResult", "TrainConfig", "Trainer", "build_model"]
