"""Deadlocks: every rank waits on a tensor another rank never submitted.
Horovod's defaults (no stall shutdown time, a 60 s stall check time), with
COORDINATOR_DEADLOCK_SECONDS=2, and again with stall checks disabled (set
by tests/test_lifecycle_mpi.py)."""

import threading
import time

import numpy as np

from core_cases import assert_equal, expect_raises, shared_dir, wait_for_marks
from peers import leave_mark


def setup(hvd):
    hvd.init(process_sets="dynamic")


def case_ranks_waiting_on_each_other_fail_naming_every_wait(hvd):
    """Rank 0 waits on 'a', which the others never submit; they wait on 'b',
    which rank 0 never submits: each gets a DeadlockError (a StallError) naming its own wait
    and the others' (the job used to wait, and warn, for ever), and the job
    goes on."""
    n = hvd.size()
    mine, theirs = ("a", "b") if hvd.rank() == 0 else ("b", "a")
    start = time.monotonic()
    exc = expect_raises(hvd.DeadlockError, hvd.allreduce, np.ones(2), name=mine)
    waited = time.monotonic() - start
    text = str(exc)
    assert text.startswith(f"Deadlocked allreduce of tensor '{mine}'"), text
    assert f"the others wait on: allreduce of tensor '{theirs}'" in text, text
    assert "(COORDINATOR_DEADLOCK_SECONDS)" in text, text
    missing = "ranks 1, 2" if n == 3 else "rank 1"
    assert (f"{missing} did not submit it" if mine == "a" else "rank 0 did not submit it") \
        in text, text
    assert 1.5 <= waited < 30, waited
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.deadlock"),
                 np.full(2, float(n)))


def case_a_deadlock_on_cached_tensors_is_seen_as_soon(hvd):
    """Tensors every rank has run before wait in the response cache's
    slots, which rank 0's controller sees only once they are reported:
    after half the stall check time (30 s), or never with stall checks
    disabled. They are reported in time for the deadlock check (it took
    30 s, and for ever with checks disabled)."""
    for step in range(3):
        hvd.allreduce(np.ones(2), name="cached.c")
        hvd.allreduce(np.ones(2), name="cached.d")
    mine = "cached.c" if hvd.rank() == 0 else "cached.d"
    start = time.monotonic()
    exc = expect_raises(hvd.DeadlockError, hvd.allreduce, np.ones(2), name=mine)
    assert str(exc).startswith(f"Deadlocked allreduce of tensor '{mine}'"), str(exc)
    assert time.monotonic() - start < 15, time.monotonic() - start


def case_a_rank_busy_between_submissions_is_not_a_deadlock(hvd):
    """The last rank computes for twice the deadlock time before it submits
    (it has submitted before): the others wait, and nothing fails."""
    n = hvd.size()
    hvd.allreduce(np.ones(1), name="busy.warm")
    if hvd.rank() == n - 1:
        time.sleep(4.5)
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="busy.late"),
                 np.full(2, float(n)))


def case_a_thread_that_will_submit_is_not_a_deadlock(hvd):
    """Rank 0's main thread waits on 'x' and the others' on 'y' first, which
    rank 0 submits from a second thread (one that submitted before) only
    after twice the deadlock time: rank 0 is not all blocked, so nothing
    fails, and both complete."""
    n = hvd.size()
    got = {}

    def second():
        got["warm"] = hvd.allreduce(np.ones(1), op=hvd.Sum, name="thread.warm")
        time.sleep(4.5)
        got["y"] = hvd.allreduce(np.ones(2), op=hvd.Sum, name="thread.y")

    if hvd.rank() == 0:
        worker = threading.Thread(target=second)
        worker.start()
        x = hvd.allreduce(np.ones(2), op=hvd.Sum, name="thread.x")
        worker.join()
    else:
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="thread.warm")
        got["y"] = hvd.allreduce(np.ones(2), op=hvd.Sum, name="thread.y")
        x = hvd.allreduce(np.ones(2), op=hvd.Sum, name="thread.x")
    assert_equal(x, np.full(2, float(n)))
    assert_equal(got["y"], np.full(2, float(n)))


def case_two_ranks_deadlocked_in_a_set_fail_while_the_others_train_on(hvd):
    """Ranks 0 and 1 wait on each other in the set [0, 1] while the other
    ranks compute (they are not blocked, and need not be): the pair's
    operations fail after the deadlock time, naming both waits."""
    n = hvd.size()
    if n < 3:
        return
    pair = hvd.add_process_set([0, 1])
    marks = shared_dir(hvd, "pair-deadlock")
    me = hvd.rank()
    if me in (0, 1):
        mine, theirs = ("x", "y") if me == 0 else ("y", "x")
        try:
            exc = expect_raises(hvd.DeadlockError, hvd.allreduce, np.ones(2), name=mine,
                                process_set=pair)
        finally:
            leave_mark(marks, f"failed.{me}")
        text = str(exc)
        assert text.startswith(f"Deadlocked allreduce of tensor '{mine}' in process set "
                               f"{pair.process_set_id}"), text
        assert "ranks 0, 1 have been waiting" in text, text
        assert f"the others wait on: allreduce of tensor '{theirs}'" in text, text
    else:
        # Training on (not blocked) until the pair has failed, not for a
        # time: blocked in the barrier below any earlier, it would be a
        # third party to their wait on a loaded machine.
        wait_for_marks(marks, [f"failed.{r}" for r in range(2)], remove=True)
    hvd.barrier()
    assert hvd.remove_process_set(pair)
