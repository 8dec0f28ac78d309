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


def case_init_lists_that_repeat_a_set_raise_where_they_repeat_it(hvd):
    """Horovod's test_process_sets_multi_comm's sequence, as its init does: a
    list that names a set twice (or the global set) registers its distinct
    sets, with the ids Horovod gives them, and raises ValueError, with the
    coordinator running, on the ranks where the list repeats one, leaving
    that entry unbound; a later init (the frontends' joins the running
    coordinator) binds the objects it names to those ids, or raises where
    its list repeats a set. Lists that do not fit together register none
    and raise everywhere. Last: it starts the coordinator again."""
    from mpi4py import MPI

    from coordinator import basics, runtime

    world = MPI.COMM_WORLD
    n, me = world.size, world.rank
    even = me % 2 == 0
    sub = world.Split(color=me % 2, key=me)
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    hvd.shutdown()

    def registered():
        return {pid: ps.ranks for pid, ps in runtime.current().process_sets.all().items()}

    evens_by_ranks = hvd.ProcessSet(evens)
    given = [hvd.ProcessSet(sub), hvd.ProcessSet(world.Dup()), hvd.ProcessSet(sub.Dup()),
             evens_by_ranks, hvd.ProcessSet([0])]
    try:
        hvd.init(process_sets=given)
    except ValueError as exc:
        assert "entry 1" in str(exc) and f"rank {me})" in str(exc), exc
        assert "the global process set" in str(exc), exc
    else:
        raise AssertionError("init with the global set given again did not raise")
    try:
        want = {0: list(range(n)), 1: evens, 2: odds}
        if n > 2:
            want[3] = [0]
        assert hvd.is_initialized() and registered() == want, registered()
        ids = [ps.process_set_id for ps in given]
        mine_id = 1 if even else 2
        assert ids[:3] == [mine_id, None, None], ids
        assert ids[3] == (None if even else 1), ids
        assert ids[4] == (3 if n > 2 else None), ids
        out = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.failed.init",
                            process_set=given[0])
        assert_equal(out, np.full(2, float(len(evens if even else odds))))

        # Horovod's fourth list: a duplicate on the even ranks (and on both
        # of 2 ranks, where [0] is the evens), none on the odd ranks.
        fourth = [hvd.ProcessSet(sub), evens_by_ranks, hvd.ProcessSet([0])]
        try:
            basics.ensure_initialized(process_sets=fourth)
        except ValueError as exc:
            assert n == 2 or even, f"rank {me} raised: {exc}"
            assert f"rank {me})" in str(exc) and "duplicate of entry" in str(exc), exc
        else:
            assert n > 2 and not even, f"rank {me}'s list repeats a set but did not raise"
            assert [ps.process_set_id for ps in fourth] == [2, 1, 3], fourth
        assert registered() == want, registered()

        last = [hvd.ProcessSet(sub)] + ([hvd.ProcessSet([0])] if n > 2 else [])
        basics.ensure_initialized(process_sets=last)
        assert registered() == want, registered()
        assert last[0].process_set_id == mine_id and last[0].size() == len(want[mine_id])
        if n > 2:
            assert last[1].process_set_id == 3 and last[1].included() == (me == 0)
        # The objects of the first init and of the last name the same set.
        a = hvd.allreduce_async(np.full(1, float(me)), op=hvd.Sum, name="a", process_set=given[0])
        b = hvd.allreduce_async(np.full(1, 1.0), op=hvd.Sum, name="b", process_set=last[0])
        assert_equal(hvd.synchronize(a), np.full(1, float(sum(want[mine_id]))))
        assert_equal(hvd.synchronize(b), np.full(1, float(len(want[mine_id]))))

        # Lists that do not fit together (each rank names itself) add none.
        try:
            basics.ensure_initialized(process_sets=[hvd.ProcessSet([me])])
        except ValueError as exc:
            assert "different ranks" in str(exc), exc
        else:
            raise AssertionError("lists naming different ranks did not raise")
        assert registered() == want, registered()
        hvd.barrier()  # (the other half may still be reducing: a shutdown would fail it)
    finally:
        hvd.shutdown()
        hvd.init()
    assert given[0].process_set_id is None and last[0].process_set_id is None
    assert given[0]._released and last[0]._released
