"""Riders: tiny allreduces carried in the negotiation cycle itself (run by
tests/test_riders_mpi.py). Each case checks results against NumPy, and that
the riders did (or, where they must not, did not) ride, from the background
thread's counters."""

import os
import random
import time

import numpy as np
from mpi4py import MPI

RIDER_DTYPES = [np.float32, np.float64, np.int8, np.int16, np.int32, np.uint8]


def _bg():
    from coordinator import runtime

    return runtime.current().background


def _enabled():
    return os.environ.get("COORDINATOR_CYCLE_PAYLOAD_BYTES") != "0"


def _value(rank, step, shape, dtype, seed=0):
    rng = np.random.default_rng(7919 * seed + 31 * step + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 9, size=shape).astype(dtype)
    # Quarters: every sum is exact, whatever order MPI adds in.
    return (rng.integers(-64, 64, size=shape) / 4).astype(dtype)


def _warm(hvd, name, tensor, **kwargs):
    """Two submissions: the first is described in a round and cached, the
    second runs from a cycle."""
    for _ in range(2):
        hvd.allreduce(tensor, name=name, **kwargs)


def case_riders_equal_numpy_in_every_dtype_op_and_shape(hvd):
    size, rank = hvd.size(), hvd.rank()
    # 21 words a dtype, 126 in all: within the default payload (256 words),
    # with room for the other cases' riders (slots stay taken).
    kinds = [((), hvd.Sum, 1.0), ((3,), hvd.Average, 1.0), ((4, 4), hvd.Sum, 0.5),
             ((1,), hvd.Average, 0.5)]
    cases = [(dt, shape, op, post) for dt in RIDER_DTYPES for shape, op, post in kinds]
    for i, (dt, shape, op, post) in enumerate(cases):
        _warm(hvd, f"r{i}", np.zeros(shape, dt), op=op, postscale_factor=post)
    before = _bg().stats["riders"]
    for step in range(3):
        handles = []
        for i, (dt, shape, op, post) in enumerate(cases):
            handles.append(hvd.allreduce_async(_value(rank, step, shape, dt, i), name=f"r{i}",
                                               op=op, postscale_factor=post))
        for (dt, shape, op, post), h, i in zip(cases, handles, range(len(cases))):
            got = hvd.synchronize(h)
            inputs = [_value(r, step, shape, dt, i) for r in range(size)]
            if np.dtype(dt).kind == "f":
                exact = np.sum(np.array(inputs, np.float64), axis=0).astype(dt)
            else:
                exact = np.sum(np.array(inputs, np.int64), axis=0).astype(dt)
            if op == hvd.Average or post != 1.0:
                factor = post / (size if op == hvd.Average else 1)
                if np.dtype(dt).kind == "f":
                    exact = (exact * np.dtype(dt).type(factor)).astype(dt)
                else:
                    exact = (exact.astype(np.float64) * post / (size if op == hvd.Average
                                                                   else 1)).astype(dt)
            assert got.dtype == np.dtype(dt) and got.shape == shape, (got.dtype, got.shape)
            np.testing.assert_array_equal(got, exact, err_msg=f"{np.dtype(dt)} {shape} "
                                          f"op {op} postscale {post} step {step}")
    rode = _bg().stats["riders"] - before
    if _enabled():
        assert rode == 3 * len(cases), (rode, len(cases))
    else:
        assert rode == 0, rode


