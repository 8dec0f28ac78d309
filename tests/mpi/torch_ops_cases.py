"""Multi-rank cases for frontends.torch's collectives, errors and autograd
(run by tests/test_torch_mpi.py).

Every rank can build every other rank's input (`data`), so each case checks
its result against the value computed independently with torch/NumPy on one
process. The runner hands each case the core module; the cases use the torch
frontend, imported here as a Horovod user would.
"""

import json
import os
import tempfile
import warnings

import numpy as np
import torch

import frontends.torch as hvd
from peers import while_in_flight

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
REDUCIBLE = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64] + FLOATS
MOVABLE = REDUCIBLE + [torch.bool]


def setup(core):
    hvd.init(process_sets="dynamic")


def data(rank, shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randint(-8, 8, shape, generator=gen).to(dtype)
    return torch.randint(1, 5, shape, generator=gen).to(dtype)


def everyone(shape, dtype=torch.float32, seed=0):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def same(actual, expected, what="", atol=0.0):
    assert isinstance(actual, torch.Tensor), f"{what}: not a tensor but {type(actual)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if atol:
        torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=0,
                                   msg=what)
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


# ------------------------------------------------------------------- basics
def case_queries_answer_for_this_build(_core):
    from mpi4py import MPI

    assert hvd.is_initialized() is True
    assert (hvd.rank(), hvd.size()) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    assert hvd.local_size() * hvd.cross_size() == hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert isinstance(hvd.is_homogeneous(), bool)
    assert hvd.mpi_built() is True and hvd.mpi_enabled() is True
    assert hvd.gloo_built() is False and hvd.gloo_enabled() is False
    assert hvd.nccl_built() == 0 and isinstance(hvd.nccl_built(), int)
    for query in (hvd.ccl_built, hvd.cuda_built, hvd.rocm_built, hvd.ddl_built):
        assert query() is False, query.__name__
    assert hvd.mpi_threads_supported() is True
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    hvd.init()  # a second init is harmless, as in Horovod
    assert hvd.size() == MPI.COMM_WORLD.size


# ---------------------------------------------------------------- allreduce
def case_allreduce_every_dtype_and_op_matches_torch(_core):
    n = hvd.size()
    for dtype in REDUCIBLE:
        inputs = everyone((3, 4), dtype, seed=1)
        mine = inputs[hvd.rank()].clone()
        stacked = torch.stack([t.double() for t in inputs])
        expected = {hvd.Sum: stacked.sum(0), hvd.Min: stacked.min(0).values,
                    hvd.Max: stacked.max(0).values, hvd.Product: stacked.prod(0)}
        for op, exp in expected.items():
            out = hvd.allreduce(mine, op=op)
            wrapped = exp.to(dtype) if dtype.is_floating_point else exp.to(torch.int64).to(dtype)
            same(out, wrapped, f"{dtype} op {op}")
        avg = hvd.allreduce(mine, name=f"avg.{dtype}")
        exp = stacked.sum(0) / n
        if not dtype.is_floating_point:
            exp = torch.trunc(exp)
        same(avg, exp.to(dtype), f"{dtype} average", atol=0.05 if dtype.is_floating_point else 0)
        assert torch.equal(mine, inputs[hvd.rank()]), "allreduce modified its input"


def case_allreduce_adasum_follows_the_published_tree(_core):
    from torch_training_cases import _adasum

    inputs = everyone((6,), torch.float64, seed=40)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Adasum, name="adasum")
    expected = _adasum([t.numpy() for t in inputs])
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    twice = hvd.allreduce(torch.full((3,), 2.0), op=hvd.Adasum)  # equal vectors: their average
    same(twice, torch.full((3,), 2.0), "adasum of equal vectors", atol=1e-6)


