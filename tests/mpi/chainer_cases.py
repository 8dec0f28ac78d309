"""Multi-rank cases for the Chainer frontend (ChainerMN's API), run by
tests/test_chainer_mpi.py at 2 and 4 ranks.

Every rank can compute every other rank's input, so each case checks its
result against NumPy, or against single-process Chainer on the full batch.
"""

import os
import shutil
import tempfile
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import frontends.chainer as chainermn  # makes Chainer importable first

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

COMM = None


def setup(hvd):
    global COMM
    COMM = chainermn.create_communicator("naive")


def data(rank, shape, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.integers(-8, 8, size=shape).astype(dtype)


def shape_of(rank):
    """A different shape on every rank (the methods allow it)."""
    return (rank + 1, 3)


def assert_equal(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual, expected, err_msg=what)


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


DTYPES = [np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64]


# ----------------------------------------------------------------- topology
def case_topology_matches_mpi_and_processor_names(hvd):
    world = MPI.COMM_WORLD
    assert (COMM.rank, COMM.size) == (world.rank, world.size) == (hvd.rank(), hvd.size())
    hosts = world.allgather(MPI.Get_processor_name())
    mine = [r for r, h in enumerate(hosts) if h == hosts[world.rank]]
    assert COMM.intra_rank == mine.index(world.rank)
    assert COMM.intra_size == len(mine)
    assert COMM.inter_size == len(set(hosts))
    assert 0 <= COMM.inter_rank < COMM.inter_size


# --------------------------------------------------------------- allreduce
def case_allreduce_sums_every_dtype(hvd):
    n = COMM.size
    for dtype in DTYPES:
        inputs = [data(r, (2, 3), dtype, seed=1) for r in range(n)]
        out = COMM.allreduce(inputs[COMM.rank])
        expected = np.sum(np.stack(inputs), axis=0, dtype=dtype)
        assert_equal(out, expected, f"allreduce {np.dtype(dtype).name}")


def case_allreduce_rejects_tuples_and_bool(hvd):
    expect_raises(TypeError, COMM.allreduce, (np.ones(2), np.ones(2)))
    expect_raises(TypeError, COMM.allreduce, np.ones(2, dtype=bool))


def case_allreduce_shape_mismatch_raises_the_cores_error_on_every_rank(hvd):
    exc = expect_raises(hvd.TensorMismatchError, COMM.allreduce,
                        np.ones(COMM.rank + 1, np.float32))
    assert "shape" in str(exc).lower(), str(exc)


# ------------------------------------------------------------------- bcast
def case_bcast_from_every_root(hvd):
    for root in range(COMM.size):
        for dtype in DTYPES + [np.bool_]:
            x = data(root, (2, 2, 3), dtype, seed=2)
            mine = x if COMM.rank == root else None
            out = COMM.bcast(mine, root=root)
            assert_equal(out, x, f"bcast root {root} {np.dtype(dtype).name}")
            if COMM.rank == root:
                assert out is x  # ChainerMN returns root's own array


def case_bcast_of_tuple_raises_on_every_rank(hvd):
    arg = (np.ones(2), np.ones(2)) if COMM.rank == 0 else None
    exc = expect_raises(TypeError, COMM.bcast, arg, root=0)
    assert "Tuple" in str(exc)


# --------------------------------------------------------------- allgather
def case_allgather_arrays_of_different_shapes(hvd):
    for dtype in DTYPES:
        out = COMM.allgather(data(COMM.rank, shape_of(COMM.rank), dtype, seed=3))
        assert isinstance(out, tuple) and len(out) == COMM.size
        for r in range(COMM.size):
            assert_equal(out[r], data(r, shape_of(r), dtype, seed=3), f"allgather from {r}")


def case_allgather_of_mixed_dtypes_raises_type_error_on_every_rank(hvd):
    dtype = np.float32 if COMM.rank == 0 else np.int32
    exc = expect_raises(TypeError, COMM.allgather, np.ones(3, dtype))
    assert "rank 0: float32" in str(exc) and "rank 1: int32" in str(exc), str(exc)
    # The same for gather and alltoall, whose shapes travel with their data
    exc = expect_raises(TypeError, COMM.gather, np.ones(3, dtype), root=COMM.size - 1)
    assert "rank 0: float32" in str(exc) and "rank 1: int32" in str(exc), str(exc)
    exc = expect_raises(TypeError, COMM.alltoall, [np.ones(2, dtype)] * COMM.size)
    assert "rank 0: float32" in str(exc) and "rank 1: int32" in str(exc), str(exc)
    assert_equal(COMM.allgather(np.ones(1, np.float32))[0], np.ones(1, np.float32))


# ------------------------------------------------------------------ gather
def case_gather_to_every_root(hvd):
    for root in range(COMM.size):
        out = COMM.gather(data(COMM.rank, shape_of(COMM.rank), np.float32, seed=4), root=root)
        if COMM.rank != root:
            assert out is None
            continue
        assert len(out) == COMM.size
        for r in range(COMM.size):
            assert_equal(out[r], data(r, shape_of(r), np.float32, seed=4), f"gather from {r}")


# ----------------------------------------------------------------- scatter
def case_scatter_tuple_of_different_shapes_from_every_root(hvd):
    for root in range(COMM.size):
        parts = tuple(data(100 + r, shape_of(r), np.int64, seed=5) for r in range(COMM.size))
        out = COMM.scatter(parts if COMM.rank == root else None, root=root)
        assert_equal(out, parts[COMM.rank], f"scatter root {root}")


def case_scatter_array_splits_first_axis(hvd):
    xs = np.arange(COMM.size * 6, dtype=np.float64).reshape(COMM.size, 2, 3)
    out = COMM.scatter(xs if COMM.rank == 0 else None)
    assert_equal(out, xs[COMM.rank])


def case_scatter_with_wrong_length_raises_on_every_rank(hvd):
    bad = tuple(np.ones(2) for _ in range(COMM.size + 1)) if COMM.rank == 0 else None
    exc = expect_raises(ValueError, COMM.scatter, bad)
    assert "root rank 0" in str(exc)


# ---------------------------------------------------------------- alltoall
def case_alltoall_arrays_of_different_shapes(hvd):
    n, me = COMM.size, COMM.rank

    def part(sender, receiver):
        return np.full((sender + 1, receiver + 2), 10 * sender + receiver, np.float32)

    out = COMM.alltoall(tuple(part(me, j) for j in range(n)))
    assert len(out) == n
    for i in range(n):
        assert_equal(out[i], part(i, me), f"alltoall from {i}")
    expect_raises(ValueError, COMM.alltoall, tuple(part(me, 0) for _ in range(n + 1)))


def case_alltoall_of_an_array_sends_its_rows(hvd):
    # ChainerMN takes any sequence of `size` arrays, an array's rows included.
    n, me = COMM.size, COMM.rank
    rows = np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 100 * me
    out = COMM.alltoall(rows)
    assert len(out) == n
    for i in range(n):
        assert_equal(out[i], np.arange(3, dtype=np.float64) + 3 * me + 100 * i,
                     f"alltoall row from {i}")
    expect_raises(ValueError, COMM.alltoall, np.zeros((n + 1, 2)))
    expect_raises(ValueError, COMM.alltoall, np.zeros(()))


# ---------------------------------------------------------- point to point
def case_send_recv_around_a_ring(hvd):
    n, me = COMM.size, COMM.rank
    right, left = (me + 1) % n, (me - 1) % n
    single = data(me, (3, 4), np.float16, seed=6)
    pair = (data(me, (2,), np.int32, seed=7), data(me, (1, 5), np.float64, seed=8))
    if me % 2 == 0:
        COMM.send(single, right, 3)
        COMM.send(pair, right, 4)
        got_single, got_pair = COMM.recv(left, 3), COMM.recv(left, 4)
    else:
        got_single, got_pair = COMM.recv(left, 3), COMM.recv(left, 4)
        COMM.send(single, right, 3)
        COMM.send(pair, right, 4)
    assert_equal(got_single, data(left, (3, 4), np.float16, seed=6), "send single")
    assert isinstance(got_pair, tuple) and len(got_pair) == 2
    assert_equal(got_pair[0], data(left, (2,), np.int32, seed=7), "send tuple[0]")
    assert_equal(got_pair[1], data(left, (1, 5), np.float64, seed=8), "send tuple[1]")


def case_recv_with_a_wildcard_says_so_at_once(hvd):
    # Arrays pair by (source, tag) in the coordinator: MPI.ANY_TAG used to
    # wait for a message named "tag-1" until DeadlockError, MPI.ANY_SOURCE
    # said "rank -1 is not a rank".
    from mpi4py import MPI

    peer = (COMM.rank + 1) % COMM.size
    for source, tag, wildcard in [(peer, MPI.ANY_TAG, "ANY_TAG"),
                                  (MPI.ANY_SOURCE, 5, "ANY_SOURCE")]:
        exc = expect_raises(ValueError, COMM.recv, source, tag)
        assert f"MPI.{wildcard} is not supported" in str(exc) and "recv_obj" in str(exc), exc
    exc = expect_raises(ValueError, COMM.send, np.zeros(2), peer, -3)
    assert "tag -3" in str(exc), exc


def case_send_obj_recv_obj_with_tags(hvd):
    n, me = COMM.size, COMM.rank
    if me == 0:
        for r in range(1, n):
            COMM.send_obj({"to": r, "tag": 9}, r, tag=9)
            COMM.send_obj(["second", r], r, tag=10)
    else:
        # Receive the tag-10 message first: tags select, whatever the order sent.
        assert COMM.recv_obj(0, tag=10) == ["second", me]
        assert COMM.recv_obj(0, tag=9) == {"to": me, "tag": 9}


# ----------------------------------------------------------------- objects
def case_bcast_obj_in_chunks_from_every_root(hvd):
    for root in range(COMM.size):
        obj = {"root": root, "payload": list(range(5000)), "text": "x" * 777}
        out = COMM.bcast_obj(obj if COMM.rank == root else None, max_buf_len=1000, root=root)
        assert out == obj
    # ChainerMN asserts on a piece size outside MPI's C int: so does this,
    # saying why, on every rank, before any communication.
    for size in (0, 2 ** 31):
        exc = expect_raises(AssertionError, COMM.bcast_obj, 1, max_buf_len=size)
        assert isinstance(exc, ValueError) and "max_buf_len must be in (0, 2**31)" in str(exc)
    assert COMM.bcast_obj("after" if COMM.rank == 0 else None) == "after"


def case_gather_obj_and_allreduce_obj(hvd):
    got = COMM.gather_obj(("rank", COMM.rank), root=COMM.size - 1)
    if COMM.rank == COMM.size - 1:
        assert got == [("rank", r) for r in range(COMM.size)]
    else:
        assert got is None
    assert COMM.allreduce_obj(COMM.rank + 1) == sum(range(1, COMM.size + 1))
    total = COMM.allreduce_obj(np.full(3, COMM.rank, np.int64))
    assert_equal(total, np.full(3, sum(range(COMM.size)), np.int64))


# -------------------------------------------------------------- model data
def make_model(seed, dtype=np.float64):
    rng = np.random.RandomState(seed)

    def linear(n_in, n_out):
        return L.Linear(n_in, n_out, initialW=rng.standard_normal((n_out, n_in)).astype(dtype),
                        initial_bias=rng.standard_normal(n_out).astype(dtype))

    model = chainer.Chain()
    with chainer.using_config("dtype", np.dtype(dtype)), model.init_scope():
        model.l1 = linear(4, 5)
        model.l2 = linear(5, 3)
        model.unused = linear(2, 2)  # never called: its gradients stay None
    assert model.l1.W.dtype == dtype
    return model


def forward(model, x):
    return model.l2(F.tanh(model.l1(x)))


def params_of(model):
    return {name: p.array.copy() for name, p in sorted(model.namedparams())}


def case_bcast_data_copies_rank0_parameters(hvd):
    model = make_model(seed=10 + COMM.rank)
    COMM.bcast_data(model)
    expected = params_of(make_model(seed=10))
    for name, value in params_of(model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def case_multi_node_mean_grad_averages_and_zero_fills(hvd):
    n = COMM.size

    def grads(rank):
        rng = np.random.RandomState(50 + rank)
        return {name: rng.standard_normal(p.array.shape)
                for name, p in sorted(make_model(0).namedparams()) if "unused" not in name}

    for zero_fill in (True, False):
        model = make_model(seed=0)
        for name, p in model.namedparams():
            p.grad = grads(COMM.rank)[name].copy() if "unused" not in name else None
        COMM.multi_node_mean_grad(model, zero_fill=zero_fill)
        for name, p in model.namedparams():
            if "unused" in name:
                if zero_fill:
                    assert_equal(p.grad, np.zeros_like(p.array), name)
                else:
                    assert p.grad is None, name
                continue
            expected = sum(grads(r)[name] for r in range(n)) / n
            np.testing.assert_allclose(p.grad, expected, rtol=1e-12, err_msg=name)


def case_debug_mode_raises_on_every_rank_when_averaged_gradients_diverge(hvd):
    # ChainerMN's check under chainer.set_debug(True); here it names them.
    model = chainer.links.Linear(2, 3)
    model.W.grad = np.full((3, 2), np.nan if COMM.rank == 0 else 1.0, np.float32)
    model.b.grad = np.ones(3, np.float32)
    COMM.multi_node_mean_grad(model)  # not in debug mode: no check, as ChainerMN
    assert np.isnan(model.W.grad).all()
    chainer.set_debug(True)
    try:
        exc = expect_raises(ValueError, COMM.multi_node_mean_grad, model)
        assert "Parameters diverged after allreduce." in str(exc) and "/W" in str(exc) \
            and "/b" not in str(exc), str(exc)
        buf = np.array([1.0, np.inf if COMM.rank == 1 else 0.0])
        exc = expect_raises(ValueError, COMM._multi_node_mean, None, buf)  # batch norm's
        assert "diverged" in str(exc)
        model.W.grad[...] = 1.0
        COMM.multi_node_mean_grad(model)  # finite: no error in debug mode either
    finally:
        chainer.set_debug(False)


def case_config_is_also_an_attribute_as_in_chainermn(hvd):
    assert COMM.batched_copy is True and COMM.get_config("batched_copy") is True
    COMM.set_config("batched_copy", False)
    assert COMM.batched_copy is False
    COMM.batched_copy = True
    assert COMM.get_config("batched_copy") is True
    assert COMM.allreduce_grad_dtype is None
    with pytest.raises(ValueError, match="only available at 'pure_nccl'"):
        COMM.allreduce_grad_dtype = np.float16


def case_communicator_classes_and_module_paths_are_chainermns(hvd):
    comms = chainermn.communicators
    assert isinstance(COMM, comms.naive_communicator.NaiveCommunicator)
    assert isinstance(COMM, comms.mpi_communicator_base.MpiCommunicatorBase)
    assert isinstance(COMM, chainermn.CommunicatorBase)
    direct = comms.naive_communicator.NaiveCommunicator(mpi_comm=MPI.COMM_WORLD)  # as its tests
    assert direct.name == "naive"
    assert direct.get_config("batched_copy") is False  # ChainerMN's, made directly
    assert_equal(direct.allreduce(np.ones(2)), np.full(2, float(direct.size)))
    half = direct.split(direct.rank % 2, direct.rank)
    assert isinstance(half, comms.naive_communicator.NaiveCommunicator)
    assert comms.dummy_communicator.DummyCommunicator(MPI.COMM_WORLD).name == "dummy"
    from coordinator import gpu

    if not gpu.probe()[0]:  # as ChainerMN's, a GPU one checks that it can run
        expect_raises(RuntimeError, comms.pure_nccl_communicator.PureNcclCommunicator,
                      MPI.COMM_WORLD)


def case_allreduce_grad_is_the_deprecated_name(hvd):
    model = make_model(seed=0)
    for _, p in model.namedparams():
        p.grad = np.full(p.array.shape, float(COMM.rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        COMM.allreduce_grad(model)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    for name, p in model.namedparams():
        np.testing.assert_allclose(p.grad, (COMM.size - 1) / 2.0, err_msg=name)


# ------------------------------------------------------------------- split
def case_split_orders_by_key_and_runs_collectives_per_group(hvd):
    n, me = COMM.size, COMM.rank
    color = me % 2
    sub = COMM.split(color, -me)  # reversed order inside each group
    members = sorted((r for r in range(n) if r % 2 == color), reverse=True)
    assert sub.size == len(members) and sub.rank == members.index(me)
    # Both groups use the same op names at once; they must not mix.
    assert_equal(sub.allreduce(np.array([me], np.int64)), np.array([sum(members)], np.int64))
    gathered = sub.allgather(np.array([me, color], np.int32))
    assert [int(a[0]) for a in gathered] == members
    root_value = sub.bcast(np.array([me * 10.0]) if sub.rank == 0 else None, root=0)
    assert_equal(root_value, np.array([members[0] * 10.0]))
    got = sub.gather(np.array([me]), root=sub.size - 1)
    if sub.rank == sub.size - 1:
        assert [int(a[0]) for a in got] == members
    scattered = sub.scatter(tuple(np.array([m]) for m in members) if sub.rank == 0 else None)
    assert_equal(scattered, np.array([me]))
    swapped = sub.alltoall(tuple(np.array([me, m]) for m in members))
    assert [tuple(int(v) for v in a) for a in swapped] == [(m, me) for m in members]
    assert sub.bcast_obj({"g": color} if sub.rank == 0 else None) == {"g": color}
    # Splitting the same way again reuses the registered process sets.
    again = COMM.split(color, me)
    assert again.process_set.process_set_id == sub.process_set.process_set_id or sub.size == n
    assert_equal(again.allreduce(np.array([1])), np.array([len(members)]))
    sub.finalize()
    again.finalize()


def case_split_with_undefined_color_leaves_rank_out(hvd):
    me = COMM.rank
    sub = COMM.split(MPI.UNDEFINED if me == 0 else 0, me)
    if me == 0:
        assert sub is None
        return
    assert sub.size == COMM.size - 1 and sub.rank == me - 1
    assert_equal(sub.allreduce(np.array([me])), np.array([sum(range(1, COMM.size))]))
    sub.finalize()


def case_a_split_of_a_split_runs_on_its_own_groups(hvd):
    # It raised NotImplementedError: a process set needed every rank to
    # register it, and the ranks outside the first split take no part in the
    # second. Each group's ranks now register its set themselves; the rank
    # left out of the first split meanwhile works on, on the whole job.
    n, me = COMM.size, COMM.rank
    sub = COMM.split(0 if me < n - 1 else MPI.UNDEFINED, me)
    if sub is None:
        assert_equal(COMM.allreduce(np.array([me], np.int64)),
                     np.array([sum(range(n))], np.int64))
        return
    inner = sub.split(sub.rank % 2, -sub.rank)  # reversed order inside each group
    members = sorted((r for r in range(n - 1) if r % 2 == me % 2), reverse=True)
    assert (inner.size, inner.rank) == (len(members), members.index(me))
    assert_equal(inner.allreduce(np.array([me], np.int64)), np.array([sum(members)], np.int64))
    assert [int(a[0]) for a in inner.allgather(np.array([me]))] == members
    assert inner.bcast_obj(me) == members[0]
    assert set(inner.process_set.ranks) == set(members)
    deeper = inner.split(0, inner.rank)  # a third level, over the same ranks
    assert deeper.process_set.process_set_id == inner.process_set.process_set_id or \
        len(members) == n
    assert_equal(deeper.allreduce(np.ones(1)), np.array([float(len(members))]))
    assert_equal(COMM.allreduce(np.array([me], np.int64)), np.array([sum(range(n))], np.int64))
    for comm in (deeper, inner, sub):
        comm.finalize()


def case_one_group_wraps_its_sub_communicator_while_the_others_do_not(hvd):
    # ChainerMN wraps any mpi_comm, and only its ranks need to: a group that
    # did so alone waited for the others to register their sets too, and
    # failed with a deadlock error. The group registers its set by itself,
    # while the others wait outside the coordinator (in an mpi4py barrier:
    # their background threads have nothing to do, and post no cycle unless
    # asked; test_chainer_mpi runs this with stall checks off too, where no
    # watchdog ping asks them). Rank 0's group first, then one without it
    # (rank 0, idle, must hear of the other group's add from its worker).
    world = MPI.COMM_WORLD
    for parity in (0, 1):
        sub = world.Split(int(world.rank % 2 == parity), world.rank)
        try:
            group = [r for r in range(world.size) if r % 2 == parity]
            if world.rank % 2 == parity:
                comm = chainermn.create_communicator("naive", mpi_comm=sub)
                assert_equal(comm.allreduce(np.array([world.rank], np.int64)),
                             np.array([sum(group)], np.int64))
                assert comm.process_set.ranks == group or len(group) == world.size
                comm.finalize()
            _barrier_outside_the_coordinator(world)
        finally:
            sub.Free()
    assert_equal(COMM.allreduce(np.ones(1)), np.array([float(world.size)]))


def _barrier_outside_the_coordinator(comm):
    """mpi4py's barrier, polled: a blocking MPI_Barrier here could hold the
    MPI progress the coordinator's own thread needs on some MPIs."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


# ---------------------------------------------------- names, config, finalize
def case_gpu_communicator_names_explain_that_gpus_are_needed(hvd):
    from frontends.chainer.communicators import GPU_COMMUNICATORS

    assert set(GPU_COMMUNICATORS) >= {"pure_nccl", "flat", "hierarchical", "two_dimensional",
                                      "single_node", "non_cuda_aware"}
    for name in GPU_COMMUNICATORS:
        exc = expect_raises(RuntimeError, chainermn.create_communicator, name)
        text = str(exc)
        assert "GPU" in text and "naive" in text and name in text, text
    # ChainerMN's default is pure_nccl, which needs GPUs.
    expect_raises(RuntimeError, chainermn.create_communicator)
    expect_raises(ValueError, chainermn.create_communicator, "no_such_name")
    expect_raises(ValueError, chainermn.create_communicator, "naive",
                  allreduce_grad_dtype=np.float16)


def case_a_communicator_over_an_mpi4py_sub_communicator_beside_the_whole_jobs(hvd):
    # A hybrid program's pattern: every rank splits COMM_WORLD and wraps its
    # part (ChainerMN wraps any mpi_comm). It was refused ("mpi_comm holds
    # coordinator ranks ..."): the core's process set is now registered by
    # every rank at once, each naming its own group.
    world = MPI.COMM_WORLD
    sub = world.Split(world.rank % 2, world.rank)
    try:
        comm = chainermn.create_communicator("naive", mpi_comm=sub)
        members = [r for r in range(world.size) if r % 2 == world.rank % 2]
        assert (comm.rank, comm.size) == (members.index(world.rank), len(members))
        assert_equal(comm.allreduce(np.array([world.rank], np.int64)),
                     np.array([sum(members)], np.int64))
        assert comm.allgather(np.array([world.rank]))[-1][0] == members[-1]
        assert comm.bcast_obj(world.rank) == members[0]
        again = chainermn.create_communicator("naive", mpi_comm=sub)  # the same set again
        assert again.allreduce(np.ones(1))[0] == len(members)
        assert COMM.allreduce(np.ones(1))[0] == world.size  # the whole job's still works
    finally:
        sub.Free()


def case_groups_wrap_their_sub_communicators_where_only_some_sets_are_registered(hvd):
    # Every rank wraps its group's sub-communicator at once; rank 0's group
    # has a process set already, the others' do not. Every rank must still
    # take part in registering theirs: a frontend that let rank 0 reuse its
    # set alone left the others waiting for it (a deadlock error after 120 s,
    # found by tests/scripts/random_chainer.py). And communicators are
    # numbered per group, so the extra ones of some groups leave the names of
    # the whole job's next communicator alike on every rank.
    world = MPI.COMM_WORLD
    subs = [world.Split(int(world.rank != 0), world.rank), world.Split(world.rank, 0)]
    try:
        first = chainermn.create_communicator("naive", mpi_comm=subs[0])
        second = chainermn.create_communicator("naive", mpi_comm=subs[1])
        assert second.size == 1
        assert second.allreduce(np.array([world.rank], np.int64))[0] == world.rank
        if world.rank != 0:
            assert first.allreduce(np.ones(1))[0] == world.size - 1
        whole = chainermn.create_communicator("naive")
        assert whole.allreduce(np.ones(1))[0] == world.size
        for comm in (first, second, whole):
            comm.finalize()
    finally:
        for sub in subs:
            sub.Free()


def case_finalized_communicator_refuses_work(hvd):
    comm = chainermn.create_communicator("naive", mpi_comm=MPI.COMM_WORLD, batched_copy=False)
    assert comm.get_config("batched_copy") is False
    assert_equal(comm.allreduce(np.ones(2)), np.full(2, float(comm.size)))
    comm.finalize()
    expect_raises(RuntimeError, comm.allreduce, np.ones(2))
    expect_raises(RuntimeError, comm.bcast_obj, 1)


# ---------------------------------------------------------------- optimizer
STEPS = 6
BATCH = 3  # per rank


def batch(step, n_ranks):
    rng = np.random.RandomState(1000 + step)
    x = rng.standard_normal((BATCH * n_ranks, 4))
    y = rng.randint(0, 3, size=BATCH * n_ranks).astype(np.int32)
    return x, y


def loss_of(model):
    return lambda x, y: F.softmax_cross_entropy(forward(model, x), y)


def reference_training(double_buffering):
    """Single process, full global batch. Update 1 broadcasts (no step), as
    the multi-node optimizer does; with double buffering each later update
    applies the previous iteration's full-batch gradient."""
    model = make_model(seed=10)
    opt = chainer.optimizers.MomentumSGD(lr=0.1)
    opt.setup(model)
    previous = None
    for step in range(2, STEPS + 1):
        x, y = batch(step, COMM.size)
        if not double_buffering:
            opt.update(loss_of(model), x, y)
            continue
        model.cleargrads()
        loss_of(model)(x, y).backward()
        current = {name: None if p.grad is None else p.grad.copy()
                   for name, p in model.namedparams()}
        if previous is not None:
            for name, p in model.namedparams():
                p.grad = previous[name]
            opt.update()
        previous = current
    return params_of(model)


def multi_node_training(double_buffering):
    model = make_model(seed=10 + COMM.rank)  # rank 0's model wins the broadcast
    opt = chainermn.create_multi_node_optimizer(chainer.optimizers.MomentumSGD(lr=0.1), COMM,
                                                double_buffering=double_buffering)
    opt.setup(model)
    lo, hi = COMM.rank * BATCH, (COMM.rank + 1) * BATCH
    for step in range(1, STEPS + 1):
        x, y = batch(step, COMM.size)
        opt.update(loss_of(model), x[lo:hi], y[lo:hi])
    if double_buffering:
        opt.wait()
    assert opt.lr == 0.1 and opt.target is model  # the wrapped optimizer's attributes
    return params_of(model)


def check_training(double_buffering):
    got = multi_node_training(double_buffering)
    expected = reference_training(double_buffering)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    assert_equal(got["/unused/W"], make_model(seed=10)["unused"].W.array)
    same = COMM.allgather(np.concatenate([v.ravel() for v in got.values()]))
    for r in range(COMM.size):
        assert_equal(same[r], same[0], f"rank {r} parameters")
    return got


def case_multi_node_optimizer_equals_full_batch_training(hvd):
    check_training(double_buffering=False)


def case_double_buffering_equals_one_step_stale_full_batch_training(hvd):
    stale = check_training(double_buffering=True)
    fresh = reference_training(double_buffering=False)
    assert not np.allclose(stale["/l1/W"], fresh["/l1/W"]), "staleness made no difference"


def case_double_buffering_needs_a_coordinator_communicator(hvd):
    class Other:
        pass

    expect_raises(ValueError, chainermn.create_multi_node_optimizer,
                  chainer.optimizers.SGD(), Other(), double_buffering=True)


# ----------------------------------------------------------------- datasets
def gather_items(sub):
    """Every rank's examples, in rank order."""
    return COMM.mpi_comm.allgather([int(v) for v in sub])


def case_scatter_dataset_partitions_cover_every_example_once(hvd):
    n_ranks = COMM.size
    for n in (0, 1, n_ranks, 10, 23):
        for shuffle, seed in ((False, None), (True, 7)):
            dataset = np.arange(n) if COMM.rank == 0 else None
            sub = chainermn.scatter_dataset(dataset, COMM, shuffle=shuffle, seed=seed,
                                            force_equal_length=False)
            parts = gather_items(sub)
            assert sorted(v for p in parts for v in p) == list(range(n)), (n, parts)
            lengths = [len(p) for p in parts]
            assert max(lengths) - min(lengths) <= 1
            order = (np.random.RandomState(seed).permutation(n) if shuffle
                     else np.arange(n))
            assert [v for p in parts for v in p] == [int(v) for v in order]


def case_scatter_dataset_equal_length_default_covers_all_with_equal_sizes(hvd):
    n_ranks = COMM.size
    for n in (n_ranks * 3, 10, 23):
        dataset = np.arange(n) if COMM.rank == 0 else None
        parts = gather_items(chainermn.scatter_dataset(dataset, COMM, shuffle=True, seed=3))
        assert {len(p) for p in parts} == {-(-n // n_ranks)}
        flat = [v for p in parts for v in p]
        assert set(flat) == set(range(n))
        if n % n_ranks == 0:
            assert sorted(flat) == list(range(n))


def case_scatter_index_and_empty_dataset(hvd):
    b, e = chainermn.scatter_index(10 if COMM.rank == 0 else None, COMM,
                                   force_equal_length=False)
    ranges = COMM.mpi_comm.allgather((b, e))
    assert ranges[0][0] == 0 and ranges[-1][1] == 10
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(COMM.size - 1))
    assert chainermn.create_empty_dataset(list(range(5))) == [()] * 5


# ---------------------------------------------------------------- evaluator
class _Probe(chainer.Link):
    """Reports the batch mean of x and this rank's number, like a model."""

    def __init__(self, extra_key=False):
        super().__init__()
        self.extra_key = extra_key

    def forward(self, x):
        report = {"xmean": F.mean(x), "rank": float(COMM.rank)}
        if self.extra_key:
            report["only_here"] = 1.0
        chainer.report(report, self)
        return F.mean(x)


def evaluation_data(rank):
    return np.random.RandomState(70 + rank).standard_normal((6, 2)).astype(np.float32)


def case_multi_node_evaluator_reports_mean_over_ranks(hvd):
    from chainer.training import extensions

    it = chainer.iterators.SerialIterator(evaluation_data(COMM.rank), 3, repeat=False,
                                          shuffle=False)
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(it, _Probe()), COMM)
    result = evaluator()
    # Each rank: mean over its 2 batches of the batch means; then mean over ranks.
    local = [np.mean([b.mean() for b in np.split(evaluation_data(r), 2)])
             for r in range(COMM.size)]
    np.testing.assert_allclose(result["main/xmean"], np.mean(local), rtol=1e-6)
    np.testing.assert_allclose(result["main/rank"], (COMM.size - 1) / 2.0)
    again = evaluator()  # the iterator is reset: same result
    np.testing.assert_allclose(again["main/xmean"], result["main/xmean"])


def case_multi_node_evaluator_with_different_keys_raises_on_every_rank(hvd):
    from chainer.training import extensions

    it = chainer.iterators.SerialIterator(evaluation_data(COMM.rank), 3, repeat=False,
                                          shuffle=False)
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(it, _Probe(extra_key=COMM.rank == 0)), COMM)
    exc = expect_raises(ValueError, evaluator)
    assert "only_here" in str(exc)


class _Adder(chainer.Chain):
    def forward(self, a, b, c):
        return a + b + c


def _generic_share(rank, size, length):
    """ChainerMN's own test data: rank r holds r, r + size, ... below length."""
    part = list(range(rank, length, size))
    return chainer.datasets.TupleDataset(part, part, part)


def _expected_rounds(size, length, batch):
    """What the root should get: round k holds each rank's k-th batch result,
    in rank order, for the ranks that still have one."""
    shares = [[np.asarray(3 * np.asarray(list(range(r, length, size))[i:i + batch]))
               for i in range(0, len(range(r, length, size)), batch)] for r in range(size)]
    out = []
    for k in range(max(len(s) for s in shares)):
        out.extend(s[k] for s in shares if k < len(s))
    return out


def case_generic_evaluator_gives_the_root_every_result_in_round_order(hvd):
    # Shares of different sizes, more and fewer rounds than the check interval.
    for length, batch in [(97, 7), (9, 77), (200, 3)]:
        it = chainer.iterators.SerialIterator(_generic_share(COMM.rank, COMM.size, length),
                                              batch, repeat=False, shuffle=False)
        evaluator = chainermn.extensions.GenericMultiNodeEvaluator(COMM, it, _Adder())
        results = evaluator(None)
        again = evaluator(None)  # the iterator is reset: the same results
        if COMM.rank != 0:
            assert results is None and again is None
            continue
        expected = _expected_rounds(COMM.size, length, batch)
        assert len(results) == len(expected), (length, batch, len(results), len(expected))
        for got, want in zip(results, expected):
            assert_equal(np.asarray(getattr(got, "array", got)), want, f"{length}/{batch}")
        assert len(again) == len(results)


class _CountingEvaluator(chainermn.extensions.GenericMultiNodeEvaluator):
    def calc_local(self, a, b, c):
        return None if COMM.rank == 1 else len(a)  # None is a result too

    def aggregate(self, results):
        self.aggregated = getattr(self, "aggregated", 0) + 1
        return results


def case_generic_evaluator_keeps_none_results_and_runs_hooks_on_the_root(hvd):
    root = COMM.size - 1
    # Rank 0 has no data at all; the others have 2, 3, ... batches of 4.
    # (Chainer's SerialIterator cannot hold an empty dataset: rank 0 gives a
    # plain iterator, which the evaluator copies instead of resetting.)
    length = 4 * (COMM.rank + 1)
    data = chainer.datasets.TupleDataset(*([np.arange(length, dtype=np.float32)] * 3))
    it = (iter([]) if COMM.rank == 0 else
          chainer.iterators.SerialIterator(data, 4, repeat=False, shuffle=False))
    seen = []
    evaluator = _CountingEvaluator(COMM, it, None, root=root, progress_hook=seen.append)
    results = evaluator()
    if COMM.rank != root:
        assert results is None and seen == [] and not hasattr(evaluator, "aggregated")
        return
    assert evaluator.aggregated == 1
    assert len(seen) == root + 1  # the root's own batches only
    expected = []
    for k in range(COMM.size):
        expected.extend(None if r == 1 else 4 for r in range(1, COMM.size) if k < r + 1)
    assert results == expected, (results, expected)


def case_generic_evaluator_refuses_a_root_outside_the_communicator(hvd):
    it = chainer.iterators.SerialIterator([1, 2], 1, repeat=False)
    exc = expect_raises(ValueError, chainermn.extensions.GenericMultiNodeEvaluator,
                        COMM, it, None, root=COMM.size)
    assert f"root {COMM.size}" in str(exc)


# ------------------------------------------------------------- checkpointer
def case_checkpointer_keeps_newest_and_resumes_from_newest_common(hvd):
    path = COMM.bcast_obj(tempfile.mkdtemp(prefix="chainer-ckpt-") if COMM.rank == 0 else None)
    try:
        cp = chainermn.create_multi_node_checkpointer("run", COMM, cp_interval=2,
                                                      gc_interval=2, path=path)
        model = make_model(seed=0)
        for it in range(1, 8):
            model.l1.b.array[...] = it + 100 * COMM.rank
            cp.save(model, it)
        mine = sorted(f for f in os.listdir(path) if f.startswith(f"run.{COMM.rank}."))
        assert mine == [f"run.{COMM.rank}.{i}" for i in (5, 6, 7)], mine
        assert "avg=" in cp.get_stats()

        fresh = make_model(seed=1)
        loaded = chainermn.create_multi_node_checkpointer("run", COMM, path=path).maybe_load(fresh)
        assert loaded == 7
        np.testing.assert_array_equal(fresh.l1.b.array, 7 + 100 * COMM.rank)

        COMM.mpi_comm.Barrier()
        if COMM.rank == COMM.size - 1:  # this rank lost its newest snapshot
            os.remove(os.path.join(path, f"run.{COMM.rank}.7"))
        COMM.mpi_comm.Barrier()
        fresh = make_model(seed=1)
        resume = chainermn.create_multi_node_checkpointer("run", COMM, path=path)
        assert resume.maybe_load(fresh) == 6
        np.testing.assert_array_equal(fresh.l1.b.array, 6 + 100 * COMM.rank)
        resume.finalize()
        COMM.mpi_comm.Barrier()
        # finalize removed the snapshots it kept track of (5 and 6, the newest
        # common ones); 7 was not common, so the ranks that have it keep it.
        left = [f for f in os.listdir(path) if f.startswith(f"run.{COMM.rank}.")]
        assert left == ([] if COMM.rank == COMM.size - 1 else [f"run.{COMM.rank}.7"]), left
    finally:
        COMM.mpi_comm.Barrier()
        if COMM.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------- batch normalization
def case_multi_node_batch_normalization_equals_full_batch(hvd):
    n, me, m, c = COMM.size, COMM.rank, 4, 3
    rng = np.random.RandomState(90)
    x_all = rng.standard_normal((n * m, c)) * 2.0 + 1.0
    w_all = rng.standard_normal((n * m, c))
    part = slice(me * m, (me + 1) * m)

    mnbn = chainermn.MultiNodeBatchNormalization(c, COMM, dtype=np.float64)
    x = chainer.Variable(x_all[part].copy())
    y = mnbn(x)
    F.sum(y * w_all[part]).backward()

    ref = L.BatchNormalization(c, dtype=np.float64)
    ref.avg_var[...] = 0.0  # as the multi-node link starts
    x_ref = chainer.Variable(x_all.copy())
    y_ref = ref(x_ref)
    F.sum(y_ref * w_all).backward()

    np.testing.assert_allclose(y.array, y_ref.array[part], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(x.grad, x_ref.grad[part], rtol=1e-8, atol=1e-10)
    # gamma's and beta's gradients: the mean over ranks of the per-rank sums.
    np.testing.assert_allclose(mnbn.gamma.grad, ref.gamma.grad / n, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(mnbn.beta.grad, ref.beta.grad / n, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(mnbn.avg_mean, ref.avg_mean, rtol=1e-10)
    # The unbiased correction of the running variance uses the local count m.
    np.testing.assert_allclose(mnbn.avg_var, 0.1 * x_all.var(axis=0) * m / (m - 1),
                               rtol=1e-10)
    with chainer.using_config("train", False):
        np.testing.assert_allclose(
            mnbn(x_all[part]).array,
            (x_all[part] - mnbn.avg_mean) / np.sqrt(mnbn.avg_var + 2e-5), rtol=1e-8)


def case_a_link_only_rank_0_built_does_not_stall_the_others_normalizing(hvd):
    # The links' allreduces were named after how many links the process had
    # made, so a spare one on rank 0 (a model kept for export) left rank 0's
    # training link named .1 and the others' .0: a stall, then DeadlockError.
    # ChainerMN matches them by MPI's call order.
    n, me, m, c = COMM.size, COMM.rank, 3, 2
    if me == 0:
        chainermn.MultiNodeBatchNormalization(c, COMM, dtype=np.float64)  # never called
    mnbn = chainermn.MultiNodeBatchNormalization(c, COMM, dtype=np.float64)
    x_all = np.random.RandomState(91).standard_normal((n * m, c))
    y = mnbn(x_all[me * m:(me + 1) * m])
    expected = (x_all - x_all.mean(axis=0)) / np.sqrt(x_all.var(axis=0) + 2e-5)
    np.testing.assert_allclose(y.array, expected[me * m:(me + 1) * m], rtol=1e-8)


def case_allreduce_persistent_averages_float_persistents(hvd):
    bn = L.BatchNormalization(2)
    bn.avg_mean[...] = COMM.rank
    bn.N = 5 + COMM.rank
    chainermn.extensions.AllreducePersistent(bn, COMM)()
    np.testing.assert_allclose(bn.avg_mean, (COMM.size - 1) / 2.0)
    assert bn.N == 5 + COMM.rank  # integers are left alone


# ---------------------------------------------------------------- iterators
def case_synchronized_iterator_gives_every_rank_the_same_shuffled_batches(hvd):
    it = chainermn.create_synchronized_iterator(
        chainer.iterators.SerialIterator(np.arange(20), 4, shuffle=True), COMM)
    batches = [[int(v) for v in it.next()] for _ in range(10)]
    everyone = COMM.mpi_comm.allgather(batches)
    assert all(b == batches for b in everyone)
    first_epoch = [v for b in batches[:5] for v in b]
    assert sorted(first_epoch) == list(range(20)) and first_epoch != list(range(20))
    # It stands in for the iterator it wraps: attributes and serialization.
    actual = it.actual_iterator
    assert it.batch_size == 4 and it.epoch == actual.epoch == 2
    it.batch_size = 5
    assert actual.batch_size == 5
    saved = chainer.serializers.DictionarySerializer()
    it.serialize(saved)
    assert int(saved.target["epoch"]) == 2
    assert int(saved.target["current_position"]) == actual.current_position


def case_multi_node_iterator_shares_the_master_batches(hvd):
    from frontends.chainer.iterators import multi_node

    inline = multi_node.INLINE_BYTES
    try:
        for limit in (inline, 0):  # inside the header, then as broadcasts after it
            multi_node.INLINE_BYTES = limit
            _shares_the_master_batches()
    finally:
        multi_node.INLINE_BYTES = inline


def _shares_the_master_batches():
    master = COMM.size - 1
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    y = np.arange(10, dtype=np.int32) % 3
    if COMM.rank == master:
        actual = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, y), 4,
                                                  repeat=False, shuffle=False)
    else:
        actual = None
    it = chainermn.create_multi_node_iterator(actual, COMM, rank_master=master)
    seen = []
    while True:
        try:
            b = it.next()
        except StopIteration:
            break
        seen.append(b)
        assert it.epoch_detail > 0
    assert [len(b) for b in seen] == [4, 4, 2]
    flat = [ex for b in seen for ex in b]
    for i, (xi, yi) in enumerate(flat):
        assert_equal(xi, x[i])
        assert np.asarray(yi).dtype == np.int32 and int(yi) == y[i]
    assert it.epoch == 1 and it.is_new_epoch


def case_multi_node_iterator_refuses_batches_it_cannot_send_on_every_rank(hvd):
    actual = (chainer.iterators.SerialIterator(["ab", "cd", "ef"], 2, shuffle=False)
              if COMM.rank == 0 else None)
    it = chainermn.create_multi_node_iterator(actual, COMM)
    exc = expect_raises(TypeError, it.next)
    assert "cannot be sent" in str(exc), str(exc)


def case_multi_node_iterator_state_saved_on_any_rank_loads_into_a_chainer_iterator(hvd):
    # ChainerMN's serialize is collective and the other ranks save the
    # master's state, its shuffled order included (they kept only counters).
    master = 0
    data = np.arange(12, dtype=np.float32)
    actual = (chainer.iterators.SerialIterator(data, 4, shuffle=True)
              if COMM.rank == master else None)
    it = chainermn.create_multi_node_iterator(actual, COMM, rank_master=master)
    for _ in range(4):  # into the second epoch (the next batch does not end it)
        it.next()
    saved = chainer.serializers.DictionarySerializer()
    it.serialize(saved)
    truth = COMM.bcast_obj((it.epoch_detail, it._order if COMM.rank != master
                            else actual._state.order), root=master)
    fresh = chainer.iterators.SerialIterator(data, 4, shuffle=True)
    fresh.serialize(chainer.serializers.NpzDeserializer(saved.target))
    assert fresh.epoch_detail == truth[0] == it.epoch_detail
    np.testing.assert_array_equal(fresh._state.order, truth[1])
    # Loading: every rank takes the master's state from the master's snapshot.
    expected_next = COMM.bcast_obj(fresh.next() if COMM.rank == master else None, root=master)
    master_saved = COMM.bcast_obj(saved.target, root=master)
    it.serialize(chainer.serializers.NpzDeserializer(master_saved))
    assert it.epoch_detail == truth[0]
    got = it.next()
    assert [float(v) for v in got] == [float(v) for v in expected_next]


def case_create_mnbn_model_swaps_batch_normalization_and_keeps_its_state(hvd):
    n, me, m = COMM.size, COMM.rank, 4
    with chainer.using_config("dtype", np.float64):
        model = chainer.Sequential(L.Linear(3, 3, initialW=np.eye(3)), L.BatchNormalization(3))
        model[1].gamma.array[...] = [1.0, 2.0, 3.0]
        model[1].avg_mean[...] = 5.0
    mn = chainermn.links.create_mnbn_model(model, COMM)
    assert isinstance(mn[1], chainermn.MultiNodeBatchNormalization)
    assert isinstance(model[1], L.BatchNormalization)  # the original is untouched
    np.testing.assert_array_equal(mn[1].gamma.array, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(mn[1].avg_mean, 5.0)
    x_all = np.random.RandomState(91).standard_normal((n * m, 3))
    y = mn(x_all[me * m:(me + 1) * m]).array
    y_full = model(x_all).array  # the original, on the whole global batch
    np.testing.assert_allclose(y, y_full[me * m:(me + 1) * m], rtol=1e-10, atol=1e-12)


class _FakeTrainer:
    def __init__(self):
        self.observation = {}
        self.communicate = False


def case_observation_aggregator_averages_every_rank_history(hvd):
    agg = chainermn.extensions.ObservationAggregator(
        COMM, "main/loss", "main/global_loss", comm_trigger=lambda t: t.communicate)
    trainer = _FakeTrainer()
    for step, communicate in ((0, False), (1, True)):
        trainer.observation = {"main/loss": chainer.Variable(np.array(COMM.rank + 10.0 * step))}
        trainer.communicate = communicate
        agg(trainer)
    values = [r + 10.0 * s for r in range(COMM.size) for s in (0, 1)]
    np.testing.assert_allclose(trainer.observation["main/global_loss"], np.mean(values))
