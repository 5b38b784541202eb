"""Reading an encoded image file: the one place the pipeline turns a path into bytes.

Kept apart so that how files are read (buffered today; direct I/O or a cache later) is changed in
one function, not at every caller. Errors are not translated: an OSError reaches the sample
loader, which counts the file as unreadable and replaces it.
"""

from __future__ import annotations

import os


def read_file(path: str | os.PathLike[str]) -> bytes:
    """The whole contents of `path` (OSError propagates)."""
    with open(path, "rb") as f:
        return f.read()
