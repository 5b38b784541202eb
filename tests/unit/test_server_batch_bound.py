"""A server whose largest batch is past what every client accepts (`wire.MAX_BATCH_NBYTES`,
16 GiB: a hostile server's welcome must not make a loader allocate what it claims) stops at
start with exit 2 naming the settings, instead of starting and having each trainer's welcome
refused."""

from __future__ import annotations

import pytest
from batchwire.server.cli import parse_config


@pytest.mark.parametrize(
    "flags",
    [
        ["--batch-size", "4096", "--image-size", "1024", "--output-dtype", "float32"],
        ["--batch-size", "256", "--max-batch-size", "8192", "--image-size", "512",
         "--output-dtype", "float32"],
    ],
)  # fmt: skip
def test_a_batch_no_client_accepts_stops_the_start(flags: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "16 GiB" in err and "--batch-size" in err, err


def test_a_large_batch_clients_accept_still_starts() -> None:
    """256 x 3 x 512^2 float32 (805 MB): a big batch, far from the bound."""
    config = parse_config(
        ["--batch-size", "256", "--image-size", "512", "--output-dtype", "float32"]
    )
    assert config.capacity_spec().nbytes < 16 << 30
