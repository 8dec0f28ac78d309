"""add_process_set / remove_process_set at run time."""

import numpy as np

from core_cases import assert_equal, expect_raises


def setup(hvd):
    hvd.init(process_sets="dynamic")


def case_add_use_and_remove_a_set(hvd):
    me, n = hvd.rank(), hvd.size()
    tail = hvd.add_process_set(hvd.ProcessSet(range(1, n)))
    assert tail.process_set_id is not None and tail.ranks == list(range(1, n))
    if me >= 1:
        out = hvd.allreduce(np.full(2, float(me)), op=hvd.Sum, name="tail.sum",
                            process_set=tail)
        assert_equal(out, np.full(2, float(sum(range(1, n)))))
    hvd.barrier()
    assert hvd.remove_process_set(tail) is True
    assert tail.process_set_id is None
    assert hvd.remove_process_set(tail) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False


def case_add_from_a_list_and_duplicates_fail(hvd):
    ps = hvd.add_process_set([0])
    assert ps.ranks == [0]
    exc = expect_raises(ValueError, hvd.add_process_set, [0])
    assert "already exists" in str(exc)
    if hvd.rank() == 0:
        assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="solo", process_set=ps),
                     np.ones(1))
    hvd.barrier()
    assert hvd.remove_process_set(ps)


def case_a_tensor_waiting_on_a_removed_set_fails_naming_the_set(hvd):
    """Rank 1 submits to a set whose other member never does; the set is
    removed meanwhile: rank 1's tensor fails, naming the set and itself,
    instead of waiting forever. (A set of two that is not the global set:
    3 ranks or more.)"""
    from coordinator.errors import HorovodInternalError

    me, n = hvd.rank(), hvd.size()
    if n < 3:
        return
    pair = hvd.add_process_set([1, 2])
    pid = pair.process_set_id
    handle = None
    if me == 1:
        handle = hvd.allreduce_async(np.ones(2), name="orphan", process_set=pair)
    hvd.barrier()
    assert hvd.remove_process_set(pair)
    if me == 1:
        exc = expect_raises(HorovodInternalError, hvd.synchronize, handle)
        # Rank 0 removes the set, or learns of the tensor after removing it:
        # "process set 3 was removed before allreduce of tensor 'orphan'
        # could run", or "allreduce of tensor 'orphan' names process set 3,
        # which is not registered (was it removed?)".
        text = str(exc)
        assert f"process set {pid}" in text and "'orphan'" in text and "removed" in text, text
    hvd.barrier()


def case_a_set_does_not_outlive_shutdown_and_the_same_object_can_be_added_again(hvd):
    """shutdown() releases every set: a ProcessSet kept across it has no id
    (it used to keep its old one, so add_process_set refused it as already
    registered), using it says it was removed at the shutdown, and after
    init() the same object is added again."""
    ps = hvd.add_process_set([0])
    hvd.shutdown()
    assert ps.process_set_id is None and ps.ranks == [0] and ps.size() is None
    hvd.init(process_sets="dynamic")
    if hvd.rank() == 0:
        exc = expect_raises(ValueError, hvd.allreduce, np.ones(1), name="stale",
                            process_set=ps)
        assert "removed when the coordinator shut down" in str(exc), exc
    assert hvd.add_process_set(ps) is ps and ps.process_set_id is not None
    if hvd.rank() == 0:
        assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="again", process_set=ps),
                     np.ones(1))
    hvd.barrier()
    assert hvd.remove_process_set(ps)


def case_shutdown_waits_for_a_communicator_still_being_made(hvd):
    """A set's communicators are made in helper threads as it is registered;
    one still inside MPI_Comm_create_group when the process finalizes MPI
    crashed it (SIGSEGV with sets added just before the end). shutdown()
    waits for them first: here for one this rank makes slowly."""
    import threading

    from coordinator.ops.mpi_ops import Making

    release = threading.Event()
    Making(lambda: release.wait(30))
    done = threading.Event()
    threading.Thread(target=lambda: (hvd.shutdown(), done.set()), daemon=True).start()
    assert not done.wait(1.0), "shutdown() returned with a communicator still being made"
    release.set()
    assert done.wait(30), "shutdown() did not return once the communicator was made"
    hvd.init(process_sets="dynamic")
    ps = hvd.add_process_set(list(range(hvd.size())[::-1][:1]))  # made as it is added
    hvd.shutdown()  # right away: waits for it
    hvd.init(process_sets="dynamic")
    assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.settle"),
                 np.full(1, float(hvd.size())))
    del ps


def case_ranks_asking_for_different_sets_all_hear_so_at_once(hvd):
    # Named after the ranks asked for, two lists never met: the other ranks
    # waited until DeadlockError, and so did the next add.
    me, n = hvd.rank(), hvd.size()
    ranks = [0] if me == 0 else [n - 1]
    exc = expect_raises(hvd.HorovodInternalError, hvd.add_process_set, ranks)
    assert "Mismatched ranks for add_process_set" in str(exc), str(exc)
    assert "rank 0 sent ranks [0]" in str(exc), str(exc)
    bad = [0, n + 3] if me == 0 else [0]
    if me == 0:
        exc = expect_raises(ValueError, hvd.add_process_set, bad)
        assert f"ranks [0, {n + 3}] are not valid" in str(exc), str(exc)
    else:
        exc = expect_raises(hvd.HorovodInternalError, hvd.add_process_set, bad)
        assert "rank 0 rejected add_process_set" in str(exc), str(exc)
    ps = hvd.add_process_set([n - 1])  # the job goes on, and adds again
    if me == n - 1:
        assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="last", process_set=ps),
                     np.ones(1))
    if me == 1:
        assert hvd.remove_process_set(hvd.global_process_set) is False
    else:
        exc = expect_raises(hvd.HorovodInternalError, hvd.remove_process_set, ps)
        assert "rank 1 rejected remove_process_set" in str(exc), str(exc)
    assert hvd.remove_process_set(ps)


def case_removing_a_set_lets_its_operations_in_flight_finish(hvd):
    """remove_process_set while the set's large allreduces are still running
    (submitted, not waited for): they finish with the right sums, and the
    set's communicator is freed only after them. (It was freed at once, under
    them: MPI_ERR_COMM on one member and a hang, or a crash, on the other.)"""
    me, n = hvd.rank(), hvd.size()
    if n < 3:  # (a set of two that is not the global set)
        return
    count = 1 << 21
    for step in range(4):
        ps = hvd.add_process_set([0, n - 1])
        ranks = ps.ranks
        handles = []
        if me in ranks:
            handles = [hvd.allreduce_async(np.full(count, float(me + i + step)), op=hvd.Sum,
                                           name=f"big.{step}.{i}", process_set=ps)
                       for i in range(3)]
        assert hvd.remove_process_set(ps)
        for i, handle in enumerate(handles):
            out = hvd.synchronize(handle)
            want = float(sum(r + i + step for r in ranks))
            assert out.shape == (count,) and (out == want).all(), (step, i, out[:4], want)
    hvd.barrier()
