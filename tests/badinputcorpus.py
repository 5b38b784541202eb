"""A folder of good files and every kind of bad input a list file can name: corrupt JPEGs,
FIFOs (and links to one), a folder, /dev/null. Shared by the bad-input tests of the sample
loaders (test_bad_input_samples) and of the server (test_bad_input_server)."""

from __future__ import annotations

import os
from pathlib import Path

from oddfiles import CORRUPT_KINDS, jpeg_bytes, odd_file_bytes, smooth_image

GOOD = 12


def write_corpus(folder: Path) -> tuple[Path, set[str]]:
    """A list file over good and bad files; returns it and the bad files' paths as listed."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, bad = [], set()
    for k in range(GOOD):
        name = f"good{k:02d}.jpg"
        (folder / name).write_bytes(jpeg_bytes(smooth_image(60 + 4 * k, 80, seed=k)))
        lines.append(f"{name} {k % 3}")
    os.symlink(folder / "good00.jpg", folder / "link_to_good.jpg")
    lines.append("link_to_good.jpg 0")
    for i, kind in enumerate(CORRUPT_KINDS):
        name = f"{kind}.jpg"
        (folder / name).write_bytes(odd_file_bytes(kind, height=120, width=160, seed=i))
        lines.append(f"{name} 1")
        bad.add(str(folder / name))
    os.mkfifo(folder / "pipe.jpg")
    os.symlink(folder / "pipe.jpg", folder / "link_to_pipe.jpg")
    (folder / "folder.jpg").mkdir()
    lines += ["pipe.jpg 2", "link_to_pipe.jpg 2", "folder.jpg 0", "/dev/null 1", "pipe.jpg 0"]
    bad |= {str(folder / n) for n in ("pipe.jpg", "link_to_pipe.jpg", "folder.jpg")}
    bad.add("/dev/null")
    listing = folder / "list.txt"
    listing.write_text("\n".join(lines) + "\n")
    return listing, bad