def case_allreduce_in_place_variants_return_the_input_tensor(_core):
    inputs = everyone((5,), seed=2)
    expected = torch.stack(inputs).sum(0)
    t = inputs[hvd.rank()].clone()
    assert hvd.allreduce_(t, op=hvd.Sum, name="inplace") is t
    same(t, expected, "allreduce_")
    t = inputs[hvd.rank()].clone()
    handle = hvd.allreduce_async_(t, op=hvd.Sum)
    assert isinstance(handle, int)
    while not hvd.poll(handle):
        pass
    assert hvd.synchronize(handle) is t
    same(t, expected, "allreduce_async_")
    out_handle = hvd.allreduce_async(inputs[hvd.rank()], op=hvd.Sum)
    same(hvd.synchronize(out_handle), expected, "allreduce_async")
    assert hvd.synchronize(out_handle) is None  # a spent handle is unknown, as in Horovod


def case_allreduce_scale_factors_and_deprecated_average(_core):
    n = hvd.size()
    inputs = everyone((4,), torch.float64, seed=3)
    total = torch.stack(inputs).sum(0)
    out = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=0.5,
                        postscale_factor=3.0)
    same(out, total * 1.5, "pre/post", atol=1e-12)
    out = hvd.allreduce(inputs[hvd.rank()], prescale_factor=2.0)
    same(out, total * 2.0 / n, "average with prescale", atol=1e-12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = hvd.allreduce(inputs[hvd.rank()], average=False)
        out_async = hvd.synchronize(hvd.allreduce_async(inputs[hvd.rank()], average=False))
    same(out, total, "average=False means Sum")
    same(out_async, total, "average=False means Sum (async)")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    # Both warnings point at the caller's line, as Horovod's do.
    assert len(deprecations) == 2 and all(w.filename == __file__ for w in deprecations), \
        [(w.filename, w.lineno) for w in deprecations]
    expect_raises(ValueError, hvd.allreduce, inputs[hvd.rank()], average=True, op=hvd.Sum)


def case_allreduce_fp16_compression_keeps_dtype(_core):
    inputs = everyone((64,), torch.float32, seed=4)
    mine = inputs[hvd.rank()] / 7.0
    out = hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    exp = torch.stack([t / 7.0 for t in inputs]).sum(0)
    torch.testing.assert_close(out, exp, rtol=2e-3, atol=2e-3)


def case_grouped_allreduce_all_four_variants(_core):
    shapes = [(3,), (2, 2), (1,)]
    inputs = [everyone(s, seed=5 + i) for i, s in enumerate(shapes)]
    mine = [per_rank[hvd.rank()] for per_rank in inputs]
    sums = [torch.stack(per_rank).sum(0) for per_rank in inputs]
    out = hvd.grouped_allreduce(mine, op=hvd.Sum, name="g")
    assert isinstance(out, list) and len(out) == 3
    for o, e in zip(out, sums):
        same(o, e, "grouped_allreduce")
    res = hvd.synchronize(hvd.grouped_allreduce_async(mine, op=hvd.Sum))
    assert isinstance(res, tuple)
    for o, e in zip(res, sums):
        same(o, e, "grouped_allreduce_async")
    copies = [t.clone() for t in mine]
    res = hvd.grouped_allreduce_(copies, op=hvd.Sum)
    assert isinstance(res, tuple) and all(r is c for r, c in zip(res, copies))
    for o, e in zip(copies, sums):
        same(o, e, "grouped_allreduce_")
    copies = [t.clone() for t in mine]
    res = hvd.synchronize(hvd.grouped_allreduce_async_(copies))
    for o, e in zip(res, sums):
        same(o, e / hvd.size(), "grouped_allreduce_async_ (average)", atol=1e-6)


def case_names_follow_horovod_and_appear_in_mismatch_errors(_core):
    """Handles are ints from one counter over all op types; unnamed ops are
    '<op>.noname.<k>' (k counting unnamed ops), named ones '<op>.<name>',
    grouped members '<base>_<i>of<N>'. Shown through the error a mismatch
    raises, which names the tensor and what each rank sent."""
    me = hvd.rank()
    shape = (2,) if me == 0 else (3,)
    h1 = hvd.allreduce_async(torch.ones(shape))
    h2 = hvd.allgather_async(torch.ones(1, *shape))
    assert h2 == h1 + 1 and isinstance(h1, int)
    exc = expect_raises(hvd.HorovodInternalError, hvd.synchronize, h1)
    assert isinstance(exc, RuntimeError)
    text = str(exc)
    assert "'allreduce.noname." in text, text
    assert "rank 0" in text and "(2,)" in text and "(3,)" in text, text
    exc = expect_raises(hvd.HorovodInternalError, hvd.synchronize, h2)
    assert "'allgather.noname." in str(exc), str(exc)
    h3 = hvd.grouped_allreduce_async([torch.ones(1), torch.ones(shape)], name="grp")
    exc = expect_raises(hvd.HorovodInternalError, hvd.synchronize, h3)
    assert "'grouped_allreduce.grp_2of2'" in str(exc), str(exc)
    h4 = hvd.allreduce_async(torch.ones(shape), name="named")
    exc = expect_raises(RuntimeError, hvd.synchronize, h4)
    assert "'allreduce.named'" in str(exc), str(exc)


def case_ops_run_by_some_ranks_do_not_shift_unnamed_names(_core):
    solo = hvd.add_process_set([0])
    if hvd.rank() == 0:
        hvd.allreduce(torch.ones(1), name="only.rank.zero", process_set=solo)
        hvd.allreduce(torch.ones(1), process_set=solo)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    same(out, torch.full((2,), float(hvd.size())), "unnamed after asymmetric ops")
    hvd.barrier()
    assert hvd.remove_process_set(solo)


def case_mismatched_dtypes_raise_horovod_internal_error(_core):
    dtype = torch.float32 if hvd.rank() == 0 else torch.int32
    exc = expect_raises(hvd.HorovodInternalError, hvd.allreduce, torch.ones(3, dtype=dtype),
                        name="dtype.mismatch")
    assert "float32" in str(exc) and "int32" in str(exc), str(exc)


def case_invalid_arguments_raise_value_error(_core):
    t = torch.ones(4)
    exc = while_in_flight(hvd, lambda name: hvd.allreduce_async(t, name=name),
                          lambda name: expect_raises(ValueError, hvd.allreduce_async, t, name=name),
                          names=("dup.a", "dup.b"))
    assert "dup." in str(exc)
    exc = expect_raises(ValueError, hvd.allreduce, torch.ones(2, dtype=torch.complex64))
    assert "not supported" in str(exc)
    expect_raises(ValueError, hvd.allreduce, torch.ones(2, dtype=torch.bool))
    exc = expect_raises(ValueError, hvd.allreduce_, torch.ones(4, 1).expand(4, 4))
    assert "share memory" in str(exc)
    expect_raises(ValueError, hvd.broadcast, t, root_rank=hvd.size())
    expect_raises(ValueError, hvd.alltoall, torch.ones(hvd.size() + 1, 2))
    expect_raises(ValueError, hvd.alltoall, t, splits=torch.tensor([1] * hvd.size()))
    expect_raises(ValueError, hvd.alltoall, t, splits=[5] * hvd.size())
    expect_raises(hvd.HorovodInternalError, hvd.reducescatter, t, op=hvd.Max)
    expect_raises(ValueError, hvd.allgather, torch.tensor(1.0))
    assert hvd.synchronize(10 ** 9) is None
    expect_raises(ValueError, hvd.poll, 10 ** 9)


def case_tensors_that_are_not_contiguous_are_reduced_and_written_back(_core):
    """channels_last, transposed, strided: reduced as contiguous copies
    (Horovod refuses them); in place, the result lands in the tensor itself,
    in its own layout, and nowhere else in its storage."""
    n, me = hvd.size(), hvd.rank()
    image = data(me, (2, 3, 4, 4))
    want = torch.stack(everyone((2, 3, 4, 4))).sum(0)
    cl = image.contiguous(memory_format=torch.channels_last)
    assert hvd.allreduce_(cl, op=hvd.Sum, name="cl") is cl
    assert cl.is_contiguous(memory_format=torch.channels_last)
    same(cl, want, "channels_last in place")
    same(hvd.allreduce(image.contiguous(memory_format=torch.channels_last), op=hvd.Sum),
         want, "channels_last")
    base = torch.zeros(4, 6)
    strided = base[:, ::2]
    strided.copy_(data(me, (4, 3), seed=3))
    hvd.allreduce_(strided, op=hvd.Max, name="strided")
    same(strided, torch.stack(everyone((4, 3), seed=3)).max(0).values, "strided")
    assert not base[:, 1::2].any(), "an in-place write spilled"
    t = data(me, (3, 5), seed=4).t()
    hvd.broadcast_(t, root_rank=n - 1, name="transposed")
    same(t, data(n - 1, (3, 5), seed=4).t(), "transposed broadcast")
    gathered = hvd.allgather(data(me, (3, 2), seed=5).t())
    same(gathered, torch.cat([data(r, (3, 2), seed=5).t() for r in range(n)]), "allgather")


def case_input_one_rank_refuses_fails_on_every_rank_naming_it(_core):
    """The frontend's own checks (a supported dtype, int32 splits, an
    in-place target without shared elements) raise ValueError on the rank
    that fails them, and the other ranks fail at once naming it (in Horovod
    they wait forever). Unnamed ops keep their names in step afterwards."""
    bad = hvd.size() - 1
    me = hvd.rank()

    def refused(fn, good, spoiled, *args, **kwargs):
        if me == bad:
            return expect_raises(ValueError, fn, spoiled, *args, **kwargs)
        exc = expect_raises(hvd.HorovodInternalError, fn, good, *args, **kwargs)
        assert f"rank {bad} rejected" in str(exc), str(exc)
        return exc

    x = torch.ones(4, 4)
    shared = torch.ones(4, 1).expand(4, 4)  # every row in one place
    exc = refused(hvd.allreduce_, x, shared)
    assert "share memory" in str(exc) and "allreduce.noname." in str(exc), str(exc)
    refused(hvd.allreduce, x, x.to(torch.complex64))
    exc = refused(hvd.grouped_allreduce_, [torch.ones(2), torch.ones(3)],
                  [torch.ones(2), torch.ones(3, dtype=torch.complex64)], name="g.refused")
    assert "grouped_allreduce.g.refused" in str(exc), str(exc)
    refused(hvd.allgather, torch.ones(2), torch.ones(2, dtype=torch.complex64))
    refused(hvd.broadcast_, x, shared, root_rank=0, name="bc.refused")
    rows = torch.ones(hvd.size(), 2)
    refused(hvd.alltoall, rows, rows, splits=torch.ones(hvd.size(), dtype=torch.int32)
            if me != bad else torch.ones(hvd.size(), dtype=torch.int64))
    refused(hvd.reducescatter, rows, rows.bool(), op=hvd.Sum)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    same(out, torch.full((2,), float(hvd.size())), "unnamed after refusals")


# ---------------------------------------------------------------- allgather
def case_allgather_ragged_every_dtype(_core):
    for dtype in MOVABLE:
        inputs = [data(r, (r + 1, 3), dtype, seed=6) for r in range(hvd.size())]
        out = hvd.allgather(inputs[hvd.rank()])
        same(out, torch.cat(inputs), f"allgather {dtype}")
        out = hvd.synchronize(hvd.allgather_async(inputs[hvd.rank()]))
        same(out, torch.cat(inputs), f"allgather_async {dtype}")


def case_grouped_allgather_returns_a_tuple(_core):
    a = [data(r, (r + 1,), seed=7) for r in range(hvd.size())]
    b = [data(r, (2, 2), torch.int64, seed=8) for r in range(hvd.size())]
    out = hvd.grouped_allgather([a[hvd.rank()], b[hvd.rank()]])
    assert isinstance(out, tuple) and len(out) == 2
    same(out[0], torch.cat(a), "grouped a")
    same(out[1], torch.cat(b), "grouped b")
    out = hvd.synchronize(hvd.grouped_allgather_async([a[hvd.rank()], b[hvd.rank()]]))
    assert isinstance(out, tuple)
    same(out[1], torch.cat(b), "grouped async b")


# ---------------------------------------------------------------- broadcast
def case_broadcast_every_variant_from_every_root(_core):
    for root in range(hvd.size()):
        for dtype in (torch.float32, torch.int8, torch.bool, torch.bfloat16):
            inputs = everyone((2, 3), dtype, seed=9 + root)
            mine = inputs[hvd.rank()].clone()
            same(hvd.broadcast(mine, root), inputs[root], f"broadcast root {root} {dtype}")
            same(mine, inputs[hvd.rank()], "broadcast left its input alone")
            same(hvd.synchronize(hvd.broadcast_async(mine, root_rank=root)), inputs[root],
                 "broadcast_async")
            assert hvd.broadcast_(mine, root) is mine
            same(mine, inputs[root], "broadcast_")
            mine = inputs[hvd.rank()].clone()
            assert hvd.synchronize(hvd.broadcast_async_(mine, root, name=f"b{root}")) is mine
            same(mine, inputs[root], "broadcast_async_")


# ----------------------------------------------------------------- alltoall
def case_alltoall_even_and_uneven_splits(_core):
    n, me = hvd.size(), hvd.rank()
    t = torch.arange(2 * n, dtype=torch.float32) + 100 * me
    out = hvd.alltoall(t)
    expected = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * r
                          for r in range(n)])
    same(out, expected, "even alltoall returns the output alone")
    # Rank r sends (r + d + 1) rows to rank d; rows carry (sender, index).
    def rows_for(r):
        splits = [r + d + 1 for d in range(n)]
        rows = torch.tensor([[r, i] for i in range(sum(splits))], dtype=torch.int64)
        return rows, splits
    rows, splits = rows_for(me)
    for how in ("list", "tensor"):
        arg = splits if how == "list" else torch.tensor(splits, dtype=torch.int32)
        out, received = hvd.alltoall(rows, splits=arg)
        expected_parts, expected_received = [], []
        for r in range(n):
            r_rows, r_splits = rows_for(r)
            start = sum(r_splits[:me])
            expected_parts.append(r_rows[start:start + r_splits[me]])
            expected_received.append(r_splits[me])
        same(out, torch.cat(expected_parts), f"alltoall splits as {how}")
        same(received, torch.tensor(expected_received, dtype=torch.int32), "received_splits")
    out, received = hvd.synchronize(hvd.alltoall_async(t))
    same(received, torch.full((n,), 2, dtype=torch.int32), "alltoall_async gives the pair")


