"""What a server's log says about how it augments and which epoch a client asked for.

One small server: the train split through a user transform (--transform), the val split
through the built-in recipe (the native fused op).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from batchwire.client import RemoteLoader
from serverproc import running_server, small_server_args

USER = Path(__file__).resolve().parent / "test_transforms_user.py"
TRANSFORM = f"{USER}:rrc32"


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=3, val=True), "--transform", TRANSFORM) as srv:
        yield srv


def test_the_log_names_the_user_transform_not_the_fused_op(server) -> None:
    log = server.log()
    assert (
        f"train: augmenting with the user transform {TRANSFORM} "
        "(the native fused op is not used for train)" in log
    ), log
    # The val split has no transform: no line claims one for it, and the fused op's own line
    # does not claim to augment (it would read as if it augmented the train split too).
    assert "val: augmenting with the user transform" not in log, log
    assert "with the native fused op" not in log, log


def test_the_hello_line_says_the_epoch_the_client_asked_for(server) -> None:
    with RemoteLoader(server.endpoint, "train", device="cpu", timeout=60.0) as loader:
        loader.set_epoch(7)
        next(iter(loader))
    epochs = {int(e) for e in re.findall(r"client \w+: train epoch (\d+) rank 0/1", server.log())}
    assert 7 in epochs and epochs <= {7, 8}, server.log()  # 8: the next epoch, asked ahead
