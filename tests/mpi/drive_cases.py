"""A thread blocked in a collective runs the coordinator's loop itself while
the background thread sleeps (Background.drive). Run by tests/test_drive_mpi.py
with driving on (the default) and off (COORDINATOR_DRIVE_SECONDS=0), and,
one case per job, with a driven turn that fails (DRIVE_FAILS)."""

import os
import threading

import numpy as np

from core_cases import expect_raises

DRIVING = float(os.environ.get("COORDINATOR_DRIVE_SECONDS", "1")) > 0
TAKES = []  # (thread ident, entry names) of every Background._take


def setup(hvd):
    from coordinator import background

    take = background.Background._take

    def recorded(self, entries):
        TAKES.append((threading.get_ident(), [e.name for e in entries]))
        return take(self, entries)
    background.Background._take = recorded
    hvd.init()


def _taken_here(names):
    me = threading.get_ident()
    return sum(1 for thread, taken in TAKES if thread == me and set(taken) & names)


def case_blocking_collectives_are_taken_by_the_thread_that_waits(hvd):
    n, me = hvd.size(), hvd.rank()
    names = set()
    for step in range(60):
        small = hvd.allreduce(np.array([me + step], np.float32), name="drive.small", op=hvd.Sum)
        big = hvd.allreduce(np.full(5000, me + 1.0), name="drive.big")  # an MPI collective
        gathered = hvd.allgather(np.full((me + 1, 2), step, np.int32), name="drive.gather")
        names |= {"drive.small", "drive.big", "drive.gather"}
        assert small[0] == sum(r + step for r in range(n)), small
        assert np.all(big == (n + 1) / 2), big[:3]
        assert gathered.shape == (n * (n + 1) // 2, 2) and np.all(gathered == step)
    taken = _taken_here(names)
    if DRIVING:
        # Most are; one the background thread was still busy with is not.
        assert taken >= 60, f"{taken} of 180 submissions taken on the waiting thread"
    else:
        assert taken == 0, taken


def case_asynchronous_submissions_are_left_to_the_background_thread(hvd):
    n, me = hvd.size(), hvd.rank()
    handles = [hvd.allreduce_async(np.array([me, k], np.float64), name=f"async.{k}",
                                   op=hvd.Sum) for k in range(20)]
    for k, handle in enumerate(handles):
        out = hvd.synchronize(handle)
        assert out.tolist() == [n * (n - 1) / 2, n * k], out
    assert _taken_here({f"async.{k}" for k in range(20)}) == 0


def case_other_threads_blocked_in_collectives_meanwhile_get_right_results(hvd):
    """Two threads at once: one drives, the other waits for the background
    thread (or drives after it); names are per thread, every result exact."""
    n, me = hvd.size(), hvd.rank()
    errors = []

    def work(tag):
        try:
            for step in range(40):
                out = hvd.allreduce(np.array([me * step, tag], np.int64),
                                    name=f"thread{tag}", op=hvd.Sum)
                assert out.tolist() == [step * n * (n - 1) // 2, n * tag], out
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def case_a_failing_driven_turn_stops_the_coordinator_with_its_error(hvd):
    """Only in its own job (DRIVE_FAILS=error|interrupt): the first turn a
    frontend thread drives raises; the caller sees the coordinator stop
    with that error (or gets its KeyboardInterrupt), as if the background
    thread had failed, and later calls say the coordinator stopped."""
    from coordinator import background

    mode = os.environ.get("DRIVE_FAILS")
    if mode is None:
        return
    main = threading.get_ident()
    turn = background.Background._turn
    failing = {"left": 1}

    def flaky(self):
        if threading.get_ident() == main and failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("boom in a driven turn") if mode == "error" else \
                KeyboardInterrupt()
        return turn(self)
    background.Background._turn = flaky
    try:
        # A call drives only when the background thread is not in a turn of
        # its own (a timer's, on a loaded machine): those calls complete as
        # usual, so call until one has driven.
        for _ in range(200):
            try:
                hvd.allreduce(np.ones(1), name="fails")
            except (Exception, KeyboardInterrupt) as caught:
                exc = caught
                break
        else:
            raise AssertionError("no allreduce of 200 drove a turn")
        assert not failing["left"]
        if mode == "error":
            assert "boom in a driven turn" in str(exc), repr(exc)
        else:
            assert isinstance(exc, KeyboardInterrupt), repr(exc)
        later = expect_raises(Exception, hvd.allreduce, np.ones(1), name="later")
        want = "boom in a driven turn" if mode == "error" else "was interrupted"
        assert want in str(later), repr(later)
    finally:
        background.Background._turn = turn
