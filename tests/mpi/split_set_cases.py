"""Process sets built as Horovod's documentation shows, from a split
communicator: every rank passes `ProcessSet(comm)` with a communicator that
holds only its own group (run by tests/test_process_sets_mpi.py). Names are
per process set, as in Horovod: the same name in two sets is two tensors."""

import numpy as np

from core_cases import assert_equal

SPLIT = None  # this rank's set: the ranks of its parity
EVEN = ODD = None  # the same sets given by ranks, to a second init


def setup(hvd):
    global SPLIT
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)
    SPLIT = hvd.ProcessSet(sub)
    hvd.init(process_sets=[SPLIT])


def _parity(hvd):
    return [r for r in range(hvd.size()) if r % 2 == hvd.rank() % 2]


def case_a_split_communicator_set_holds_every_rank_of_its_group(hvd):
    from coordinator import runtime

    mine = _parity(hvd)
    assert SPLIT.ranks == mine, SPLIT
    assert SPLIT.size() == len(mine) and SPLIT.rank() == mine.index(hvd.rank())
    assert SPLIT.process_set_id == (1 if hvd.rank() % 2 == 0 else 2)
    # Every rank knows both groups, with the same ids.
    registered = runtime.current().process_sets.all()
    groups = {pid: ps.ranks for pid, ps in registered.items()}
    evens = [r for r in range(hvd.size()) if r % 2 == 0]
    odds = [r for r in range(hvd.size()) if r % 2 == 1]
    assert groups[1] == evens and (hvd.size() < 2 or groups[2] == odds), groups


def case_split_sets_reduce_their_own_group(hvd):
    mine = _parity(hvd)
    for step in range(5):
        out = hvd.allreduce(np.full(3, hvd.rank() + step, np.float64), op=hvd.Sum,
                            name="w", process_set=SPLIT)
        assert_equal(out, np.full(3, float(sum(r + step for r in mine))), f"step {step}")
        avg = hvd.allreduce(np.full(2, float(hvd.rank())), process_set=SPLIT)  # unnamed
        assert_equal(avg, np.full(2, sum(mine) / len(mine)))


def case_same_name_in_two_sets_and_the_global_set_never_collides(hvd):
    """A name used on a subset and on the global set, in every order, async."""
    n, me = hvd.size(), hvd.rank()
    mine = _parity(hvd)
    for step in range(9):
        handles = []
        if step % 2:
            handles.append(("g", hvd.allreduce_async(np.full(2, me + step, np.float32),
                                                     op=hvd.Sum, name="x")))
            handles.append(("s", hvd.allreduce_async(np.full(2, me * step, np.float32),
                                                     op=hvd.Sum, name="x",
                                                     process_set=SPLIT)))
        else:
            handles.append(("s", hvd.allreduce_async(np.full(2, me * step, np.float32),
                                                     op=hvd.Sum, name="x",
                                                     process_set=SPLIT)))
            handles.append(("g", hvd.allreduce_async(np.full(2, me + step, np.float32),
                                                     op=hvd.Sum, name="x")))
        for kind, h in handles:
            out = hvd.synchronize(h)
            if kind == "g":
                exp = float(sum(r + step for r in range(n)))
            else:
                exp = float(sum(r * step for r in mine))
            assert_equal(out, np.full(2, exp, np.float32), f"{kind} step {step}")


def case_every_collective_by_the_same_name_in_both_groups(hvd):
    mine = _parity(hvd)
    me = hvd.rank()
    k = len(mine)
    g = hvd.allgather(np.full((1, 2), me, np.int32), name="c", process_set=SPLIT)
    assert_equal(g, np.repeat(np.array(mine, np.int32), 2).reshape(k, 2))
    b = hvd.broadcast(np.full(2, me, np.int64), root_rank=mine[-1], name="c",
                      process_set=SPLIT)
    assert_equal(b, np.full(2, mine[-1], np.int64))
    rs = hvd.reducescatter(np.ones((k, 2)), op=hvd.Sum, name="c", process_set=SPLIT)
    assert_equal(rs, np.full((1, 2), float(k)))
    a2a = hvd.alltoall(np.full(k, me, np.int16), name="c", process_set=SPLIT)
    assert_equal(a2a, np.array(mine, np.int16))
    hvd.barrier(process_set=SPLIT)