# ------------------------------------------------------------ reducescatter
def case_reducescatter_sum_average_uneven_and_grouped(_core):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    inputs = everyone((rows, 2), torch.float64, seed=11)
    total = torch.stack(inputs).sum(0)
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(counts[:me])
    mine = total[start:start + counts[me]]
    same(hvd.reducescatter(inputs[me], op=hvd.Sum), mine, "reducescatter Sum")
    same(hvd.reducescatter(inputs[me]), mine / n, "reducescatter Average", atol=1e-12)
    same(hvd.synchronize(hvd.reducescatter_async(inputs[me], op=hvd.Sum,
                                                 prescale_factor=2.0)),
         mine * 2, "reducescatter_async prescale", atol=1e-12)
    other = everyone((n, 3), torch.float32, seed=12)
    other_total = torch.stack(other).sum(0)[me:me + 1]
    out = hvd.grouped_reducescatter([inputs[me], other[me]], op=hvd.Sum)
    assert isinstance(out, list)
    same(out[0], mine, "grouped 0")
    same(out[1], other_total, "grouped 1")
    res = hvd.synchronize(hvd.grouped_reducescatter_async([inputs[me], other[me]], op=hvd.Sum))
    assert isinstance(res, tuple)
    same(res[1], other_total, "grouped async 1")


