"""join() beside process sets (run by tests/test_join_mpi.py at 3 and 4
ranks, with stall checks off, so that nothing but the coordinator's own
rules can end a wait)."""

import time

import numpy as np

from core_cases import assert_equal


def setup(hvd):
    hvd.init(process_sets="dynamic")


def case_a_join_reaches_another_sets_allreduce_while_no_rank_waits_on_the_global_set(hvd):
    """Rank n-1 joins at once. Rank 1 waits on an allreduce of the set
    {1, n-1}, which needs that join (the joined member takes part with
    zeros), and rank 0 on one of {0, 1}, which needs rank 1: no rank but
    the joined ones has global-set work, so none would take part in the
    cycle that carries the join. They used to wait until a watchdog ping
    (23 s with Horovod's stall settings; never with stall checks off, as
    here)."""
    me, n = hvd.rank(), hvd.size()
    joiner = n - 1
    pair = hvd.add_process_set([0, 1])
    tail = hvd.add_process_set([1, joiner])
    if me == 1:
        out = hvd.allreduce(np.full(2, 3.0), op=hvd.Sum, name="j.tail", process_set=tail)
        assert_equal(out, np.full(2, 3.0))  # the joined rank's zeros
        out = hvd.allreduce(np.full(2, 1.0), op=hvd.Average, name="j.pair", process_set=pair)
        assert_equal(out, np.full(2, 1.5))
    elif me == 0:
        out = hvd.allreduce(np.full(2, 2.0), op=hvd.Average, name="j.pair", process_set=pair)
        assert_equal(out, np.full(2, 1.5))
    else:
        time.sleep(1.0)  # the others settle into waiting, their last cycles over
    last = hvd.join()
    assert last in (0, 1), last  # the two that ran the sets' allreduces
    assert hvd.remove_process_set(tail) and hvd.remove_process_set(pair)
