"""Multi-rank cases for the core API over NumPy (run by tests/test_core_mpi.py).

Every rank can compute every other rank's input (`data`), so each case checks
its result against the NumPy computation of the expected value.
"""

import os
import shutil
import tempfile
import time

import numpy as np
from peers import marked, while_in_flight

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

REDUCE_DTYPES = [np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32,
                 np.float64]
ALL_DTYPES = REDUCE_DTYPES + [np.bool_]


def data(rank, shape, dtype, seed=0):
    """Rank `rank`'s input: small integers, exact in every dtype."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)
    return rng.integers(-8, 8, size=shape).astype(np.float32).astype(dtype)


def all_data(hvd, shape, dtype, seed=0):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def assert_equal(actual, expected, what=""):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual.astype(np.float64) if actual.dtype == BF16 else actual,
                                  expected.astype(np.float64) if expected.dtype == BF16
                                  else expected, err_msg=what)


# Events that cases wait for, not sleep on: the ranks share a machine (and a
# clock), but a loaded one may run any of them seconds late.
WAIT = 40.0  # seconds: far above a slow machine, below the cases' timeouts


def owing(hvd, what):
    """Waits until this rank's background thread holds the notice of an
    operation that failed before this rank submitted its copy (owed.py), as
    for a rank that comes to it after the others' stall or refusal: its
    copy then fails at once. `what`: the operation, for the message."""
    from coordinator import runtime

    bg = runtime.current().background
    deadline = time.monotonic() + WAIT
    while not bg.owed:
        assert time.monotonic() < deadline, f"{what} never failed without this rank"
        time.sleep(0.005)
    return bg


def shared_dir(hvd, name):
    """A directory every rank of the job knows (made by rank 0), for marks
    that ranks which cannot talk through the coordinator leave each other."""
    made = tempfile.mkdtemp(prefix=f"{name}-") if hvd.rank() == 0 else None
    return hvd.broadcast_object(made, name=f"{name}.dir")


def wait_for_marks(directory, marks, remove=False):
    """Waits until every mark in `marks` is in `directory` (leave_mark);
    removes the directory after, if asked (its last reader)."""
    assert marked(directory, marks, WAIT), (sorted(os.listdir(directory)), marks)
    if remove:
        shutil.rmtree(directory, ignore_errors=True)


# ------------------------------------------------------------------ allreduce
def case_allreduce_every_dtype_and_op(hvd):
    n = hvd.size()
    for dtype in REDUCE_DTYPES:
        inputs = all_data(hvd, (3, 4), dtype, seed=1)
        mine = inputs[hvd.rank()]
        stacked = np.stack(inputs)
        expected = {
            hvd.Sum: stacked.sum(axis=0, dtype=dtype),
            hvd.Min: stacked.min(axis=0),
            hvd.Max: stacked.max(axis=0),
            hvd.Product: stacked.prod(axis=0, dtype=dtype),
        }
        for op, exp in expected.items():
            out = hvd.allreduce(mine, op=op, name=f"ar.{np.dtype(dtype).name}.{op}")
            assert_equal(out, exp.astype(dtype), f"{np.dtype(dtype).name} op {op}")
        avg = hvd.allreduce(mine, name=f"ar.{np.dtype(dtype).name}.avg")
        exp = stacked.astype(np.float64).sum(axis=0) / n
        if np.dtype(dtype).kind in "iu":
            exp = np.trunc(exp)
        np.testing.assert_allclose(avg.astype(np.float64), exp, rtol=1e-3,
                                   err_msg=f"average {np.dtype(dtype).name}")
        assert avg.dtype == np.dtype(dtype)


def case_small_integer_sums_wrap_at_every_length(hvd):
    """8- and 16-bit integer sums and products wrap as their arithmetic does,
    whatever the tensor's length: Open MPI 5's vectorized reduction saturated
    them from 16 elements on (int8: 127 where 8-bit arithmetic gives -56)."""
    n, me = hvd.size(), hvd.rank()
    for dtype in (np.int8, np.uint8, np.int16, np.uint16):
        info = np.iinfo(dtype)
        for length in (7, 17, 289, 5000):
            # Values near the top of the range: any two overflow.
            inputs = [(info.max - np.arange(length) % 7 - r).astype(dtype) for r in range(n)]
            want_sum = np.stack(inputs).sum(axis=0, dtype=dtype)  # (NumPy's wraps)
            what = f"{np.dtype(dtype).name}[{length}]"
            out = hvd.allreduce(inputs[me], op=hvd.Sum, name=f"wrap.sum.{what}")
            assert_equal(out, want_sum, f"sum {what}")
            prod = hvd.allreduce(inputs[me], op=hvd.Product, name=f"wrap.prod.{what}")
            assert_equal(prod, np.prod(np.stack(inputs), axis=0, dtype=dtype), f"product {what}")
            outs = hvd.grouped_allreduce([inputs[me], inputs[me][:5]], op=hvd.Sum,
                                         name=f"wrap.group.{what}")
            assert_equal(outs[0], want_sum, f"grouped sum {what}")
            assert_equal(outs[1], want_sum[:5], f"grouped sum {what} (short)")
            rows = inputs[me][:length - length % n].reshape(n, -1)
            scattered = hvd.reducescatter(rows, op=hvd.Sum, name=f"wrap.rs.{what}")
            assert_equal(scattered, want_sum[:length - length % n].reshape(n, -1)[me:me + 1],
                         f"reducescatter {what}")


def case_allreduce_bfloat16(hvd):
    if BF16 is None:
        return
    inputs = all_data(hvd, (17,), BF16, seed=2)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, name="ar.bf16")
    exp = np.stack([i.astype(np.float32) for i in inputs]).sum(axis=0).astype(BF16)
    assert_equal(out, exp, "bfloat16 sum")
    mx = hvd.allreduce(inputs[hvd.rank()], op=hvd.Max, name="ar.bf16.max")
    assert_equal(mx, np.stack(inputs).astype(np.float32).max(axis=0).astype(BF16), "bf16 max")


def case_allreduce_prescale_postscale(hvd):
    inputs = all_data(hvd, (10,), np.float64, seed=3)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=0.5,
                        postscale_factor=3.0, name="ar.scaled")
    np.testing.assert_allclose(out, 3.0 * sum(0.5 * i for i in inputs))
    avg = hvd.allreduce(inputs[hvd.rank()], op=hvd.Average, postscale_factor=2.0,
                        name="ar.scaled.avg")
    np.testing.assert_allclose(avg, 2.0 * sum(inputs) / hvd.size())


def case_allreduce_in_place_and_output(hvd):
    inputs = all_data(hvd, (4, 5), np.float32, seed=4)
    buf = inputs[hvd.rank()].copy()
    res = hvd.allreduce(buf, op=hvd.Sum, name="ar.inplace", output=buf)
    assert res is buf
    assert_equal(buf, np.sum(inputs, axis=0, dtype=np.float32))
    out = np.empty((4, 5), np.float32)
    res = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, name="ar.out", output=out)
    assert res is out
    assert_equal(out, np.sum(inputs, axis=0, dtype=np.float32))


def case_allreduce_scalar_and_empty(hvd):
    out = hvd.allreduce(np.float32(hvd.rank()), op=hvd.Sum, name="ar.scalar")
    assert out.shape == () and out == sum(range(hvd.size()))
    empty = hvd.allreduce(np.zeros((0, 3), np.float32), name="ar.empty")
    assert empty.shape == (0, 3)


def case_allreduce_any_submission_order(hvd):
    """Ranks submit the same names in different orders; negotiation is by name."""
    names = [f"order.{i}" for i in range(12)]
    order = names if hvd.rank() % 2 == 0 else names[::-1]
    handles = {nm: hvd.allreduce_async(np.full(3, int(nm.split(".")[1]) + hvd.rank(),
                                               np.int64), op=hvd.Sum, name=nm)
               for nm in order}
    n = hvd.size()
    for nm, h in handles.items():
        i = int(nm.split(".")[1])
        assert_equal(hvd.synchronize(h), np.full(3, n * i + sum(range(n)), np.int64), nm)


def case_allreduce_many_async_fused(hvd):
    shapes = [(i % 7 + 1, 3) for i in range(40)]
    dtypes = [np.float32, np.float64, np.int32]
    handles = []
    for i, shape in enumerate(shapes):
        dt = dtypes[i % 3]
        handles.append((hvd.allreduce_async(data(hvd.rank(), shape, dt, seed=i), op=hvd.Sum,
                                            name=f"fuse.{i}"), shape, dt, i))
    for h, shape, dt, i in handles:
        exp = np.sum([data(r, shape, dt, seed=i) for r in range(hvd.size())], axis=0,
                     dtype=dt)
        assert_equal(hvd.synchronize(h), exp, f"fuse.{i}")


def case_allreduce_unnamed_in_same_order(hvd):
    a = hvd.allreduce(np.ones(3), op=hvd.Sum)
    b = hvd.allreduce(np.full(2, 2.0), op=hvd.Sum)
    assert_equal(a, np.full(3, float(hvd.size())))
    assert_equal(b, np.full(2, 2.0 * hvd.size()))


def case_grouped_allreduce(hvd):
    tensors = [data(hvd.rank(), (i + 1, 2), np.float32, seed=10 + i) for i in range(5)]
    outs = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="grp")
    assert isinstance(outs, list) and len(outs) == 5
    for i, out in enumerate(outs):
        exp = np.sum([data(r, (i + 1, 2), np.float32, seed=10 + i) for r in range(hvd.size())],
                     axis=0, dtype=np.float32)
        assert_equal(out, exp, f"group member {i}")
    h = hvd.grouped_allreduce_async([np.ones(2), np.ones(3)], op=hvd.Average, name="grp2")
    assert [o.tolist() for o in hvd.synchronize(h)] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def case_steady_state_uses_response_cache(hvd):
    from coordinator import runtime

    bg = runtime.current().background
    before = len(bg.cache)
    for step in range(5):
        hs = [hvd.allreduce_async(np.full(4, float(step)), op=hvd.Sum, name=f"steady.{i}")
              for i in range(6)]
        for h in hs:
            assert_equal(hvd.synchronize(h), np.full(4, float(step) * hvd.size()))
    assert len(bg.cache) >= before + 6, (before, len(bg.cache))
    # After the first step, every step runs from the negotiation cycle (as
    # collectives, or carried in the cycle itself): no description goes to
    # rank 0.
    assert bg.stats["cycle_runs"] + bg.stats["riders"] >= 4, bg.stats


def case_steady_state_step_costs_one_cycle(hvd):
    """A cached tensor that every rank submits runs from one cycle; no
    second cycle follows just to learn that nobody waits any more."""
    from coordinator import runtime

    bg = runtime.current().background
    for _ in range(3):  # cached from here on
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="one.cycle")
    before = bg.cycle.cycles
    steps = 40
    for step in range(steps):
        assert_equal(hvd.allreduce(np.full(2, float(step)), op=hvd.Sum, name="one.cycle"),
                     np.full(2, float(step) * hvd.size()))
    time.sleep(0.2)  # nothing is left to cycle for
    spent = bg.cycle.cycles - before
    # Two cycles a step before (the second only to find nothing pending).
    assert spent <= steps * 1.25, (spent, steps)


def case_cycle_time_gathers_tensors_into_fewer_cycles(hvd):
    """HOROVOD_CYCLE_TIME spaces the cycles, as Horovod's does: tensors
    submitted one by one over 40 ms meet in two or three cycles with a
    1 s cycle time (one each without). (Not 100 ms: a loaded machine can
    spread the submissions, or the ranks, over more cycles than that.)"""
    from coordinator import runtime

    bg = runtime.current().background
    names = [f"gap.{i}" for i in range(20)]
    for _ in range(2):  # cached from here on
        for h in [hvd.allreduce_async(np.ones(1), op=hvd.Sum, name=n) for n in names]:
            hvd.synchronize(h)
    gap = bg._cycle_gap
    bg._cycle_gap = 1.0
    try:
        hvd.barrier()
        time.sleep(1.05)  # the last cycle's gap has passed
        before = bg.cycle.cycles
        handles = []
        for i, name in enumerate(names):
            handles.append(hvd.allreduce_async(np.full(1, float(i)), op=hvd.Sum, name=name))
            time.sleep(0.002)
        for i, h in enumerate(handles):
            assert_equal(hvd.synchronize(h), np.full(1, float(i) * hvd.size()))
        spent = bg.cycle.cycles - before
    finally:
        bg._cycle_gap = gap
    assert 1 <= spent <= 4, spent


# ------------------------------------------------------------------ allgather
def case_allgather_ragged_every_dtype(hvd):
    for dtype in ALL_DTYPES + ([BF16] if BF16 is not None else []):
        parts = [data(r, (r + 1, 3), dtype, seed=20) for r in range(hvd.size())]
        out = hvd.allgather(parts[hvd.rank()], name=f"ag.{np.dtype(dtype).name}")
        assert_equal(out, np.concatenate(parts), f"allgather {np.dtype(dtype).name}")


def case_allgather_zero_rows_on_a_rank(hvd):
    parts = [np.full((0 if r == 0 else 2, 2), r, np.int32) for r in range(hvd.size())]
    out = hvd.allgather(parts[hvd.rank()], name="ag.zero")
    assert_equal(out, np.concatenate(parts))


def case_grouped_and_fused_allgather(hvd):
    tensors = [np.full((hvd.rank() + i + 1, 2), 10 * i + hvd.rank(), np.float32)
               for i in range(4)]
    outs = hvd.grouped_allgather(tensors, name="gag")
    for i, out in enumerate(outs):
        exp = np.concatenate([np.full((r + i + 1, 2), 10 * i + r, np.float32)
                              for r in range(hvd.size())])
        assert_equal(out, exp, f"grouped allgather {i}")
    hs = [hvd.allgather_async(np.full((hvd.rank() + 1,), i, np.int64), name=f"agf.{i}")
          for i in range(10)]
    for i, h in enumerate(hs):
        exp = np.concatenate([np.full((r + 1,), i, np.int64) for r in range(hvd.size())])
        assert_equal(hvd.synchronize(h), exp)


# ------------------------------------------------------------------ broadcast
def case_broadcast_from_every_root(hvd):
    for root in range(hvd.size()):
        for dtype in ALL_DTYPES:
            mine = data(hvd.rank(), (2, 3), dtype, seed=30 + root)
            out = hvd.broadcast(mine, root_rank=root,
                                name=f"bc.{root}.{np.dtype(dtype).name}")
            assert_equal(out, data(root, (2, 3), dtype, seed=30 + root))


def case_broadcast_in_place_and_fused(hvd):
    buf = np.full(5, hvd.rank(), np.int32)
    hvd.broadcast(buf, root_rank=0, name="bc.inplace", output=buf)
    assert_equal(buf, np.zeros(5, np.int32))
    hs = [hvd.broadcast_async(np.full((i + 1,), hvd.rank() + i, np.float64 if i % 2 else
                                      np.int16), root_rank=1, name=f"bcf.{i}")
          for i in range(12)]
    for i, h in enumerate(hs):
        out = hvd.synchronize(h)
        assert out.tolist() == [1 + i] * (i + 1)


# ------------------------------------------------------------------- alltoall
def case_alltoall_uneven_splits(hvd):
    n, me = hvd.size(), hvd.rank()
    # rank r sends (r + j) % 3 + 1 rows to rank j, valued 100 * r + j
    def splits_of(r):
        return [(r + j) % 3 + 1 for j in range(n)]

    rows = np.concatenate([np.full((s, 2), 100 * me + j, np.float32)
                           for j, s in enumerate(splits_of(me))])
    out, received = hvd.alltoall(rows, splits=splits_of(me), name="a2a")
    exp = np.concatenate([np.full((splits_of(r)[me], 2), 100 * r + me, np.float32)
                          for r in range(n)])
    assert_equal(out, exp)
    assert list(received) == [splits_of(r)[me] for r in range(n)]


def case_alltoall_even_default(hvd):
    n, me = hvd.size(), hvd.rank()
    out = hvd.alltoall(np.arange(2 * n, dtype=np.int64) + 1000 * me, name="a2a.even")
    exp = np.concatenate([np.arange(2 * me, 2 * me + 2) + 1000 * r for r in range(n)])
    assert_equal(out, exp)
    h = hvd.alltoall_async(np.arange(n, dtype=np.int8), name="a2a.async")
    out, received = hvd.synchronize(h)
    assert list(received) == [1] * n


# -------------------------------------------------------------- reducescatter
def case_reducescatter_sum_and_average_uneven(hvd):
    n, me = hvd.size(), hvd.rank()
    for rows in (n, 2 * n + 1, 7):
        inputs = all_data(hvd, (rows, 3), np.float64, seed=40 + rows)
        total = np.sum(inputs, axis=0)
        base, extra = divmod(rows, n)
        counts = [base + (1 if r < extra else 0) for r in range(n)]
        start = sum(counts[:me])
        out = hvd.reducescatter(inputs[me], op=hvd.Sum, name=f"rs.{rows}")
        np.testing.assert_allclose(out, total[start:start + counts[me]])
        avg = hvd.reducescatter(inputs[me], name=f"rs.avg.{rows}")
        np.testing.assert_allclose(avg, total[start:start + counts[me]] / n)


def case_grouped_reducescatter(hvd):
    n, me = hvd.size(), hvd.rank()
    tensors = [np.full((n * (i + 1), 2), i + me, np.int32) for i in range(3)]
    outs = hvd.grouped_reducescatter(tensors, op=hvd.Sum, name="grs")
    for i, out in enumerate(outs):
        assert_equal(out, np.full((i + 1, 2), n * i + sum(range(n)), np.int32))


# ----------------------------------------------------------- barrier and join
def case_barrier(hvd):
    for _ in range(3):
        hvd.barrier()


def case_join_contributes_zeros_and_returns_last_rank(hvd):
    n, me = hvd.size(), hvd.rank()
    last = n - 1
    if me == last:
        result = hvd.join()
    else:
        out = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, name="join.sum")
        exp = sum(r + 1.0 for r in range(n) if r != last)
        assert_equal(out, np.full(3, exp))
        avg = hvd.allreduce(np.full(2, 4.0), name="join.avg")
        # Average divides by the whole set, as in Horovod.
        assert_equal(avg, np.full(2, 4.0 * (n - 1) / n))
        result = hvd.join()
    assert result in range(n)
    assert hvd.allreduce(np.array([result]), op=hvd.Max, name="join.agree")[0] == result


# --------------------------------------------------------------------- errors
def _check_mismatch(exc, *fragments):
    text = str(exc)
    for frag in fragments:
        assert frag in text, f"{frag!r} not in {text!r}"


def case_mismatched_shapes_names_the_ranks_on_every_rank(hvd):
    n, me = hvd.size(), hvd.rank()
    shape = (5,) if me == 1 else (4,)
    exc = expect_raises(hvd.TensorMismatchError, hvd.allreduce, np.ones(shape), name="bad.shape")
    others = ", ".join(str(r) for r in range(n) if r != 1)
    label = "rank 0" if n == 2 else f"ranks {others}"
    _check_mismatch(exc, "Mismatched shape", "allreduce", "'bad.shape'")
    import re

    assert re.search(r"rank 1 sent (shape )?\(5,\)", str(exc)), str(exc)
    assert re.search(rf"{label} sent (shape )?\(4,\)", str(exc)), str(exc)
    assert isinstance(exc, hvd.HorovodInternalError) and isinstance(exc, RuntimeError)
    # The job goes on.
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.shape"), np.full(2, n * 1.0))


def case_mismatched_dtype_op_root_scale_and_reduce_op(hvd):
    me = hvd.rank()
    odd = me == hvd.size() - 1
    exc = expect_raises(hvd.TensorMismatchError, hvd.allreduce,
                        np.ones(3, np.int32 if odd else np.float32), name="bad.dtype")
    import re

    assert re.search(rf"rank {hvd.size() - 1} sent (dtype )?int32", str(exc)), str(exc)
    _check_mismatch(exc, "Mismatched dtype", "float32")
    exc = expect_raises(hvd.TensorMismatchError, hvd.allreduce, np.ones(3),
                        op=hvd.Max if odd else hvd.Sum, name="bad.op")
    _check_mismatch(exc, "reduce op", "Max", "Sum")
    exc = expect_raises(hvd.TensorMismatchError, hvd.broadcast, np.ones(3),
                        root_rank=1 if odd else 0, name="bad.root")
    _check_mismatch(exc, "root rank", "broadcast")
    exc = expect_raises(hvd.TensorMismatchError, hvd.allreduce, np.ones(3),
                        prescale_factor=2.0 if odd else 1.0, name="bad.scale")
    _check_mismatch(exc, "prescale factor", "2.0", "1.0")
    if odd:
        exc = expect_raises(hvd.TensorMismatchError, hvd.allgather, np.ones(3), name="bad.kind")
    else:
        exc = expect_raises(hvd.TensorMismatchError, hvd.allreduce, np.ones(3), name="bad.kind")
    _check_mismatch(exc, "operation", "allgather", "allreduce")
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.mismatch")[0] == hvd.size()


def case_duplicate_name_in_flight_is_value_error(hvd):
    exc = while_in_flight(hvd, lambda name: hvd.allreduce_async(np.ones(2), name=name),
                          lambda name: expect_raises(ValueError, hvd.allreduce_async,
                                                     np.ones(2), name=name),
                          names=("dup.a", "dup.b"))
    assert "dup." in str(exc) and "in flight" in str(exc)
    hvd.synchronize(hvd.allreduce_async(np.ones(2), name="dup.a"))  # free again


def case_invalid_inputs_give_clear_errors(hvd):
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(2, np.complex64), name="cplx")
    assert "complex64" in str(exc) and "not supported" in str(exc)
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(2, bool), name="boolsum")
    assert "cannot be reduced" in str(exc)
    exc = expect_raises(ValueError, hvd.reducescatter, np.ones(4), op=hvd.Min, name="rsmin")
    assert "Sum and Average" in str(exc)
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(4), name="ncout",
                        output=np.ones((4, 2))[:, 0])
    assert "output" in str(exc)
    exc = expect_raises(ValueError, hvd.broadcast, np.ones(2), root_rank=hvd.size(),
                        name="badroot")
    assert "root rank" in str(exc)
    exc = expect_raises(ValueError, hvd.alltoall, np.ones(3), splits=[1] * (hvd.size() + 1),
                        name="badsplits")
    assert "splits" in str(exc)


def case_bad_arguments_are_named_with_the_call_and_the_job_goes_on(hvd):
    """Every argument check of the core API, the same bad call on every
    rank: a ValueError that names the call and what was wrong; then the
    next good collective runs."""
    x = np.ones(4, np.float32)
    checks = [
        ("non-empty string", hvd.allreduce, (x,), dict(name="")),
        ("must be a ProcessSet", hvd.allreduce, (x,), dict(name="ps", process_set="set")),
        ("is not registered", hvd.allreduce, (x,),
         dict(name="unreg", process_set=hvd.ProcessSet([0]))),
        ("output must be a NumPy array", hvd.allreduce, (x,), dict(name="out", output=[0] * 4)),
        ("output has shape (3,)", hvd.allreduce, (x,),
         dict(name="outshape", output=np.ones(3, np.float32))),
        ("either op or the deprecated average", hvd.allreduce, (x,),
         dict(name="both", op=hvd.Sum, average=True)),
        ("unknown reduce op 99", hvd.allreduce, (x,), dict(name="op99", op=99)),
        ("prescale_factor must be a real number", hvd.allreduce, (x,),
         dict(name="scale", prescale_factor="2")),
        ("1 outputs for 2 tensors", hvd.grouped_allreduce, ([x, x],),
         dict(name="gouts", outputs=[x.copy()])),
        ("a scalar cannot be scattered", hvd.alltoall, (np.float32(1),), dict(name="a2a0")),
        ("splits must be a 1-D list of integers", hvd.alltoall, (x,),
         dict(name="a2a2d", splits=[[1, 1], [1, 1]])),
        ("a scalar cannot be scattered", hvd.reducescatter, (np.float32(1),),
         dict(name="rs0")),
    ]
    for text, fn, args, kwargs in checks:
        exc = expect_raises(ValueError, fn, *args, **kwargs)
        assert text in str(exc), (text, str(exc))
        name = kwargs["name"]
        assert not name or f"'{name}'" in str(exc), (name, str(exc))
    out = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="after.bad")
    assert_equal(out, np.full(2, hvd.size() * (hvd.size() + 1) / 2))


def case_non_contiguous_input_is_copied(hvd):
    base = np.arange(20, dtype=np.float64).reshape(4, 5)
    view = base[:, ::2]
    out = hvd.allreduce(view, op=hvd.Sum, name="noncontig")
    assert_equal(out, view * hvd.size())


def case_every_dtype_through_broadcast_alltoall_and_reducescatter(hvd):
    n, me = hvd.size(), hvd.rank()
    extra = [BF16] if BF16 is not None else []
    for dtype in ALL_DTYPES + extra:
        label = np.dtype(dtype).name
        out = hvd.broadcast(data(me, (3,), dtype, seed=50), root_rank=n - 1,
                            name=f"bcd.{label}")
        assert_equal(out, data(n - 1, (3,), dtype, seed=50), f"broadcast {label}")
        rows = [data(r, (n, 2), dtype, seed=51) for r in range(n)]
        out = hvd.alltoall(rows[me], name=f"a2ad.{label}")
        assert_equal(out, np.concatenate([rows[r][me:me + 1] for r in range(n)]),
                     f"alltoall {label}")
    for dtype in REDUCE_DTYPES + extra:
        label = np.dtype(dtype).name
        inputs = [data(r, (n + 1, 2), dtype, seed=52) for r in range(n)]
        out = hvd.reducescatter(inputs[me], op=hvd.Sum, name=f"rsd.{label}")
        total = np.sum([i.astype(np.float64) for i in inputs], axis=0).astype(dtype)
        start = 0 if me == 0 else me + 1
        assert_equal(out, total[start:start + (2 if me == 0 else 1)], f"reducescatter {label}")


def _adasum_reference(vectors):
    """The Adasum tree evaluated in NumPy for every rank's vector."""
    def comb(a, b):
        dot = float(np.dot(a, b))
        na, nb = float(np.dot(a, a)), float(np.dot(b, b))
        ca = 1 - dot / (2 * na) if na > 0 else 1.0
        cb = 1 - dot / (2 * nb) if nb > 0 else 1.0
        return ca * a + cb * b

    vecs = [v.astype(np.float64) for v in vectors]
    p2 = 1
    while p2 * 2 <= len(vecs):
        p2 *= 2
    for r in range(p2, len(vecs)):
        vecs[r - p2] = comb(vecs[r - p2], vecs[r])
    vecs = vecs[:p2]
    while len(vecs) > 1:
        vecs = [comb(vecs[i], vecs[i + 1]) for i in range(0, len(vecs), 2)]
    return vecs[0]