# ------------------------------------------------------------------ sparse
def case_sparse_allreduce_async_returns_a_callable(_core):
    n, me = hvd.size(), hvd.rank()
    dense = [torch.zeros(5, 3) for _ in range(n)]
    for r in range(n):
        dense[r][r % 5] = r + 1.0
        dense[r][4] = 1.0
    sparse = dense[me].to_sparse()
    wait = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)
    assert callable(wait)
    out = wait()
    assert out.is_sparse
    same(out.to_dense(), torch.stack(dense).sum(0), "sparse Sum")
    out = hvd.sparse_allreduce_async(sparse, name="emb.avg", op=hvd.Average)()
    same(out.to_dense(), torch.stack(dense).sum(0) / n, "sparse Average", atol=1e-6)


# ------------------------------------------------------- control and sets
def case_barrier_and_poll(_core):
    assert hvd.barrier() is None
    h = hvd.allreduce_async(torch.ones(2))
    hvd.barrier()
    assert isinstance(hvd.poll(h), bool)
    hvd.synchronize(h)


def case_join_returns_last_rank_and_joined_ranks_send_zeros(_core):
    n, me = hvd.size(), hvd.rank()
    last = n - 1
    if me == last:
        total = hvd.allreduce(torch.full((3,), 5.0), op=hvd.Sum, name="join.extra")
        same(total, torch.full((3,), 5.0), "joined ranks contribute zeros")
        avg = hvd.allreduce(torch.full((2,), 6.0), name="join.avg")
        same(avg, torch.full((2,), 6.0 / n), "average still divides by the full size",
             atol=1e-6)
    assert hvd.join() == last


