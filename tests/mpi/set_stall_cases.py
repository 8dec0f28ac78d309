"""Stalls in a process set of two of three ranks, under
HOROVOD_STALL_CHECK_TIME_SECONDS=1 and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3
(set by tests/test_lifecycle_mpi.py). A set other than the global one is
negotiated outside the rounds, and a member that submits an operation after
it failed owes it there: it gets the error the others got, at once, and
stays in step with them.

Ranks wait for each other's marks (peers.leave_mark) where they used to
sleep past a time: a loaded machine may run any of them seconds late."""

import numpy as np

from core_cases import assert_equal, shared_dir, wait_for_marks
from peers import leave_mark

PAIR = None  # ranks 0 and 1


def setup(hvd):
    global PAIR
    PAIR = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[PAIR])


def tensors_of(step, rank):
    return [np.full(2, step + rank + 1.0), np.full(3, 10.0 * step + rank)]


def case_a_stalled_group_fails_on_both_members_and_the_late_one_stays_in_step(hvd):
    """Rank 1 is late with the second of three grouped allreduces: it fails
    on rank 0 after the shutdown time, and on rank 1 as soon as it submits
    it; the third runs on both, with both ranks' third tensors. (Rank 0's
    third used to fail at once with the second's error.)"""
    me = hvd.rank()
    marks = shared_dir(hvd, "set-stall")
    if me not in PAIR.ranks:
        # Sits out the late step, so that the barrier after the case, which
        # it would reach first, is not a stall of its own.
        wait_for_marks(marks, ["done.0", "done.1"], remove=True)
        return
    try:
        _steps_of_the_pair(hvd, me, marks)
    finally:
        leave_mark(marks, f"done.{me}")  # (failed or not: rank 2 need not wait for long)


def _steps_of_the_pair(hvd, me, marks):
    for step in range(3):
        if step == 1 and me == 1:
            # Past the shutdown time: its group failed without it.
            wait_for_marks(marks, ["stalled.0"])
        try:
            got = hvd.grouped_allreduce(tensors_of(step, me), op=hvd.Sum, name="pg",
                                        process_set=PAIR)
        except hvd.StallError as exc:
            assert step == 1, (step, exc)
            text = str(exc)
            # On rank 1 too, which owes it: answered at once with the others'
            # error (a copy negotiated anew would have waited for rank 0's,
            # and met its next one).
            assert "rank 1 did not submit it" in text and "pg" in text, text
            if me == 0:
                leave_mark(marks, "stalled.0")
            continue
        assert step != 1, got
        for out, parts in zip(got, zip(*(tensors_of(step, r) for r in PAIR.ranks))):
            assert_equal(out, sum(parts))
