"""`checkpoint_on_usr1`: SIGUSR1 sets the request while the block runs, and only then; the
handler that was there before comes back after it. (The loop's use of it, with real servers and
ranks: tests/e2e/test_train_preemption.py.)"""

from __future__ import annotations

import os
import signal
import threading

from batchwire.train.preemption import checkpoint_on_usr1


def test_usr1_sets_the_request_and_the_previous_handler_comes_back() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        with checkpoint_on_usr1(True) as request:
            assert request is not None and not request.requested
            os.kill(os.getpid(), signal.SIGUSR1)
            assert request.requested and seen == []
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_without_a_checkpoint_folder_there_is_no_request_and_usr1_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with checkpoint_on_usr1(False) as request:
        assert request is None
        assert signal.getsignal(signal.SIGUSR1) is before


def test_outside_the_main_thread_the_request_exists_but_no_handler_is_installed(caplog) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    got = []

    def body() -> None:
        with checkpoint_on_usr1(True) as request:
            got.append(request)
            got.append(signal.getsignal(signal.SIGUSR1))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    request, handler = got
    assert request is not None and not request.requested  # the ranks still vote alike
    assert handler is before
    assert "not the main thread: SIGUSR1 cannot request a checkpoint" in caplog.text