def case_process_set_collectives_and_membership(_core):
    n, me = hvd.size(), hvd.rank()
    members = [1, n - 1] if n > 2 else [1]
    ps = hvd.add_process_set(members)
    assert ps.ranks == members
    if me in members:
        out = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=ps)
        same(out, torch.tensor([float(sum(members))]), "set allreduce")
        got = hvd.broadcast(torch.tensor([me]), root_rank=members[-1], process_set=ps)
        same(got, torch.tensor([members[-1]]), "broadcast root is a global rank")
        gathered = hvd.allgather(torch.tensor([me]), process_set=ps)
        same(gathered, torch.tensor(members), "set allgather")
    else:
        exc = expect_raises(ValueError, hvd.allreduce, torch.ones(1), process_set=ps)
        assert "not a member" in str(exc)
    hvd.barrier()
    assert hvd.remove_process_set(ps) is True


def case_timeline_records_torch_tensor_names(_core):
    path = os.path.join(tempfile.gettempdir(), f"torch_timeline_{os.getppid()}.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(8), name="traced.tensor")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            events = json.load(f)
        names = json.dumps(events)
        assert "allreduce.traced.tensor" in names
        os.remove(path)


# ----------------------------------------------------------------- autograd
def _weights(shape, seed):
    """Per-rank loss weights c_r: each rank's loss is (output * c_r).sum()."""
    return everyone(shape, torch.float64, seed=seed)


def case_allreduce_gradients_follow_horovod(_core):
    n, me = hvd.size(), hvd.rank()
    c = _weights((4,), 20)
    for op, expected in ((hvd.Sum, torch.stack(c).sum(0)),
                         (hvd.Average, torch.stack(c).sum(0) / n)):
        x = data(me, (4,), torch.float64, 21).requires_grad_()
        (hvd.allreduce(x, op=op) * c[me]).sum().backward()
        same(x.grad, expected, f"allreduce grad op {op}", atol=1e-12)
    x = data(me, (4,), torch.float64, 21).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5) * c[me]).sum() \
        .backward()
    same(x.grad, torch.stack(c).sum(0), "scale factors", atol=1e-12)


