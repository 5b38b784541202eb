"""Several training jobs run at once against one server, as the batch-sharing tests need them."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_jobs(jobs: list[Callable[[], list[str]]]) -> list[list[str]]:
    """Start the jobs together (threads) and return each one's stream."""
    results: list[list[str] | BaseException] = [[] for _ in jobs]

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # re-raised below, in the test thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]
