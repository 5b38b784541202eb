"""`--log-format json`: one JSON object per log line, for servers run under a log collector.

Fluent Bit, Vector, Loki's promtail or a Kubernetes logging agent read a line as a record; a
JSON line keeps the level, logger and message as fields (no regex per deployment), and a
traceback stays inside its record instead of spilling over many lines. Fields: ``time``
(ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``, ``exception`` (the formatted
traceback, only when there is one).
"""

from __future__ import annotations

import json
import logging
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A `logging.Formatter` writing each record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


def formatter(kind: str) -> logging.Formatter:
    """The formatter of ``--log-format kind`` ("text" or "json")."""
    if kind == "json":
        return JsonFormatter()
    if kind == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"--log-format must be one of {list(LOG_FORMATS)}, got {kind!r}")