def case_min_max_product_gradients_are_true_subgradients(_core):
    n, me = hvd.size(), hvd.rank()
    xs = [torch.tensor([float(r), -float(r), 2.0, r + 1.0], dtype=torch.float64)
          for r in range(n)]
    c = _weights((4,), 22)
    total = torch.stack(c).sum(0)
    for op, pick in ((hvd.Max, torch.max), (hvd.Min, torch.min)):
        x = xs[me].clone().requires_grad_()
        (hvd.allreduce(x, op=op) * c[me]).sum().backward()
        extreme = pick(torch.stack(xs), dim=0).values
        holders = torch.stack([(v == extreme).double() for v in xs])
        same(x.grad, total * holders[me] / holders.sum(0), f"op {op}", atol=1e-12)
    x = xs[me].clone().requires_grad_()
    (hvd.allreduce(x, op=hvd.Product) * c[me]).sum().backward()
    others = torch.stack([v for r, v in enumerate(xs) if r != me]).prod(0)
    same(x.grad, total * others, "product", atol=1e-12)


def case_grouped_allreduce_gradients(_core):
    n, me = hvd.size(), hvd.rank()
    c1, c2 = _weights((3,), 23), _weights((2, 2), 24)
    a = data(me, (3,), torch.float64, 25).requires_grad_()
    b = data(me, (2, 2), torch.float64, 26).requires_grad_()
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Average)
    ((ya * c1[me]).sum() + (yb * c2[me]).sum()).backward()
    same(a.grad, torch.stack(c1).sum(0) / n, "grouped a", atol=1e-12)
    same(b.grad, torch.stack(c2).sum(0) / n, "grouped b", atol=1e-12)