def case_adasum_matches_the_published_formula(hvd):
    n, me = hvd.size(), hvd.rank()
    rng = [np.random.default_rng(60 + r) for r in range(n)]
    a = [g.standard_normal(7) for g in rng]
    b = [g.standard_normal((2, 3)) for g in rng]
    ha = hvd.allreduce_async(a[me], op=hvd.Adasum, name="adasum.a")
    hb = hvd.allreduce_async(b[me], op=hvd.Adasum, name="adasum.b")
    # Each tensor is combined on its own (layer-wise), fused or not.
    np.testing.assert_allclose(hvd.synchronize(ha), _adasum_reference(a), rtol=1e-10)
    np.testing.assert_allclose(hvd.synchronize(hb),
                               _adasum_reference([x.reshape(-1) for x in b]).reshape(2, 3),
                               rtol=1e-10)
    # Identical gradients average; orthogonal ones add.
    same = hvd.allreduce(np.ones(4), op=hvd.Adasum, name="adasum.same")
    np.testing.assert_allclose(same, np.ones(4))
    if n in (2, 4):
        basis = np.eye(n)[me]
        np.testing.assert_allclose(hvd.allreduce(basis, op=hvd.Adasum, name="adasum.orth"),
                                   np.ones(n))
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(2, np.int32), op=hvd.Adasum,
                        name="adasum.int")
    assert "floating-point" in str(exc)


