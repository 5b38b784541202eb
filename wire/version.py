"""The installed batchwire's version, and the ``--version`` flag of every console script.

It lives in `wire`, the layer every side imports (the monitor imports nothing else), and is read
from the installed distribution's metadata (pyproject's ``version``), so there is one number to
bump. Users spell it ``batchwire.__version__`` (src/batchwire/__init__.py reads it from here on
first access), ``from batchwire.common import __version__``, or the standard
``importlib.metadata.version("batchwire")``.
"""

from __future__ import annotations

import argparse
import functools
from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__", "add_version_argument", "installed_version", "version_line"]


@functools.cache
def installed_version() -> str:
    """batchwire's version from its distribution's metadata, read at first use (not at
    import: the metadata is a file found on sys.path, which a process may still change)."""
    try:
        return version("batchwire")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__: str  # declared for readers and linters; `__getattr__` gives it


def __getattr__(name: str) -> str:
    """``__version__``, read lazily (PEP 562)."""
    if name == "__version__":
        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def version_line(prog: str) -> str:
    """What ``--version`` prints: the command, batchwire's version and the protocol's."""
    from batchwire.wire.errors import PROTOCOL_VERSION

    return f"{prog} (batchwire {installed_version()}, wire protocol v{PROTOCOL_VERSION})"


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--version`` to ``parser`` (prints `version_line` and exits 0)."""
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(parser.prog),
        help="print the version and exit",
    )