def case_allgather_gradient_is_my_rows_of_the_average(_core):
    n, me = hvd.size(), hvd.rank()
    rows = [r + 1 for r in range(n)]
    total_rows = sum(rows)
    c = _weights((total_rows, 2), 27)
    x = data(me, (rows[me], 2), torch.float64, 28).requires_grad_()
    (hvd.allgather(x) * c[me]).sum().backward()
    start = sum(rows[:me])
    same(x.grad, (torch.stack(c).sum(0) / n)[start:start + rows[me]], "allgather grad",
         atol=1e-12)
    y = data(me, (2,), torch.float64, 29).requires_grad_()
    ga, gb = hvd.grouped_allgather([x.detach().clone().requires_grad_(), y])
    (gb * _weights((2 * n,), 30)[me]).sum().backward()
    cy = torch.stack(_weights((2 * n,), 30)).sum(0) / n
    same(y.grad, cy[2 * me:2 * me + 2], "grouped allgather grad", atol=1e-12)


def case_broadcast_gradient_goes_to_the_root(_core):
    n, me = hvd.size(), hvd.rank()
    root = n - 1
    c = _weights((3,), 31)
    x = data(me, (3,), torch.float64, 32).requires_grad_()
    (hvd.broadcast(x, root) * c[me]).sum().backward()
    expected = torch.stack(c).sum(0) / n if me == root else torch.zeros(3, dtype=torch.float64)
    same(x.grad, expected, "broadcast grad", atol=1e-12)


def case_alltoall_gradient_returns_along_the_received_splits(_core):
    n, me = hvd.size(), hvd.rank()
    splits = [[(r + d) % 2 + 1 for d in range(n)] for r in range(n)]  # rank r sends to d
    received = [sum(splits[r][d] for r in range(n)) for d in range(n)]
    c = [data(r, (received[r], 2), torch.float64, 33) for r in range(n)]
    x = data(me, (sum(splits[me]), 2), torch.float64, 34).requires_grad_()
    out, _ = hvd.alltoall(x, splits=splits[me])
    (out * c[me]).sum().backward()
    # The gradient of my rows sent to d is d's weights for the rows it received from me.
    parts = []
    for d in range(n):
        start = sum(splits[r][d] for r in range(me))
        parts.append(c[d][start:start + splits[me][d]])
    same(x.grad, torch.cat(parts), "alltoall grad")


def case_reducescatter_gradient_follows_horovod(_core):
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = data(me, (rows, 2), torch.float64, 35).requires_grad_()
        c = _weights((2, 2), 36)
        (hvd.reducescatter(x, op=op, prescale_factor=3.0) * c[me]).sum().backward()
        same(x.grad, torch.cat(c) * factor * 3.0, f"reducescatter grad op {op}", atol=1e-12)
    a = data(me, (rows, 2), torch.float64, 37).requires_grad_()
    ra, = hvd.grouped_reducescatter([a], op=hvd.Sum)
    (ra * _weights((2, 2), 38)[me]).sum().backward()
    same(a.grad, torch.cat(_weights((2, 2), 38)) * n, "grouped reducescatter grad", atol=1e-12)


