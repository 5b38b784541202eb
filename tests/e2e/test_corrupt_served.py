"""Issue 20 end to end: a real server over good files and one-byte-damaged ones never serves a
damaged file's wrong pixels without counting it.

Two servers with the same seed and arguments serve the same list of paths: one over a folder
where some files are damaged (tests/corrupt_corpus.py, all rejected by the strict full decode),
one over the intact folder. Over val and train epochs the batch headers carry the sampler's
indices (a replaced slot keeps its index; the header's `replaced` count and the server's
`replaced_total` say how many were replaced), so: the slots whose pixels differ from the intact
server's are exactly as many as the server replaced, and every slot of a damaged file the
decoders refuse is among them. Damaged files without a restart layout are read whole by the
region path's verified tail, so each is counted bad and never served; restart-marked ones are
counted when a crop reads their damage, and otherwise serve exactly the intact pixels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from corrupt_corpus import corpus, seed_jpeg, strict_rejects
from loaderchecks import counted_batches
from serverproc import running_server

GOOD = 24


def write_lists(root: Path) -> tuple[Path, Path, set[int], set[int]]:
    """(damaged list, intact list, indices of damaged files without and with restarts)."""
    picked, seen_layouts = [], {}
    for f in corpus():
        if strict_rejects(f.data) is None or seen_layouts.get(f.layout, 0) >= 3:
            continue
        seen_layouts[f.layout] = seen_layouts.get(f.layout, 0) + 1
        picked.append(f)
    plain, marked = set(), set()
    lists = []
    for variant in ("damaged", "intact"):
        folder = root / variant
        folder.mkdir(parents=True)
        lines = []
        for k in range(GOOD):
            layout = ("base420", "prog420", "rst420", "base444")[k % 4]
            (folder / f"good{k:02d}.jpg").write_bytes(seed_jpeg(layout, 50 + k, 70, seed=k))
            lines.append(f"good{k:02d}.jpg {k % 3}")
        for j, f in enumerate(picked):
            index = len(lines)
            (folder / f"bad{j:02d}.jpg").write_bytes(f.data if variant == "damaged" else f.intact)
            lines.append(f"bad{j:02d}.jpg {j % 3}")
            (marked if f.layout.startswith("rst") else plain).add(index)
        listing = folder / "list.txt"
        listing.write_text("\n".join(lines) + "\n")
        lists.append(listing)
    return lists[0], lists[1], plain, marked


@pytest.mark.timeout(240)
def test_damaged_files_are_counted_and_replaced_never_served_wrong(tmp_path: Path) -> None:
    damaged, intact, plain, marked = write_lists(tmp_path)
    common = (
        *("--batch-size", "8", "--image-size", "32", "--output-dtype", "uint8"),
        *("--workers", "1", "--seed", "5", "--allow-outside-root"),
    )
    served = {}
    for name, listing in (("damaged", damaged), ("intact", intact)):
        with running_server("--train", str(listing), "--val", str(listing), *common) as srv:
            served[name] = {s: counted_batches(srv.endpoint, s, 3) for s in ("val", "train")}
            if name == "damaged":
                counters = srv.stats()["counters"]
    differing, plain_slots = 0, 0
    for split in ("val", "train"):
        for (bad_img, bad_idx), (ok_img, ok_idx) in zip(
            served["damaged"][split], served["intact"][split], strict=True
        ):
            assert bad_idx == ok_idx  # the same plan: a batch is a function of the seed
            for slot, i in enumerate(bad_idx):
                same = torch.equal(bad_img[slot], ok_img[slot])
                differing += not same
                if i in plain:
                    plain_slots += 1
                    assert not same, (split, i)  # refused, a substitute served instead
    print(
        f"{len(plain)} + {len(marked)} damaged (plain + restart-marked), {plain_slots} slots "
        f"of refused files, {differing} slots replaced, {counters}"
    )
    assert plain_slots > 0
    assert len(plain) <= counters["bad_total"] <= len(plain) + len(marked)
    assert counters["replaced_total"] == differing, counters