def case_16_bit_floats_round_once_per_reduction_step(hvd):
    """float16/bfloat16 travel as 16-bit data; each pairwise step is computed
    in float32 and rounded to nearest-even, as the NumPy reference does."""
    n, me = hvd.size(), hvd.rank()
    for dtype in [np.float16] + ([BF16] if BF16 is not None else []):
        rng = [np.random.default_rng(70 + r) for r in range(n)]
        vals = [g.standard_normal(1001).astype(np.float32).astype(dtype) for g in rng]
        out = hvd.allreduce(vals[me], op=hvd.Sum, name=f"half.{np.dtype(dtype).name}")
        if n == 2:  # one step: exactly round(a + b)
            exp = (vals[0].astype(np.float32) + vals[1].astype(np.float32)).astype(dtype)
            assert_equal(out, exp, np.dtype(dtype).name)
        else:  # the order of steps is MPI's; stay within a few 16-bit ulps
            exact = np.sum([v.astype(np.float64) for v in vals], axis=0)
            np.testing.assert_allclose(out.astype(np.float64), exact, rtol=0.05, atol=0.05)
        # identical on every rank
        gathered = hvd.allgather(out[None], name=f"half.check.{np.dtype(dtype).name}")
        assert all(np.array_equal(gathered[0].view(np.uint16), g.view(np.uint16))
                   for g in gathered)
        scaled = hvd.allreduce(vals[me], op=hvd.Average, name=f"half.avg.{np.dtype(dtype).name}")
        assert scaled.dtype == np.dtype(dtype)