def case_init_with_a_communicator_records_it_as_the_global_sets(hvd):
    """As Horovod's init(comm=<communicator>) does (global_process_set.mpi_comm);
    init without one leaves None. Last: it starts the coordinator again."""
    from mpi4py import MPI

    assert hvd.global_process_set.mpi_comm is None
    comm = MPI.COMM_WORLD.Dup()
    hvd.shutdown()
    hvd.init(comm=comm)
    try:
        assert hvd.global_process_set.mpi_comm is comm
        assert hvd.global_process_set.ranks == list(range(comm.size))
        out = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.comm.init")
        assert_equal(out, np.full(2, float(comm.size)))
        hvd.barrier()
    finally:
        hvd.shutdown()
        hvd.init()
    assert hvd.global_process_set.mpi_comm is None


def case_init_with_sets_that_do_not_fit_raises_with_the_coordinator_running(hvd):
    """As Horovod's init (its test_process_sets_multi_comm): ValueError, with
    the coordinator running and none of the sets registered; an init with
    valid sets may follow (the frontends' init joins the running coordinator
    and adds them). Last: it starts the coordinator again."""
    from mpi4py import MPI

    from coordinator import basics, runtime

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)
    hvd.shutdown()
    given = [hvd.ProcessSet(sub), hvd.ProcessSet(world.Dup()), hvd.ProcessSet([0])]
    try:
        hvd.init(process_sets=given)  # the second is the global set again
    except ValueError as exc:
        assert "given twice" in str(exc), exc
    else:
        raise AssertionError("init with the global set given again did not raise")
    try:
        assert hvd.is_initialized() and hvd.size() == world.size
        assert sorted(runtime.current().process_sets.all()) == [0]
        assert all(ps.process_set_id is None for ps in given), given
        out = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.failed.init")
        assert_equal(out, np.full(2, float(world.size)))
        # The frontends' init again: a list naming the global set again adds
        # none of its sets; then a split communicator's sets (a different
        # group on each rank) and, past 2 ranks, a set by ranks.
        again = [hvd.ProcessSet(sub), hvd.ProcessSet(world.Dup())]
        try:
            basics.ensure_initialized(process_sets=again)
        except ValueError as exc:
            assert "already exists" in str(exc), exc
        else:
            raise AssertionError("a later init naming the global set did not raise")
        assert sorted(runtime.current().process_sets.all()) == [0]
        mine = hvd.ProcessSet(world.Split(color=world.rank % 2, key=world.rank))
        later = [mine] + ([hvd.ProcessSet([0])] if world.size > 2 else [])
        basics.ensure_initialized(process_sets=later)
        registered = {pid: ps.ranks for pid, ps in runtime.current().process_sets.all().items()}
        evens = list(range(0, world.size, 2))
        odds = list(range(1, world.size, 2))
        want = {0: list(range(world.size)), 1: evens, 2: odds}
        if world.size > 2:
            want[3] = [0]
        assert registered == want, registered  # (Horovod's test_process_sets_multi_comm's)
        assert mine.process_set_id == (1 if world.rank % 2 == 0 else 2), mine
        out = hvd.allreduce(np.ones(1), op=hvd.Sum, name="in.my.half", process_set=mine)
        assert_equal(out, np.full(1, float(len(evens if world.rank % 2 == 0 else odds))))
        hvd.barrier()  # (the other half may still be reducing: a shutdown would fail it)
    finally:
        hvd.shutdown()
        hvd.init()
