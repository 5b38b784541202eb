"""batchwire.train: `pipeline-train`, the reference DDP loop that trains from pipeline-server.

    torchrun --nproc_per_node=8 --no-python pipeline-train --server tcp://127.0.0.1:5555 ...
    python -m batchwire.train.demo      # the embedded dataset, 2 CPU ranks, a few minutes

Programmatic use: `batchwire.train.cli.run(TrainConfig(...))` returns one `EpochResult` per
epoch. The names below are imported on first access (PEP 562), so importing the package, or
its torch-free `config` and `cli` modules, does not import torch: `pipeline-train --help` and a
mistyped flag answer at once. (The CLI module is not imported here, so
`python -m batchwire.train.cli` runs cleanly.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchwire.train.config import ConfigError, TrainConfig
    from batchwire.train.loop import EpochResult, Trainer
    from batchwire.train.models import build_model

#: Each public name and the module that defines it.
_HOMES = {
    "ConfigError": "batchwire.train.config",
    "TrainConfig": "batchwire.train.config",
    "EpochResult": "batchwire.train.loop",
    "Trainer": "batchwire.train.loop",
    "build_model": "batchwire.train.models",
}

__all__ = ["ConfigError", "EpochResult", "TrainConfig", "Trainer", "build_model"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
