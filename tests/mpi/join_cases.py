"""join(), as Horovod 0.28.1 defines it (run by tests/test_join_mpi.py).

A joined rank takes part in the other ranks' allreduces with zeros (Average
still divides by the whole set); every other collective raises on every rank
that calls it while a rank has joined. Each case runs with every rank in turn
joining first, then goes on with more collectives in the same process.
"""

import shutil

import numpy as np

from core_cases import (BF16, REDUCE_DTYPES, assert_equal, data, expect_raises, shared_dir,
                        wait_for_marks)
from peers import join_with_a_mark, joins_marked, rank0_drops_cache_ids

SHAPES = [(), (3,), (2, 3), (2, 1, 2)]


def _refused(hvd, fn, *args, **kwargs):
    exc = expect_raises(hvd.HorovodInternalError, fn, *args, **kwargs)
    return str(exc)


def case_collectives_other_than_allreduce_raise_while_a_rank_has_joined(hvd):
    n, me = hvd.size(), hvd.rank()
    for joiner in range(n):
        if me == joiner:
            last = hvd.join()
        else:
            root = min(r for r in range(n) if r != joiner)
            calls = [
                ("allgather", lambda: hvd.allgather(np.ones((2, 1)), name="j.gather")),
                ("broadcast", lambda: hvd.broadcast(np.ones(3), root_rank=root,
                                                    name="j.bcast")),
                ("alltoall", lambda: hvd.alltoall(np.ones(n), name="j.a2a")),
                ("reducescatter", lambda: hvd.reducescatter(np.ones((n, 2)), name="j.rs")),
                ("grouped_allgather", lambda: hvd.grouped_allgather(
                    [np.ones((1, 2)), np.ones((2, 2))], name="j.ggather")),
            ]
            for what, call in calls:
                text = _refused(hvd, call)
                assert f"rank {joiner} has joined" in text, (what, text)
            # Allreduce still works, with zeros from the joined rank.
            out = hvd.allreduce(np.full(2, me + 1.0), op=hvd.Sum, name="j.sum")
            assert_equal(out, np.full(2, sum(r + 1.0 for r in range(n) if r != joiner)))
            last = hvd.join()
        assert last in range(n)
        # Everyone is back: the same names and others work again.
        gathered = hvd.allgather(np.full((1,), me, np.int32), name="j.gather")
        assert_equal(gathered, np.arange(n, dtype=np.int32))
        b = hvd.broadcast(np.full(2, me, np.int64), root_rank=joiner, name="j.after")
        assert_equal(b, np.full(2, joiner, np.int64))
        rs = hvd.reducescatter(np.ones((n, 2)), op=hvd.Sum, name="j.rs")
        assert_equal(rs, np.full((1, 2), float(n)))


def _reduce_dtypes():
    return REDUCE_DTYPES + ([BF16] if BF16 is not None else [])


def _expected(dtype, shape, op, joiner, n, seed):
    total = sum(data(r, shape, dtype, seed).astype(np.float64)
                for r in range(n) if r != joiner)
    if op == "avg":
        total = total / n
        if np.dtype(dtype).kind in "iu":
            total = np.trunc(total)
    return np.asarray(total).astype(dtype)


def case_join_with_cached_names_every_dtype_dimension_and_op(hvd):
    """Both ranks reduce `a` and `b` once (so the names are cached); then one
    rank joins while the others reduce them again: the joined rank
    contributes zeros and Average divides by the set size."""
    n, me = hvd.size(), hvd.rank()
    ops = {"sum": hvd.Sum, "avg": hvd.Average}
    seed = 0
    for joiner in range(n):
        for dtype in _reduce_dtypes():
            for shape in SHAPES:
                for op_a, op_b in (("sum", "avg"), ("avg", "sum"), ("sum", "sum")):
                    seed += 2
                    a = data(me, shape, dtype, seed)
                    b = data(me, shape, dtype, seed + 1)
                    what = f"joiner {joiner} {np.dtype(dtype)} {shape} {op_a}/{op_b}"
                    # Warm the cache: every rank reduces both.
                    ha = hvd.allreduce_async(a, op=ops[op_a], name="c.a")
                    hb = hvd.allreduce_async(b, op=ops[op_b], name="c.b")
                    hvd.synchronize(ha)
                    hvd.synchronize(hb)
                    if me == joiner:
                        hvd.join()
                        continue
                    ha = hvd.allreduce_async(a, op=ops[op_a], name="c.a")
                    hb = hvd.allreduce_async(b, op=ops[op_b], name="c.b")
                    ra, rb = hvd.synchronize(ha), hvd.synchronize(hb)
                    _close(ra, _expected(dtype, shape, op_a, joiner, n, seed), what + " a")
                    _close(rb, _expected(dtype, shape, op_b, joiner, n, seed + 1), what + " b")
                    hvd.join()


def _close(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    tol = 0.02 if actual.dtype in (np.float16, BF16) else 1e-6
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               rtol=tol, atol=tol, err_msg=what)


