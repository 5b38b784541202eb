"""Fixtures shared by test files (helpers that are not fixtures live in their own modules)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A private zmq context, destroyed with linger 0 so a stuck socket cannot hang the test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