def case_a_float32_rider_equals_mpis_own_sum_on_two_ranks(hvd):
    """Summed in float64 and rounded once: for two ranks exactly the float32
    sum MPI computes; for more, within one rounding of the exact sum."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(hvd.rank())
    _warm(hvd, "f32", np.zeros(16, np.float32), op=hvd.Sum)
    for _ in range(50):
        x = (rng.standard_normal(16) * 10.0 ** rng.integers(-20, 20, 16)).astype(np.float32)
        got = hvd.allreduce(x, name="f32", op=hvd.Sum)
        mpi = np.empty_like(x)
        comm.Allreduce(x, mpi, op=MPI.SUM)
        if hvd.size() == 2:
            np.testing.assert_array_equal(got, mpi)
        else:
            exact = np.sum(np.array(comm.allgather(x), np.float64), axis=0)
            assert np.all(np.abs(got - exact) <= np.abs(mpi.astype(np.float64) - exact)
                          + np.spacing(np.abs(got))), (got, mpi, exact)


def case_an_integer_sum_that_overflows_wraps_as_mpis_does(hvd):
    comm = MPI.COMM_WORLD
    x = np.array([2 ** 31 - 1, -2 ** 31, 5, 120], np.int32)
    _warm(hvd, "wrap", x, op=hvd.Sum)
    got = hvd.allreduce(x, name="wrap", op=hvd.Sum)
    mpi = np.empty_like(x)
    comm.Allreduce(x, mpi, op=MPI.SUM)
    np.testing.assert_array_equal(got, mpi)
    y = np.array([100, -100, 127], np.int8)
    _warm(hvd, "wrap8", y, op=hvd.Sum)
    got8 = hvd.allreduce(y, name="wrap8", op=hvd.Sum)
    mpi8 = np.empty_like(y)
    comm.Allreduce(y, mpi8, op=MPI.SUM)
    np.testing.assert_array_equal(got8, mpi8)


def case_ranks_arriving_at_different_times_never_mix_steps(hvd):
    """A cycle that some ranks post without a rider carries meaningless sums
    for it; they are never used: every step's sum is that step's."""
    size, rank = hvd.size(), hvd.rank()
    rng = random.Random(100 + rank)
    _warm(hvd, "late.a", np.zeros(1), op=hvd.Sum)
    _warm(hvd, "late.b", np.zeros(3, np.int32), op=hvd.Sum)
    for step in range(150):
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.003)
        ha = hvd.allreduce_async(np.array([rank * 1000.0 + step]), name="late.a", op=hvd.Sum)
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.003)
        b = hvd.allreduce(np.full(3, rank + step, np.int32), name="late.b", op=hvd.Sum)
        a = hvd.synchronize(ha)
        assert a[0] == sum(r * 1000.0 + step for r in range(size)), (step, a)
        assert b.tolist() == [sum(r + step for r in range(size))] * 3, (step, b)


def case_riders_and_collectives_in_one_step_in_any_order(hvd):
    """Tiny and large tensors of one step, submitted in a different order on
    every rank: the tiny ones ride, the others run as collectives."""
    size, rank = hvd.size(), hvd.rank()
    specs = [("tiny.0", (2,)), ("big.0", (1000,)), ("tiny.1", ()), ("big.1", (17,)),
             ("tiny.2", (16,))]
    for name, shape in specs:
        _warm(hvd, name, np.zeros(shape, np.float32), op=hvd.Average)
    before = dict(_bg().stats)
    order = list(range(len(specs)))
    for step in range(5):
        random.Random(rank * 10 + step).shuffle(order)
        handles = {}
        for i in order:
            name, shape = specs[i]
            handles[name] = hvd.allreduce_async(np.full(shape, rank + step, np.float32),
                                                name=name, op=hvd.Average)
        for name, shape in specs:
            got = hvd.synchronize(handles[name])
            np.testing.assert_allclose(got, np.full(shape, (size - 1) / 2 + step), rtol=1e-6)
    stats = _bg().stats
    if _enabled():
        assert stats["riders"] - before["riders"] == 15, (before, stats)
    assert stats["cycle_runs"] > before["cycle_runs"], (before, stats)


def case_what_may_not_ride_runs_as_a_collective(hvd):
    """A prescaled tensor, Min, Max and Product, a grouped allreduce, float16,
    int64 and 17 elements: none of them rides, and each result is right."""
    size, rank = hvd.size(), hvd.rank()
    x = np.array([rank + 1.0, -rank - 2.0])

    def step():
        out = [hvd.allreduce(x, name="pre", op=hvd.Sum, prescale_factor=2.0),
               hvd.allreduce(x, name="min", op=hvd.Min),
               hvd.allreduce(x, name="prod", op=hvd.Product),
               hvd.grouped_allreduce([x, x], name="grp", op=hvd.Sum),
               hvd.allreduce(x.astype(np.float16), name="f16", op=hvd.Sum),
               hvd.allreduce(x.astype(np.int64), name="i64", op=hvd.Sum),
               hvd.allreduce(np.full(17, rank), name="n17", op=hvd.Sum)]
        return out

    step()
    before = _bg().stats["riders"]
    pre, mn, prod, grp, f16, i64, n17 = step()
    xs = np.array([[r + 1.0, -r - 2.0] for r in range(size)])
    np.testing.assert_array_equal(pre, 2 * xs.sum(axis=0))
    np.testing.assert_array_equal(mn, xs.min(axis=0))
    np.testing.assert_array_equal(prod, xs.prod(axis=0))
    np.testing.assert_array_equal(grp[0], xs.sum(axis=0))
    np.testing.assert_array_equal(f16, xs.sum(axis=0).astype(np.float16))
    np.testing.assert_array_equal(i64, xs.sum(axis=0).astype(np.int64))
    np.testing.assert_array_equal(n17, np.full(17, sum(range(size))))
    assert _bg().stats["riders"] == before, (before, _bg().stats)


def case_in_place_riders_write_into_the_tensor(hvd):
    size, rank = hvd.size(), hvd.rank()
    _warm(hvd, "inplace", np.zeros(4), op=hvd.Sum)
    x = np.full(4, rank + 1.0)
    out = hvd.allreduce(x, name="inplace", op=hvd.Sum, output=x)
    assert out is x or np.shares_memory(out, x)
    np.testing.assert_array_equal(x, np.full(4, size * (size + 1) / 2))


def case_a_full_payload_leaves_the_rest_to_collectives(hvd):
    """Riders take the payload in slot order; one that does not fit runs as
    a collective (run alone with an 8-word payload, and with the default)."""
    size, rank = hvd.size(), hvd.rank()
    names = ["full.0", "full.1", "full.2"]
    for name in names:
        _warm(hvd, name, np.zeros(3), op=hvd.Sum)
    before = _bg().stats["riders"]
    for step in range(4):
        handles = [hvd.allreduce_async(np.full(3, rank + step + i, np.float64), name=name,
                                       op=hvd.Sum)
                   for i, name in enumerate(names)]
        for i, h in enumerate(handles):
            np.testing.assert_array_equal(hvd.synchronize(h),
                                          np.full(3, sum(r + step + i for r in range(size))))
    rode = _bg().stats["riders"] - before
    words = int(os.environ.get("COORDINATOR_CYCLE_PAYLOAD_BYTES", "2048")) // 8
    expected = 0 if not words else 4 * (2 if words == 8 else 3)
    assert rode == expected, (rode, expected, words)
