"""The installed batchwire's version, and the ``--version`` flag of every console script.

It lives in `wire`, the layer every side imports (the monitor imports nothing else), and is read
from the installed distribution's metadata (pyproject's ``version``), so there is one number to
bump. Users spell it ``batchwire.__version__`` (src/batchwire/__init__.py reads it from here on
first access), ``from batchwire.common import __version__``, or the standard
``importlib.metadata.version("batchwire")``.
"""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__", "add_version_argument", "version_line"]


def _installed_version() -> str:
    try:
        return version("batchwire")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__: str = _installed_version()


def version_line(prog: str) -> str:
    """What ``--version`` prints: the command, batchwire's version and the protocol's."""
    from batchwire.wire.errors import PROTOCOL_VERSION

    return f"{prog} (batchwire {__version__}, wire protocol v{PROTOCOL_VERSION})"


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--version`` to ``parser`` (prints `version_line` and exits 0)."""
    parser.add_argument(
        "--version",
        action="version",
        version=version_line(parser.prog),
        help="print the version and exit",
    )
