"""Point-to-point send/recv through the coordinator (run by
tests/test_p2p_mpi.py): negotiated like any operation, so a name pairs a
send with its recv, the receiver learns dtype and shape from the sender, and
a missing peer is a stall, not a hang."""

import time

import numpy as np

from core_cases import ALL_DTYPES, BF16, assert_equal, data, expect_raises


def case_ring_of_sends_every_dtype_and_shape(hvd):
    n, me = hvd.size(), hvd.rank()
    right, left = (me + 1) % n, (me - 1) % n
    dtypes = ALL_DTYPES + ([BF16] if BF16 is not None else [])
    for i, dtype in enumerate(dtypes):
        for shape in [(), (0,), (5,), (2, 3, 4)]:
            seed = 10 * i + len(shape)
            hs = hvd.send_async(data(me, shape, dtype, seed), right, name="ring")
            got = hvd.recv(left, name="ring")
            hvd.synchronize(hs)
            assert_equal(got, data(left, shape, dtype, seed), f"{np.dtype(dtype)} {shape}")


def case_unnamed_sends_pair_in_program_order(hvd):
    n, me = hvd.size(), hvd.rank()
    if me == 0:
        handles = [hvd.send_async(np.full(3, float(k)), 1) for k in range(5)]
        for h in handles:
            assert hvd.synchronize(h) is None
    elif me == 1:
        time.sleep(0.2)  # the sends are in flight first
        for k in range(5):
            assert_equal(hvd.recv(0), np.full(3, float(k)))


def case_recv_posted_before_the_send(hvd):
    me = hvd.rank()
    if me == 1:
        h = hvd.recv_async(0, name="early")
        assert_equal(hvd.synchronize(h), np.arange(6, dtype=np.int64).reshape(2, 3))
    elif me == 0:
        time.sleep(0.3)
        hvd.send(np.arange(6, dtype=np.int64).reshape(2, 3), 1, name="early")


def case_the_same_name_between_other_pairs_is_another_tensor(hvd):
    n, me = hvd.size(), hvd.rank()
    # Everyone sends "x" to everyone else, then receives "x" from everyone.
    handles = [hvd.send_async(np.full(2, 10 * me + peer), peer, name="x")
               for peer in range(n) if peer != me]
    for peer in range(n):
        if peer != me:
            assert_equal(hvd.recv(peer, name="x"), np.full(2, 10 * peer + me))
    for h in handles:
        hvd.synchronize(h)


def case_invalid_peers_are_value_errors(hvd):
    me = hvd.rank()
    exc = expect_raises(ValueError, hvd.send, np.ones(2), me, name="self")
    assert "cannot send to itself" in str(exc)
    exc = expect_raises(ValueError, hvd.recv, hvd.size() + 3, name="nobody")
    assert "invalid peer rank" in str(exc)


def case_large_message_inside_a_process_set(hvd):
    from coordinator import runtime

    if hvd.size() < 3:
        return
    me = hvd.rank()
    pair = hvd.ProcessSet([0, 2])
    # Sets are added by every rank; only members use it.
    hvd.add_process_set(pair) if runtime.current().dynamic_process_sets else None
    if pair.process_set_id is None:
        return
    if me == 0:
        hvd.send(np.arange(3_000_000, dtype=np.float32), 2, name="big", process_set=pair)
    elif me == 2:
        assert_equal(hvd.recv(0, name="big", process_set=pair),
                     np.arange(3_000_000, dtype=np.float32))
    hvd.remove_process_set(pair)


def case_the_first_send_of_a_set_needs_no_other_member(hvd):
    """A set of three ranks whose first operation is a send/recv between two
    of them, while the third waits elsewhere (on plain MPI, not the
    coordinator): the set's communicator was made on its first operation,
    by every member, so the two waited for ever for the third (now it is
    started as the set is added)."""
    from mpi4py import MPI

    if hvd.size() < 4:  # (run at np=4 by test_p2p_mpi.py)
        return
    me = hvd.rank()
    trio = hvd.add_process_set([0, 1, 2])
    if me in (0, 1):
        if me == 0:
            hvd.send(np.arange(5, dtype=np.int64), 1, name="first", process_set=trio)
        else:
            assert_equal(hvd.recv(0, name="first", process_set=trio),
                         np.arange(5, dtype=np.int64))
    if me == 0:
        for rank in range(1, hvd.size()):
            MPI.COMM_WORLD.send("done", dest=rank, tag=78)
    else:
        assert MPI.COMM_WORLD.recv(source=0, tag=78) == "done"
    # the set still works for all its members afterwards
    if me < 3:
        total = hvd.allreduce(np.full(2, me, np.float64), op=hvd.Sum, name="after",
                              process_set=trio)
        assert_equal(total, np.full(2, 3.0))
    hvd.remove_process_set(trio)