def case_large_and_packed_tensors_in_one_response(hvd):
    """Tensors above the pack limit are reduced in place, below it through the
    fusion buffer, and buffers above the segment size in several calls; the
    results are the same (tests/test_core_mpi.py sets small limits)."""
    n, me = hvd.size(), hvd.rank()
    sizes = [3, 10, 5000, 70000, 17, 300000]
    hs = [hvd.allreduce_async(data(me, (s,), np.float32, seed=80 + i), op=hvd.Sum,
                              name=f"mixed.{i}") for i, s in enumerate(sizes)]
    for i, (s, h) in enumerate(zip(sizes, hs)):
        exp = np.sum([data(r, (s,), np.float32, seed=80 + i) for r in range(n)], axis=0,
                     dtype=np.float32)
        assert_equal(hvd.synchronize(h), exp, f"mixed.{i}")
    avg = hvd.allreduce(np.full(300000, float(me)), name="mixed.avg", prescale_factor=2.0)
    np.testing.assert_allclose(avg, np.full(300000, 2.0 * sum(range(n)) / n))


# -------------------------------------------------------------------- objects
def case_broadcast_object_gives_the_roots_object_whatever_the_others_pass(hvd):
    # Horovod named the exchange after the object's type: the root's dict and
    # the others' None met under different names, and the job hung.
    n, me = hvd.size(), hvd.rank()
    root = n - 1
    obj = {"from": me, "f": lambda v: v * 2} if me == root else None
    got = hvd.broadcast_object(obj, root_rank=root)
    assert got["from"] == root and got["f"](3) == 6
    if me == root:
        assert got is obj  # the root keeps its own object
    big = np.arange(2_000_000, dtype=np.int64) if me == 0 else b"ignored"
    assert int(hvd.broadcast_object(big, root_rank=0).sum()) == 1999999000000
    assert hvd.broadcast_object(b"" if me == 0 else 1, root_rank=0) == b""


