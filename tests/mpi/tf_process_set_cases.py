"""Horovod's process-set documentation, run through frontends.tensorflow on 4
ranks (run by tests/test_tensorflow.py).

The documented snippet registers an even and an odd set at init() and then
calls unnamed eager collectives on each, so both sets submit tensors by the
same name (`HorovodAllreduce`) at the same time: names are per process set,
as in Horovod. The last case builds the sets from a split communicator, as
the documentation's MPI variant does.
"""

import numpy as np

from tf_common import assert_equal, configure_tensorflow

configure_tensorflow()

import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402

STEPS = 20  # each step is a fresh chance for the two sets' names to collide
EVEN_SET = ODD_SET = None


def setup(core):
    global EVEN_SET, ODD_SET
    # As in Horovod's docs (docs/process_set.rst), for 4 ranks.
    EVEN_SET = hvd.ProcessSet([0, 2])
    ODD_SET = hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[EVEN_SET, ODD_SET])


def _my_set():
    return EVEN_SET if hvd.rank() % 2 == 0 else ODD_SET


def _check_unnamed_collectives(my_set, what):
    r = hvd.rank()
    members = my_set.ranks
    assert r in members, (what, members)

    def collectives(x):
        return (hvd.allreduce(x, process_set=my_set),  # Average, as the docs' call
                hvd.allreduce(x, op=hvd.Sum, process_set=my_set),
                hvd.allgather(x, process_set=my_set),
                hvd.broadcast(x, members[-1], process_set=my_set))

    in_function = tf.function(collectives)
    for step in range(STEPS):
        x = tf.constant([float(r + step)])
        for mode, run in (("eager", collectives), ("tf.function", in_function)):
            avg, total, gathered, root = run(x)
            label = f"{what} {mode} step {step}"
            assert_equal(avg.numpy(), np.array([np.mean([q + step for q in members])],
                                               np.float32), label)
            assert_equal(total.numpy(), np.array([float(sum(q + step for q in members))],
                                                 np.float32), label)
            assert_equal(gathered.numpy(), np.array([q + step for q in members], np.float32),
                         label)
            assert_equal(root.numpy(), np.array([members[-1] + step], np.float32), label)


def case_a_set_this_rank_cannot_use_is_a_value_error_where_the_op_is_called(core):
    """As in Horovod (its test_horovod_allreduce_process_set_id_error): a set
    that is not registered, or whose id the coordinator holds for another
    set, is a ValueError when the op is called, eagerly and where a graph
    builds it. Was: InvalidArgumentError eagerly, and in a graph only when a
    Session ran the op. (A set without this rank stays the op's
    InvalidArgumentError, as in Horovod: tf_cases.py.)"""
    unregistered = hvd.ProcessSet([0, 1])
    forged = hvd.ProcessSet([hvd.rank()])
    forged.process_set_id = 10  # (what Horovod's test does)
    try:
        forged.size()
    except ValueError:
        pass
    else:
        raise AssertionError("size() of a set the coordinator does not hold did not raise")
    calls = {
        "allreduce": lambda ps: hvd.allreduce(tf.ones(2), process_set=ps),
        "grouped_allreduce": lambda ps: hvd.grouped_allreduce([tf.ones(2)], process_set=ps),
        "allgather": lambda ps: hvd.allgather(tf.ones(2), process_set=ps),
        "broadcast": lambda ps: hvd.broadcast(tf.ones(2), 0, process_set=ps),
        "alltoall": lambda ps: hvd.alltoall(tf.ones(4), process_set=ps),
        "reducescatter": lambda ps: hvd.reducescatter(tf.ones(4), process_set=ps),
    }
    for what, call in calls.items():
        for ps in (unregistered, forged):
            for mode in ("eager", "graph"):
                try:
                    if mode == "eager":
                        call(ps)
                    else:
                        with tf.Graph().as_default():
                            call(ps)
                except ValueError:
                    continue
                raise AssertionError(f"{what} {mode} on {ps!r} raised no ValueError")
    # The job goes on.
    assert_equal(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(),
                 np.array([float(hvd.size())], np.float32), "after")


