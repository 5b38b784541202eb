"""batchwire: a standalone data pipeline for GPU training.

The code lives in the repository's top-level folders, installed as subpackages of this one:
`batchwire.pipeline` (datasets, decode, augment), `batchwire.server` (``pipeline-server``),
`batchwire.client` (`RemoteLoader`), `batchwire.native` (the C++/CUDA op), `batchwire.wire` (the
protocol) and the tools (`train`, `monitor`, `bench`, `prepare`, `common`).

This module only carries ``__version__``, read lazily (PEP 562) so that ``import
batchwire.client`` costs nothing here; its one source is the installed distribution's metadata
(`batchwire.wire.version`).
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name == "__version__":
        from batchwire.wire.version import __version__

        return __version__
    raise AttributeError(f"module 'batchwire' has no attribute {name!r}")
