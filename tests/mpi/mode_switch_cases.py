"""Cycles switched back on while tensors are on their way (run by
tests/test_mode_switch_mpi.py with the stall check disabled, so that nothing
but the negotiation itself can resolve them).

A rank takes a cached tensor for the cycle or for a round by the parameters
it holds at that moment. When cycles come back on (rank 0's timeline
stopped, every rank joined), one rank can take a tensor just before the
switch (described in a round) and another just after (its cycle bit set).
Before, neither path completed until the stall report, 30 s later, or never
with HOROVOD_STALL_CHECK_DISABLE."""

import os
import tempfile

import numpy as np


def _warm(hvd, names, shape):
    for _ in range(2):
        for name in names:
            hvd.allreduce(np.zeros(shape), name=name, op=hvd.Sum)


def _switch_back_and_run(hvd, shape, tag):
    """Rank 0 submits x and y right after stopping its timeline; the other
    ranks run y first and x only once y is done, after the round that turned
    cycles back on."""
    rank, size = hvd.rank(), hvd.size()
    x, y = f"{tag}.x", f"{tag}.y"
    _warm(hvd, [x, y, f"{tag}.z"], shape)
    path = os.path.join(tempfile.gettempdir(), f"mode_switch_{os.getpid()}_{tag}.json")
    if rank == 0:
        hvd.start_timeline(path)
    hvd.allreduce(np.zeros(shape), name=f"{tag}.z", op=hvd.Sum)  # rounds from here on
    if rank == 0:
        hvd.stop_timeline()
        hx = hvd.allreduce_async(np.full(shape, 1.0 + rank), name=x, op=hvd.Sum)
        hy = hvd.allreduce_async(np.full(shape, 10.0 + rank), name=y, op=hvd.Sum)
        got_y, got_x = hvd.synchronize(hy), hvd.synchronize(hx)
    else:
        got_y = hvd.allreduce(np.full(shape, 10.0 + rank), name=y, op=hvd.Sum)
        got_x = hvd.allreduce(np.full(shape, 1.0 + rank), name=x, op=hvd.Sum)
    np.testing.assert_array_equal(got_x, np.full(shape, sum(1.0 + r for r in range(size))))
    np.testing.assert_array_equal(got_y, np.full(shape, sum(10.0 + r for r in range(size))))
    if rank == 0 and os.path.exists(path):
        os.remove(path)


def case_tensors_taken_on_both_sides_of_the_timeline_stopping_meet(hvd):
    _switch_back_and_run(hvd, (32,), "big")


def case_riders_taken_on_both_sides_of_the_timeline_stopping_meet(hvd):
    _switch_back_and_run(hvd, (2,), "tiny")


def case_groups_taken_on_both_sides_of_the_timeline_stopping_meet(hvd):
    """As above, x and y each a group of two (a group waits in the cycle
    whole, so rank 0 sees its members wait for ranks in a round)."""
    rank, size = hvd.rank(), hvd.size()
    shape = (32,)
    x = lambda v: [np.full(shape, v + rank), np.full(shape, 2 * v + rank)]
    want = lambda v: [np.full(shape, sum(v + r for r in range(size))),
                      np.full(shape, sum(2 * v + r for r in range(size)))]
    for _ in range(2):
        for name in ("gx", "gy", "gz"):
            hvd.grouped_allreduce(x(0.0), name=name, op=hvd.Sum)
    path = os.path.join(tempfile.gettempdir(), f"mode_switch_{os.getpid()}_groups.json")
    if rank == 0:
        hvd.start_timeline(path)
    hvd.grouped_allreduce(x(0.0), name="gz", op=hvd.Sum)  # rounds from here on
    if rank == 0:
        hvd.stop_timeline()
        hx = hvd.grouped_allreduce_async(x(1.0), name="gx", op=hvd.Sum)
        hy = hvd.grouped_allreduce_async(x(10.0), name="gy", op=hvd.Sum)
        got_y, got_x = hvd.synchronize(hy), hvd.synchronize(hx)
    else:
        got_y = hvd.grouped_allreduce(x(10.0), name="gy", op=hvd.Sum)
        got_x = hvd.grouped_allreduce(x(1.0), name="gx", op=hvd.Sum)
    for got, expected in zip(got_x + got_y, want(1.0) + want(10.0)):
        np.testing.assert_array_equal(got, expected)
    if rank == 0 and os.path.exists(path):
        os.remove(path)


def case_tensors_after_a_join_meet(hvd):
    """Rank 0 joins last; the others submit x as soon as their join returns,
    rank 0 a moment later."""
    rank, size = hvd.rank(), hvd.size()
    _warm(hvd, ["join.x"], (32,))
    for step in range(5):
        if rank != 0:
            hvd.join()
            got = hvd.allreduce(np.full(32, 1.0 + rank), name="join.x", op=hvd.Sum)
        else:
            hvd.allreduce(np.full(32, 0.0), name="join.w", op=hvd.Sum)  # with joined ranks
            hvd.join()
            got = hvd.allreduce(np.full(32, 1.0 + rank), name="join.x", op=hvd.Sum)
        np.testing.assert_array_equal(got, np.full(32, sum(1.0 + r for r in range(size))))
