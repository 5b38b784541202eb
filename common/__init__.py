"""batchwire.common: small tools shared by server, client, trainer, bench and tests.

They import nothing of batchwire but `batchwire.wire`, so every side can use them without
pulling in the server.

- `rates`: `RateMeter`, the one sliding-window sum and rate behind every "per second" and
  "data-wait" figure (server throughput and per-client rate, the loader's stats, the trainer's
  log lines);
- `launcher`: `PipelineServer`, a `pipeline-server` child process started, waited for until it
  answers a `stats` request, and stopped with SIGTERM (SIGKILL after a grace period), for
  tests, benchmarks and the demo;
- `devices`: the one parser of device strings (``cpu``, ``cuda``, ``cuda:N``) and of the
  launcher's environment integers.
- `cores`: `available_cores()`, the CPUs this process may use (affinity and cgroup quota), the
  one default for every thread count;
- `cuda_events`: `BufferFence` and `HandOff`, buffer reuse guarded by a CUDA event (record on the
  stream that last used the buffer; the next user's stream waits, or the host synchronises).

``__version__``: the installed batchwire's version (`batchwire.wire.version`), also
``batchwire.__version__``.
"""

from batchwire.wire.version import installed_version

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, read lazily (PEP 562), as `batchwire.wire.version` reads it."""
    if name == "__version__":
        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