def case_allgather_object_returns_every_ranks_object_in_rank_order(hvd):
    n, me = hvd.size(), hvd.rank()
    mine = None if me == 1 else ("x" * me, list(range(me)))
    expected = [None if r == 1 else ("x" * r, list(range(r))) for r in range(n)]
    assert hvd.allgather_object(mine) == expected
    assert hvd.allgather_object(b"") == [b""] * n
    # Named the same way call after call: the second exchange hits the cache.
    for step in range(3):
        assert hvd.allgather_object(step * me, name="loop") == [step * r for r in range(n)]


def case_broadcast_object_with_different_roots_raises_on_every_rank(hvd):
    n, me = hvd.size(), hvd.rank()
    exc = expect_raises(hvd.TensorMismatchError, hvd.broadcast_object, me, root_rank=me,
                        name="roots")
    text = str(exc)
    assert "'roots'" in text and all(f"rank {r}: {r}" in text for r in range(n)), text
    exc = expect_raises(ValueError, hvd.broadcast_object, 1, root_rank=n + 3)
    assert f"root rank {n + 3}" in str(exc)
    assert hvd.broadcast_object(me, root_rank=0) == 0  # the job goes on


def case_object_exchanges_meet_no_tensor_named_like_them(hvd):
    # broadcast_object(name="same") was an allgather of a tensor named
    # 'broadcast_object.same': a program's own allgather of that name in
    # flight with it failed both ("submitted twice"). The exchanges are now
    # named in the coordinator's namespace.
    n, me = hvd.size(), hvd.rank()
    for kind in ("broadcast_object", "allgather_object"):
        handle = hvd.allgather_async(np.full(2, me, np.int64), name=f"{kind}.same")
        if kind == "broadcast_object":
            assert hvd.broadcast_object(("root", me), root_rank=0, name="same") == ("root", 0)
        else:
            assert hvd.allgather_object(me, name="same") == list(range(n))
        assert_equal(hvd.synchronize(handle), np.repeat(np.arange(n), 2))
    exc = expect_raises(ValueError, hvd.broadcast_object, 1, name="coordinator.x")
    assert "reserved" in str(exc), exc
