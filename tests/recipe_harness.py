"""Run one of examples/*.py as written, recording every batch its RemoteLoaders hand out.

    BATCHWIRE_RECIPE=examples/lightning_ddp.py RECORD_DIR=out python recipe_harness.py --server ...

The recipe's own arguments follow; the harness stays ``sys.argv[0]`` so that launchers that
re-run the script per rank (Lightning's DDP) run it again. Before the recipe imports it,
``batchwire.client.RemoteLoader`` becomes a subclass that asks the real loader for indices, writes
``(split, epoch, batch, indices)`` of each batch to ``RECORD_DIR/<split>-rank<r>-<pid>.jsonl``
and yields what the recipe expects, ``(images, labels)``.

Once the recipe has run to its end, the harness leaves with ``os._exit`` instead of a normal
interpreter shutdown. torch 2.13 keeps a gloo process group alive after
``destroy_process_group()`` once DDP has wrapped a model (its worker threads are still running at
exit), and a gloo thread that releases the last collective's tensor after the interpreter began
finalizing takes the GIL, is ended by CPython and aborts the rank ("terminate called without an
active exception", SIGABRT). That happens after the recipe's last line, on an overloaded host
(seen twice in CI), and is torch's teardown, not ours; everything the tests check is on disk by
then (each record line is written and closed, checkpoints are renamed into place).
"""

from __future__ import annotations

import json
import os
import sys

import batchwire.client
from batchwire.client import RemoteLoader


class RecordingLoader(RemoteLoader):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["with_indices"] = True
        super().__init__(*args, **kwargs)

    def __iter__(self):
        batches = super().__iter__()
        record_dir = os.environ["RECORD_DIR"]

        def recorded():
            for images, labels, indices in batches:
                path = os.path.join(record_dir, f"{self.split}-rank{self.rank}-{os.getpid()}.jsonl")
                row = {"epoch": self.epoch, "batch": self.next_batch - 1, "idx": indices.tolist()}
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                yield images, labels

        return recorded()


batchwire.client.RemoteLoader = RecordingLoader  # type: ignore[misc]
# Not runpy.run_path: it would point sys.argv[0] at the recipe, and launchers re-run argv[0].
recipe = os.environ["BATCHWIRE_RECIPE"]
with open(recipe) as f:
    code = compile(f.read(), recipe, "exec")
exec(code, {"__name__": "__main__", "__file__": recipe})
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
