"""join() beside process sets (run by tests/test_join_mpi.py at 3 and 4
ranks, with stall checks off, so that nothing but the coordinator's own
rules can end a wait)."""

import shutil
import time
import zlib

import numpy as np

from core_cases import assert_equal, shared_dir, wait_for_marks
from peers import join_with_a_mark, joins_marked, rank0_drops_cache_ids


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
    elif me == joiner:
        time.sleep(1.0)  # the others settle into waiting, their last cycles over
    last = hvd.join()  # (rank 2 of 4, in neither set, joins first)
    assert last in (0, 1), last  # the two that ran the sets' allreduces
    assert hvd.remove_process_set(tail) and hvd.remove_process_set(pair)


def case_adding_or_removing_a_set_while_a_rank_has_joined_fails_on_every_rank(hvd):
    """add_process_set and remove_process_set are called by every rank. While
    rank 1 has joined they fail on the others, naming it, and rank 1 gets
    the same error when it calls them after its join() returns; then the
    job goes on in step. They used to run without rank 1, whose own call
    later found the set already there (or gone): the ranks' programs parted."""
    from coordinator.errors import HorovodInternalError

    me = hvd.rank()

    def refused(fn, *args):
        try:
            fn(*args)
        except HorovodInternalError as exc:
            text = str(exc)
            assert "cannot run while rank 1 has joined" in text, text
            return text
        raise AssertionError(f"{fn.__name__} ran while rank 1 had joined")

    kept = hvd.add_process_set([0, 1])
    for step, (fn, arg) in enumerate([(hvd.add_process_set, [0, 2]),
                                      (hvd.remove_process_set, kept)]):
        if me == 1:
            hvd.join()
            text = refused(fn, arg)
        else:
            text = refused(fn, arg)
            hvd.join()
        digests = hvd.allgather(np.array([zlib.crc32(text.encode())], np.int64),
                                name=f"refusal.{step}")
        assert len(set(digests.tolist())) == 1, (text, digests)  # the same error everywhere
    added = hvd.add_process_set([0, 2])
    assert added.ranks == [0, 2] and kept.process_set_id is not None
    if me in (0, 1):
        out = hvd.allreduce(np.full(2, 1.0), op=hvd.Sum, name="kept.sum", process_set=kept)
        assert_equal(out, np.full(2, 2.0))
    assert hvd.remove_process_set(added) and hvd.remove_process_set(kept)


def case_a_sets_allreduce_submitted_with_the_last_join_gets_the_joined_members_zeros(hvd):
    """The last rank to join submits an allreduce of another set and joins at
    once. The set's request streams to rank 0 and the join goes in a round:
    rank 0 reads the stream first (the round's list says how many stream
    lists came before it), so the allreduce completes with the joined
    member's zeros. Read after the join, when every rank had joined and
    rank 0 had forgotten who had, it waited for the other member, which
    had gone on: random_join.py (SETS=1, seed 7, 3 ranks) hung 1 run in 4."""
    me, n = hvd.rank(), hvd.size()
    runner = n - 1
    tail = hvd.add_process_set([1, runner])
    marks = shared_dir(hvd, "streamed")
    for step in range(8):
        if me == runner:  # the others' joins first
            wait_for_marks(marks, joins_marked(step, range(n - 1)))
            handle = hvd.allreduce_async(np.full(3, step + 2.0), op=hvd.Sum,
                                         name=f"j.streamed.{step % 2}", process_set=tail)
            assert hvd.join() == runner
            assert_equal(hvd.synchronize(handle), np.full(3, step + 2.0))
        else:
            assert join_with_a_mark(hvd, marks, step) == runner
        hvd.barrier()
    assert hvd.remove_process_set(tail)
    if me == runner:
        shutil.rmtree(marks, ignore_errors=True)


def case_a_sets_allreduce_streamed_by_a_dropped_id_before_the_last_join_gets_the_zeros(hvd):
    """The last rank to join streams another set's cached allreduce and
    joins at once, and rank 0 has dropped the tensor's cache id by the time
    it reads the stream (here rank 0 drops the ids of that rank's lists
    just before reading them; in a job, other tensors evict it before the
    rank hears). Rank 0 asks for the request in full, and holds the join
    until it comes: the join completed in the round, and the allreduce,
    sent again after it, waited for a member that had gone on
    (random_join.py with a cache of one hung 2 jobs in 111)."""
    me, n = hvd.rank(), hvd.size()
    runner = n - 1
    tail = hvd.add_process_set([1, runner])
    if me in (1, runner):
        for _ in range(2):  # cached on both members
            hvd.allreduce(np.ones(3), op=hvd.Sum, name="j.dropped", process_set=tail)
    marks = shared_dir(hvd, "dropped")
    with rank0_drops_cache_ids(hvd, runner):
        for step in range(4):
            if me == runner:
                wait_for_marks(marks, joins_marked(step, range(n - 1)))
                handle = hvd.allreduce_async(np.full(3, step + 2.0), op=hvd.Sum,
                                             name="j.dropped", process_set=tail)
                assert hvd.join() == runner
                assert_equal(hvd.synchronize(handle), np.full(3, step + 2.0))
            else:
                assert join_with_a_mark(hvd, marks, step) == runner
            hvd.barrier()
    assert hvd.remove_process_set(tail)
    if me == runner:
        shutil.rmtree(marks, ignore_errors=True)
