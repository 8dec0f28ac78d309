"""Hierarchical and 2D-torus allreduce on a simulated host layout (set by
tests/test_algorithms_mpi.py through COORDINATOR_SIMULATED_LOCAL_SIZE and
HOROVOD_HIERARCHICAL_ALLREDUCE / HOROVOD_TORUS_ALLREDUCE)."""

import os

import numpy as np

from core_cases import assert_equal, data


def _algorithm():
    from coordinator import runtime

    mpi_ops = runtime.current().ops.backends[-1]
    (algorithm,) = mpi_ops.algorithms
    return algorithm


def case_topology_follows_the_simulated_hosts(hvd):
    local = int(os.environ["COORDINATOR_SIMULATED_LOCAL_SIZE"])
    assert hvd.local_size() == local
    assert hvd.local_rank() == hvd.rank() % local
    assert hvd.cross_size() == hvd.size() // local
    assert hvd.cross_rank() == hvd.rank() // local
    assert hvd.is_homogeneous()


def case_exact_results_for_every_op_and_many_sizes(hvd):
    n, me = hvd.size(), hvd.rank()
    before = _algorithm().calls
    for size in (1, 2, 5, n, 3 * n + 1, 1000):
        for dtype in (np.float32, np.float64, np.int32):
            inputs = [data(r, (size,), dtype, seed=size) for r in range(n)]
            out = hvd.allreduce(inputs[me], op=hvd.Sum, name=f"alg.{size}.{np.dtype(dtype)}")
            assert_equal(out, np.sum(inputs, axis=0, dtype=dtype), f"sum {size}")
        mx = hvd.allreduce(inputs[me], op=hvd.Max, name=f"alg.max.{size}")
        assert_equal(mx, np.max(inputs, axis=0))
        avg = hvd.allreduce(inputs[me].astype(np.float64), name=f"alg.avg.{size}")
        np.testing.assert_allclose(avg, np.mean(inputs, axis=0))
    assert _algorithm().calls > before


def case_fused_and_in_place(hvd):
    n, me = hvd.size(), hvd.rank()
    hs = [hvd.allreduce_async(np.full(i + 1, float(me + i)), op=hvd.Sum, name=f"algf.{i}")
          for i in range(20)]
    for i, h in enumerate(hs):
        assert_equal(hvd.synchronize(h), np.full(i + 1, float(sum(range(n)) + n * i)))
    buf = np.full(7, me, np.int64)
    hvd.allreduce(buf, op=hvd.Sum, name="alg.inplace", output=buf)
    assert_equal(buf, np.full(7, sum(range(n)), np.int64))
    scaled = hvd.allreduce(np.ones(4), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                           name="alg.scaled")
    assert_equal(scaled, np.full(4, float(n)))