def case_documented_even_and_odd_sets_with_unnamed_eager_ops(core):
    assert hvd.size() == 4, "the documented sets are for 4 ranks"
    assert (EVEN_SET.ranks, ODD_SET.ranks) == ([0, 2], [1, 3])
    assert (EVEN_SET.process_set_id, ODD_SET.process_set_id) == (1, 2)
    assert EVEN_SET.included() == (hvd.rank() % 2 == 0)
    assert ODD_SET.included() == (hvd.rank() % 2 == 1)
    # Documented: `hvd.allreduce(tensor, process_set=even_set)` on the even
    # ranks while the odd ranks do the same on odd_set, unnamed.
    result = hvd.allreduce(tf.constant([hvd.rank()]), op=hvd.Sum, process_set=_my_set())
    assert_equal(result.numpy(), np.array([sum(_my_set().ranks)], np.int32))
    _check_unnamed_collectives(_my_set(), "ranks-given set")


def case_horovods_basics_object_answers_for_the_registered_sets(core):
    """Horovod's `mpi_ops._basics`, through which its own tests read the
    process-set table: ids and ranks, a communicator's set, a set's size and
    this rank's place in it, and the private add and remove calls."""
    from mpi4py import MPI

    b, me = hvd.mpi_ops._basics, hvd.rank()
    assert (b.size(), b.rank(), b.is_initialized()) == (4, me, True)
    assert b._get_process_set_ids_and_ranks() == {0: [0, 1, 2, 3], 1: [0, 2], 2: [1, 3]}
    mine, other = (1, 2) if me % 2 == 0 else (2, 1)
    assert b._comm_process_set_id(MPI.COMM_WORLD) == 0
    assert b._comm_process_set_id(MPI.COMM_WORLD.Split(color=me % 2, key=me)) == mine
    assert (b._process_set_size(mine), b._process_set_rank(mine)) == (2, me // 2)
    alone = MPI.COMM_WORLD.Split(color=me, key=0)  # a set nobody registered
    for call, arg in ((b._process_set_rank, other), (b._process_set_size, 99),
                      (b._comm_process_set_id, alone)):
        try:
            call(arg)
        except ValueError:
            continue
        raise AssertionError(f"{call.__name__}({arg}) raised no ValueError")
    hvd.init(process_sets="dynamic")
    assert b._add_process_set_impl([0, 2]) is None  # that set exists
    pid = b._add_process_set_impl([0, 1, 2])
    assert pid == 3 and b._get_process_set_ids_and_ranks()[pid] == [0, 1, 2]
    assert b._remove_process_set_impl(pid) == pid
    assert b._remove_process_set_impl(pid) is None and b._remove_process_set_impl(0) is None
    assert sorted(b._get_process_set_ids_and_ranks()) == [0, 1, 2]
    # The functions Horovod's TensorFlow mpi_ops also holds.
    for name in ("init", "shutdown", "size", "rank", "local_rank", "is_homogeneous",
                 "mpi_built", "nccl_built", "start_timeline", "broadcast_", "ProcessSet",
                 "add_process_set", "handle_average_backwards_compatibility"):
        assert callable(getattr(hvd.mpi_ops, name)), name
    assert hvd.mpi_ops.size() == 4 and hvd.mpi_ops.rank() == me
    v = tf.Variable([float(me)] * 2)
    hvd.mpi_ops.broadcast_([v], root_rank=3, process_set=hvd.global_process_set)
    assert_equal(v.numpy(), np.full(2, 3.0, np.float32), "broadcast_")
    pick = hvd.mpi_ops.get_average_backwards_compatibility_fun(hvd.mpi_ops)
    assert (pick(None, None), pick(hvd.Max, None)) == (hvd.Average, hvd.Max)


def case_documented_sets_from_a_split_communicator(core):
    """Horovod's MPI variant: ProcessSet(MPI.COMM_WORLD.Split(...)), each
    rank passing the communicator of its own group, then unnamed eager ops."""
    from mpi4py import MPI

    hvd.shutdown()
    world = MPI.COMM_WORLD
    subcomm = world.Split(color=world.rank % 2, key=world.rank)
    split_set = hvd.ProcessSet(subcomm)
    hvd.init(world, process_sets=[split_set])
    assert split_set.ranks == [q for q in range(hvd.size()) if q % 2 == hvd.rank() % 2]
    _check_unnamed_collectives(split_set, "split-communicator set")