def case_horovods_named_autograd_functions_take_its_apply_arguments(_core):
    """horovod.torch.mpi_ops's Horovod* Functions, called as Horovod programs
    call them: same results and gradients as the public forms."""
    from frontends.torch import mpi_ops

    n, me = hvd.size(), hvd.rank()
    ps = hvd.global_process_set
    c = _weights((2 * n * n, 2), 39)  # as many rows as the largest result (allgather)

    def grad_of(run):
        x = data(me, (2 * n, 2), torch.float64, 40).requires_grad_()
        out = run(x)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        sum((o * c[me][:o.shape[0]]).sum() for o in outs).backward()
        return [o.detach() for o in outs], x.grad

    pairs = {
        "allreduce": (lambda x: mpi_ops.HorovodAllreduce.apply(x, None, None, hvd.Sum, 2.0,
                                                               1.0, ps),
                      lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)),
        "grouped allreduce": (
            lambda x: mpi_ops.HorovodGroupedAllreduce.apply(None, None, hvd.Average, 1.0, 1.0,
                                                            ps, x, x * 2),
            lambda x: hvd.grouped_allreduce([x, x * 2], op=hvd.Average)),
        "allgather": (lambda x: mpi_ops.HorovodAllgather.apply(x, None, ps),
                      lambda x: hvd.allgather(x)),
        "grouped allgather": (lambda x: mpi_ops.HorovodGroupedAllgather.apply(None, ps, x, x),
                              lambda x: hvd.grouped_allgather([x, x])),
        "broadcast": (lambda x: mpi_ops.HorovodBroadcast.apply(x, n - 1, None, ps),
                      lambda x: hvd.broadcast(x, n - 1)),
        "alltoall": (lambda x: mpi_ops.HorovodAlltoall.apply(x, None, None, ps),
                     lambda x: hvd.alltoall(x)),
        "reducescatter": (
            lambda x: mpi_ops.HorovodReducescatter.apply(x, None, hvd.Sum, ps, 1.0, 0.5),
            lambda x: hvd.reducescatter(x, op=hvd.Sum, postscale_factor=0.5)),
        "grouped reducescatter": (
            lambda x: mpi_ops.HorovodGroupedReducescatter.apply(None, hvd.Average, ps, 1.0,
                                                                1.0, x),
            lambda x: hvd.grouped_reducescatter([x], op=hvd.Average)),
    }
    for what, (named, public) in pairs.items():
        (outs, grad), (want_outs, want_grad) = grad_of(named), grad_of(public)
        assert len(outs) == len(want_outs), what
        for o, w in zip(outs, want_outs):
            same(o, w, f"{what} result", atol=1e-12)
        same(grad, want_grad, f"{what} gradient", atol=1e-12)
    splits = torch.tensor([2] * n, dtype=torch.int32)
    out, received = mpi_ops.HorovodAlltoall.apply(data(me, (2 * n, 2), torch.float64, 41),
                                                  splits, None, ps)
    assert out.shape == (2 * n, 2) and received.tolist() == [2] * n


# ------------------------------------------------------------- last: shutdown
def case_after_shutdown_collectives_raise_then_init_restores(_core):
    h = hvd.allreduce_async(torch.ones(2), name="before.shutdown")
    hvd.synchronize(h)
    hvd.shutdown()
    assert hvd.is_initialized() is False
    exc = expect_raises(hvd.HorovodInternalError, hvd.allreduce, torch.ones(2))
    assert isinstance(exc, RuntimeError) and "init" in str(exc)
    expect_raises(ValueError, hvd.rank)
    hvd.init(process_sets="dynamic")
    # The handle counter restarts at 1 after shutdown, as in Horovod.
    h = hvd.allreduce_async(torch.ones(2))
    assert h == 1, h
    same(hvd.synchronize(h), torch.ones(2), "after re-init")
