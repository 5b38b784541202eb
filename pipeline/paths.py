"""Where batchwire keeps things it generates (dataset indexes, the embedded dataset, builds).

One folder for everything means one thing to delete and one variable to point elsewhere
(e.g. a fast local disk on a cluster node, or a temporary folder in tests).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "BATCHWIRE_CACHE"


def cache_dir() -> Path:
    """The cache folder, created on demand.

    `BATCHWIRE_CACHE` wins; else `$XDG_CACHE_HOME/batchwire`; else `~/.cache/batchwire`.
    Read on every call (not at import) so tests and tools can redirect it per process.
    """
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        root = base / "batchwire"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()
