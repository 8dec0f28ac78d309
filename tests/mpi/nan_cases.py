"""Min and Max allreduce propagate a NaN that only one rank holds (run by
tests/test_nan_mpi.py), as np.minimum and np.maximum do.

Open MPI's MPI_MIN and MPI_MAX compare with `<` and `>`, so a NaN on one rank
was dropped or kept depending on the order MPI combined the ranks in: Min of
{1, NaN, 3} gave 3.0 for a small tensor and 1.0 for a large one. Each case
runs every floating dtype through one path of the allreduce: small tensors
packed into the fusion buffer, a tensor above the pack limit reduced where it
is, and one above the segment size reduced in segments. The sizes are taken
from the running configuration, so they stay on their path whatever the
defaults become.
"""

import numpy as np

from core_cases import assert_equal

from coordinator import dtypes

FLOATS = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)]
if dtypes.BFLOAT16 is not None:
    FLOATS.append(dtypes.BFLOAT16)


def _config():
    from coordinator import runtime

    return runtime.current().config


def inputs(size, n, dtype, seed):
    """Every rank's input (rows), each NaN held by one rank only.

    Element 0 is the issue's {1, NaN, 3, ...}: NaN on rank 1 (rank 0 at np=1).
    Element 1 has its NaN on rank 0, element 2 on the last rank, element 3 an
    infinity beside the NaN. From there every 7th element holds a NaN on rank
    (i // 7) % size, and the last element one on the last rank, so the last
    segment of a segmented tensor has one too."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-100, 100, size=(size, n)).astype(np.float64)
    x[:, 0] = np.arange(1, size + 1)
    x[1 % size, 0] = np.nan
    if n > 3:
        x[0, 1] = np.nan
        x[size - 1, 2] = np.nan
        x[0, 3], x[size - 1, 3] = -np.inf, np.nan
    idx = np.arange(4, n - 1, 7)
    x[(idx // 7) % size, idx] = np.nan
    x[size - 1, n - 1] = np.nan
    with np.errstate(invalid="ignore"):
        return x.astype(dtype)


def expected(rows, op_name):
    """np.minimum.reduce / np.maximum.reduce over the ranks, in float64 (every
    input is exact there), cast back."""
    ufunc = np.minimum if op_name == "Min" else np.maximum
    return ufunc.reduce(rows.astype(np.float64), axis=0).astype(rows.dtype)


def _ops(hvd):
    return (("Min", hvd.Min), ("Max", hvd.Max))


def _check(out, rows, op_name, what):
    assert_equal(out, expected(rows, op_name), what)
    assert np.isnan(out[0].astype(np.float32)), f"{what}: element 0 ({{1, NaN, ...}}) is {out[0]}"


def _check_one_tensor(hvd, nbytes, label, seed):
    size, me = hvd.size(), hvd.rank()
    for dtype in FLOATS:
        n = nbytes // dtype.itemsize
        rows = inputs(size, n, dtype, seed)
        for op_name, op in _ops(hvd):
            name = f"nan.{label}.{dtype.name}.{op_name}"
            _check(hvd.allreduce(rows[me], op=op, name=name), rows, op_name, name)


def case_min_max_small_tensors_fused_propagate_nan_from_one_rank(hvd):
    size, me = hvd.size(), hvd.rank()
    counts = (3, 5, 64, 1000)  # all far below the pack limit
    assert max(counts) * 8 < _config().pack_limit
    for dtype in FLOATS:
        rows = [inputs(size, n, dtype, seed=n) for n in counts]
        for op_name, op in _ops(hvd):
            # A group is negotiated and packed as one unit ...
            name = f"nan.group.{dtype.name}.{op_name}"
            outs = hvd.grouped_allreduce([r[me] for r in rows], op=op, name=name)
            for out, r in zip(outs, rows):
                _check(out, r, op_name, f"{name} ({r.shape[1]} elements)")
            # ... and tensors submitted together fuse.
            handles = [hvd.allreduce_async(r[me], op=op, name=f"nan.async.{i}.{dtype.name}."
                                           f"{op_name}") for i, r in enumerate(rows)]
            for h, r in zip(handles, rows):
                _check(hvd.synchronize(h), r, op_name, f"async {dtype.name} {op_name}")


def case_min_max_tensor_above_pack_limit_propagates_nan_from_one_rank(hvd):
    cfg = _config()
    nbytes = 2 * cfg.pack_limit + 16  # reduced where it is, in one segment
    assert nbytes < cfg.segment_bytes
    _check_one_tensor(hvd, nbytes, "direct", seed=11)


def case_min_max_tensor_above_segment_size_propagates_nan_from_one_rank(hvd):
    nbytes = _config().segment_bytes + 1024 * 1024 + 24  # two segments, the last short
    _check_one_tensor(hvd, nbytes, "segmented", seed=12)


def case_min_max_signed_zeros_give_same_bits_on_every_rank(hvd):
    """-0.0 counts below +0.0 (IEEE 754-2019 minimum/maximum): Min of {-0, +0}
    is -0 and Max is +0 on every rank, whatever order MPI combined them in."""
    size, me = hvd.size(), hvd.rank()
    for dtype in FLOATS:
        for neg in range(size):  # the rank holding -0.0
            mine = np.full(8, -0.0 if me == neg else 0.0, dtype)
            for op_name, op in _ops(hvd):
                name = f"zero.{dtype.name}.{op_name}.{neg}"
                out = hvd.allreduce(mine, op=op, name=name)
                assert np.all(out == 0), f"{name}: {out}"
                want = op_name == "Min"
                assert np.all(np.signbit(out.astype(np.float32)) == want), \
                    f"{name}: rank {me} got {out} with -0.0 on rank {neg}"


def case_min_max_without_native_kernels_propagate_nan(hvd):
    """Where no C compiler built native/, the NumPy references run in the MPI
    user-defined op (and 16-bit tensors are reduced in float32)."""
    from coordinator import native

    saved = native.halfops, native.minmax
    native.halfops = native.minmax = None  # every rank, before it submits
    try:
        case_min_max_small_tensors_fused_propagate_nan_from_one_rank(hvd)
        _check_one_tensor(hvd, _config().segment_bytes + 4096, "fallback", seed=13)
    finally:
        native.halfops, native.minmax = saved


def case_host_aware_algorithm_ran_when_enabled(hvd):
    """Under HOROVOD_HIERARCHICAL_ALLREDUCE or HOROVOD_TORUS_ALLREDUCE (set by
    tests/test_nan_mpi.py), the cases above went through that algorithm."""
    import os

    from coordinator import runtime

    if "COORDINATOR_SIMULATED_LOCAL_SIZE" not in os.environ:
        return
    (algorithm,) = runtime.current().ops.backends[-1].algorithms
    assert algorithm.calls > 0, f"{type(algorithm).__name__} never ran"