def case_grouped_allreduce_after_others_joined_keeps_every_ranks_cache_in_step(hvd):
    """A grouped allreduce of new names that one rank runs while the others
    have joined: every rank stores the same cache entries for its members
    (the joined ones from their stand-ins, group included), so the cycles of
    the next steps agree and reduce them again."""
    n, me = hvd.size(), hvd.rank()
    runner = n - 1
    for i in range(2):  # "j.solo" is cached on every rank
        assert_equal(hvd.allreduce(np.ones(3), op=hvd.Sum, name="j.solo"), np.full(3, n * 1.0))
    if me == runner:
        outs = hvd.grouped_allreduce([np.full(2, 1.0), np.full(3, 2.0)], op=hvd.Sum,
                                     name="j.group")
        assert_equal(outs[0], np.full(2, 1.0))
        assert_equal(outs[1], np.full(3, 2.0))
        assert_equal(hvd.allreduce(np.ones(3), op=hvd.Sum, name="j.solo"), np.ones(3))
    assert hvd.join() == runner
    for step in range(3):  # now in cycles, on every rank
        outs = hvd.grouped_allreduce([np.full(2, me + 1.0), np.full(3, step + 0.0)],
                                     op=hvd.Sum, name="j.group")
        assert_equal(outs[0], np.full(2, sum(r + 1.0 for r in range(n))))
        assert_equal(outs[1], np.full(3, n * step + 0.0))
        assert_equal(hvd.allreduce(np.ones(3), op=hvd.Sum, name="j.solo"), np.full(3, n * 1.0))


def case_an_allreduce_pending_at_the_last_join_gets_zeros_from_the_joined(hvd):
    """The last rank to join submits allreduces and joins at once, so that
    they are negotiated together with its join: they complete with the
    joined ranks' zeros, and the job goes on. They were planned after the
    controller had forgotten who had joined, so no zeros stood in: every
    rank failed, 'rank 1 was asked to run allreduce of tensor ..., which it
    never submitted ... the job cannot go on'."""
    n, me = hvd.size(), hvd.rank()
    runner = n - 1
    marks = shared_dir(hvd, "pending")
    for step in range(3):
        if me == runner:
            wait_for_marks(marks, joins_marked(step, range(n - 1)))
            handles = [hvd.allreduce_async(np.full(2, 5.0 + step), op=hvd.Sum,
                                           name=f"j.last.{step}"),
                       hvd.allreduce_async(np.full(3, 6.0), op=hvd.Average,
                                           name=f"j.last.avg.{step}"),
                       hvd.grouped_allreduce_async([np.ones(1), np.full(2, 2.0)], op=hvd.Sum,
                                                   name=f"j.last.group.{step}")]
            assert hvd.join() == runner
        else:
            assert join_with_a_mark(hvd, marks, step) == runner
        if me == runner:
            assert_equal(hvd.synchronize(handles[0]), np.full(2, 5.0 + step))
            assert_equal(hvd.synchronize(handles[1]), np.full(3, 6.0 / n))
            outs = hvd.synchronize(handles[2])
            assert_equal(outs[0], np.ones(1))
            assert_equal(outs[1], np.full(2, 2.0))
        assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="j.after"), np.full(2, n * 1.0))
    if me == runner:
        shutil.rmtree(marks, ignore_errors=True)


def case_an_allreduce_by_an_evicted_cache_id_with_the_last_join_gets_the_zeros(hvd):
    """The last rank to join submits a cached allreduce and joins at once,
    and rank 0 has evicted the tensor's cache id by the time it reads that
    rank's list (here rank 0 drops the ids of a list that carries a join
    just before reading it; in a job, another set's new tensors evict it
    before the rank hears). A list with a join describes every request in
    full: sent by its id, the allreduce was asked for again and came after
    the join had completed, the others gone on (random_join.py, seed 207,
    4 ranks, a cache of two, hung every time)."""
    n, me = hvd.size(), hvd.rank()
    runner = n - 1
    for _ in range(2):  # cached on every rank
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="j.evicted")
    marks = shared_dir(hvd, "evicted")
    with rank0_drops_cache_ids(hvd, runner, with_join=True):
        for step in range(4):
            if me == runner:
                wait_for_marks(marks, joins_marked(step, range(n - 1)))
                handle = hvd.allreduce_async(np.full(2, step + 1.0), op=hvd.Sum,
                                             name="j.evicted")
                assert hvd.join() == runner
                assert_equal(hvd.synchronize(handle), np.full(2, step + 1.0))
            else:
                assert join_with_a_mark(hvd, marks, step) == runner
            hvd.barrier()
    if me == runner:
        shutil.rmtree(marks, ignore_errors=True)


def case_the_last_join_takes_along_an_allreduce_waiting_in_the_cycle(hvd):
    """The last rank to join submits a tensor it has submitted before (so it
    waits in a negotiation cycle's slot) and joins at once. The allreduce
    goes to rank 0 with the join, ahead of it, and completes with the
    joined ranks' zeros. It used to stay in the cycle, which no other rank
    posts once it has joined: the join never completed, and every rank
    waited until the deadlock check (helper-26's probe hung 5 runs in 5)."""
    n, me = hvd.size(), hvd.rank()
    runner = n - 1
    marks = shared_dir(hvd, "cycled")
    for step in range(6):
        if me == runner:
            wait_for_marks(marks, joins_marked(step, range(n - 1)))
            handle = hvd.allreduce_async(np.full(2, step + 1.0), op=hvd.Sum, name="j.cycled")
            assert hvd.join() == runner
            assert_equal(hvd.synchronize(handle), np.full(2, step + 1.0))
        else:
            assert join_with_a_mark(hvd, marks, step) == runner
        hvd.barrier()
    if me == runner:
        shutil.rmtree(marks, ignore_errors=True)
