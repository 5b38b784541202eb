"""Prometheus exposition text as a dict, for tests of `/metrics` (live and in-process)."""

from __future__ import annotations


def parse_metrics(text: str) -> dict[str, float]:
    """Exposition text -> {'name{labels}': value} (comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
