"""Multi-rank cases for frontends.tensorflow (run by tests/test_tensorflow.py).

Every rank can compute every other rank's input (`data`), so each case checks
its result against NumPy, or against the same training done by one process on
the whole batch. Collectives are checked eagerly and inside tf.function.
"""

import json
import os
import tempfile

import numpy as np

from tf_common import (assert_equal, both_modes, configure_tensorflow, data, expect_raises)

configure_tensorflow()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402

EVEN = None  # a static process set: ranks 0, 2, 4, ...
REDUCE_DTYPES = [np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32,
                 np.float64]


def setup(core):
    global EVEN
    EVEN = hvd.ProcessSet(range(0, int(os.environ["OMPI_COMM_WORLD_SIZE"]), 2))
    hvd.init(process_sets=[EVEN])
    hvd.init()  # a second call is harmless, as in Horovod


def everyone(shape, dtype, seed):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


# ---------------------------------------------------------------- basics
def case_queries_and_build_flags(core):
    assert hvd.is_initialized()
    assert hvd.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert hvd.rank() == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert hvd.local_size() * hvd.cross_size() == hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and not hvd.gloo_enabled()
    assert hvd.nccl_built() == 0 and not hvd.cuda_built() and not hvd.rocm_built()
    assert not hvd.ccl_built() and not hvd.ddl_built()
    assert isinstance(hvd.mpi_threads_supported(), bool)
    for mode, (rank, size, included) in both_modes(
            lambda: (hvd.rank_op(), hvd.size_op(), hvd.process_set_included_op(
                EVEN.process_set_id))):
        assert int(rank) == hvd.rank() and int(size) == hvd.size(), mode
        assert int(included) == int(hvd.rank() % 2 == 0), mode
    assert int(hvd.size_op(EVEN.process_set_id)) == EVEN.size()
    assert int(hvd.process_set_included_op(99)) == hvd.mpi_ops.HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET


# ---------------------------------------------------------- allreduce
def case_allreduce_every_dtype_and_op_eager_and_in_function(core):
    n = hvd.size()
    for dtype in REDUCE_DTYPES:
        inputs = everyone((3, 4), dtype, seed=1)
        stacked = np.stack(inputs)
        expected = {
            hvd.Sum: stacked.sum(axis=0, dtype=dtype),
            hvd.Min: stacked.min(axis=0),
            hvd.Max: stacked.max(axis=0),
            hvd.Product: stacked.prod(axis=0, dtype=dtype),
        }
        avg = stacked.astype(np.float64).sum(axis=0) / n
        if np.dtype(dtype).kind in "iu":
            avg = np.trunc(avg)
        mine = tf.constant(inputs[hvd.rank()])

        def reduce_all(x):
            return [hvd.allreduce(x, op=op) for op in expected] + [hvd.allreduce(x)]

        for mode, outs in both_modes(reduce_all, mine):
            for (op, exp), out in zip(expected.items(), outs):
                assert_equal(out.numpy(), exp.astype(dtype), f"{mode} {dtype.__name__} op {op}")
            assert outs[-1].dtype == tf.as_dtype(dtype)
            np.testing.assert_allclose(outs[-1].numpy().astype(np.float64), avg, rtol=1e-3,
                                       err_msg=f"{mode} average {dtype.__name__}")


def case_allreduce_scaling_variable_input_and_deprecated_average(core):
    inputs = everyone((5,), np.float64, seed=2)
    mine = tf.Variable(inputs[hvd.rank()])
    for mode, (scaled, avg2) in both_modes(lambda: (
            hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            hvd.allreduce(mine, postscale_factor=2.0))):
        np.testing.assert_allclose(scaled.numpy(), 3.0 * sum(0.5 * i for i in inputs),
                                   err_msg=mode)
        np.testing.assert_allclose(avg2.numpy(), 2.0 * sum(inputs) / hvd.size(), err_msg=mode)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(tf.constant(inputs[hvd.rank()]), average=False)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert deprecations and all(w.filename == __file__ for w in deprecations), \
        [(w.filename, w.lineno) for w in deprecations]
    np.testing.assert_allclose(summed.numpy(), sum(inputs))
    expect_raises(ValueError, hvd.allreduce, tf.ones(2), average=True, op=hvd.Sum)


def case_grouped_allreduce_mixed_dtypes(core):
    shapes = [(2, 3), (4,), ()]
    dtypes = [np.float32, np.int64, np.float64]
    inputs = [everyone(s, d, seed=10 + i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    mine = [tf.constant(per_rank[hvd.rank()]) for per_rank in inputs]
    for mode, outs in both_modes(lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum),
                                 *mine):
        assert isinstance(outs, list) and len(outs) == 3, mode
        for i, out in enumerate(outs):
            assert_equal(out.numpy(), np.sum(inputs[i], axis=0, dtype=dtypes[i]), f"{mode} {i}")
            assert out.shape == shapes[i], mode
    assert hvd.grouped_allreduce([]) == []


def case_allreduce_fp16_compression(core):
    inputs = everyone((6,), np.float32, seed=3)
    mine = tf.constant(inputs[hvd.rank()])
    for mode, out in both_modes(lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16),
                                mine):
        assert out.dtype == tf.float32, mode
        np.testing.assert_allclose(out.numpy(), np.mean(inputs, axis=0), rtol=1e-3,
                                   err_msg=mode)


def case_allreduce_indexed_slices_gathers_values_and_indices(core):
    n, r = hvd.size(), hvd.rank()
    values = tf.constant(np.full((2, 3), r + 1.0, np.float32))
    indices = tf.constant([r, r + 1], tf.int64)
    slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([n + 1, 3], tf.int64))
    for op, scale in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
        out = hvd.allreduce(slices, op=op)
        assert isinstance(out, tf.IndexedSlices)
        expected = np.zeros((n + 1, 3))
        for q in range(n):
            expected[[q, q + 1]] += (q + 1.0) * scale
        np.testing.assert_allclose(tf.convert_to_tensor(out).numpy(), expected)
    expect_raises(NotImplementedError, hvd.allreduce, slices, op=hvd.Max)
    expect_raises(NotImplementedError, hvd.allreduce, slices, op=hvd.Adasum)
    expect_raises(NotImplementedError, hvd.allreduce, slices, postscale_factor=2.0)


# ------------------------------------------------------ allgather/broadcast
def case_allgather_ragged_first_dimension_eager_and_in_function(core):
    for dtype in (np.float32, np.int32, np.bool_, np.float16, np.uint8, np.uint16):
        parts = [data(r, (r + 1, 3), dtype, seed=20) for r in range(hvd.size())]
        mine = tf.constant(parts[hvd.rank()])
        for mode, out in both_modes(lambda x: hvd.allgather(x), mine):
            assert_equal(out.numpy(), np.concatenate(parts), f"{mode} {dtype.__name__}")

    @tf.function
    def static_shape(x):
        out = hvd.allgather(x)
        assert out.shape.as_list() == [None, 3], out.shape
        return out

    static_shape(tf.ones([2, 3]))
    grouped = hvd.grouped_allgather([tf.fill([hvd.rank() + 1], hvd.rank()),
                                     tf.ones([1, 2]) * hvd.rank()])
    assert_equal(grouped[0].numpy(),
                 np.concatenate([np.full(r + 1, r, np.int32) for r in range(hvd.size())]))
    assert_equal(grouped[1].numpy(),
                 np.concatenate([np.ones((1, 2), np.float32) * r for r in range(hvd.size())]))


def case_broadcast_from_every_root(core):
    for root in range(hvd.size()):
        for dtype in (np.float64, np.int64, np.bool_):
            inputs = everyone((2, 3), dtype, seed=30 + root)
            mine = tf.constant(inputs[hvd.rank()])
            for mode, out in both_modes(lambda x: hvd.broadcast(x, root), mine):
                assert_equal(out.numpy(), inputs[root], f"{mode} root {root}")
                assert out.shape == (2, 3)


def case_alltoall_with_and_without_splits(core):
    n, r = hvd.size(), hvd.rank()
    # Rank r sends (q + 1) rows to rank q, each row holding 100 * r + q.
    splits = [q + 1 for q in range(n)]
    rows = np.concatenate([np.full((q + 1, 2), 100 * r + q, np.int32) for q in range(n)])
    expected = np.concatenate([np.full((r + 1, 2), 100 * s + r, np.int32) for s in range(n)])
    for mode, (out, received) in both_modes(
            lambda x, s: hvd.alltoall(x, splits=s), tf.constant(rows), tf.constant(splits)):
        assert_equal(out.numpy(), expected, mode)
        assert_equal(received.numpy(), np.full(n, r + 1, np.int32), mode)
    even = tf.constant(np.arange(2 * n, dtype=np.float32) + 10 * r)
    out = hvd.alltoall(even)
    assert_equal(out.numpy(), np.concatenate(
        [np.arange(2 * r, 2 * r + 2, dtype=np.float32) + 10 * s for s in range(n)]))


def case_reducescatter_uneven_rows(core):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # the first rank gets an extra row
    inputs = everyone((rows, 2), np.float32, seed=40)
    total = np.sum(inputs, axis=0)
    start = r * (rows // n) + min(r, rows % n)
    mine_rows = rows // n + (1 if r < rows % n else 0)
    mine = tf.constant(inputs[r])
    for mode, (summed, avg) in both_modes(
            lambda x: (hvd.reducescatter(x, op=hvd.Sum), hvd.reducescatter(x)), mine):
        np.testing.assert_allclose(summed.numpy(), total[start:start + mine_rows], err_msg=mode)
        np.testing.assert_allclose(avg.numpy(), total[start:start + mine_rows] / n,
                                   rtol=1e-6, err_msg=mode)
    grouped = hvd.grouped_reducescatter([mine, mine * 2], op=hvd.Sum)
    np.testing.assert_allclose(grouped[1].numpy(), 2 * total[start:start + mine_rows])
    exc = expect_raises(tf.errors.AbortedError, hvd.reducescatter, mine, op=hvd.Max)
    assert "AVERAGE and SUM" in str(exc)


# ---------------------------------------------------------- gradients
def case_gradients_are_horovods(core):
    n, r = hvd.size(), hvd.rank()

    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            ar_sum = hvd.allreduce(x * (r + 1.0), op=hvd.Sum)
            ar_avg = hvd.allreduce(x, op=hvd.Average)
            gathered = hvd.allgather(x)
            bcast = hvd.broadcast(x, n - 1)
            a2a = hvd.alltoall(tf.tile(x, [n]))
            rs = hvd.reducescatter(tf.tile(x, [n]), op=hvd.Sum)
        return [tape.gradient(y, x) for y in (ar_sum, ar_avg, gathered, bcast, a2a, rs)]

    x = tf.constant([1.0, 2.0])
    for mode, (g_sum, g_avg, g_gather, g_bcast, g_a2a, g_rs) in both_modes(grads, x):
        # allreduce: the same allreduce of the incoming gradient (ones).
        np.testing.assert_allclose(g_sum.numpy(), np.full(2, (r + 1.0) * n), err_msg=mode)
        np.testing.assert_allclose(g_avg.numpy(), np.ones(2), err_msg=mode)
        # allgather: averaged incoming gradient, this rank's slice.
        np.testing.assert_allclose(g_gather.numpy(), np.ones(2), err_msg=mode)
        # broadcast: averaged on the root, zero elsewhere.
        np.testing.assert_allclose(g_bcast.numpy(), np.full(2, 1.0 if r == n - 1 else 0.0),
                                   err_msg=mode)
        # alltoall: gradients go back where the rows came from.
        np.testing.assert_allclose(g_a2a.numpy(), np.full(2, float(n)), err_msg=mode)
        # reducescatter Sum: gathered, scaled by the set's size (Horovod).
        np.testing.assert_allclose(g_rs.numpy(), np.full(2, float(n * n)), err_msg=mode)


# ------------------------------------------------------ join, barrier
def case_join_contributes_zeros_and_returns_last_rank(core):
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        last = int(hvd.join())
    else:
        out = hvd.allreduce(tf.ones(3), op=hvd.Sum, name="while_rank0_joined")
        assert_equal(out.numpy(), np.full(3, n - 1.0, np.float32))
        last = int(hvd.join())
    lasts = core.allgather(np.array([last]), name="join.check")
    assert len(set(lasts.tolist())) == 1 and lasts[0] != 0, lasts


def case_barrier_eager_and_in_function(core):
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    if EVEN.included():
        hvd.barrier(process_set=EVEN)


# ------------------------------------------------------ process sets
def case_process_set_collectives_involve_only_members(core):
    r = hvd.rank()
    x = tf.constant([float(r)])
    if not EVEN.included():
        exc = expect_raises(tf.errors.InvalidArgumentError, hvd.allreduce, x,
                            process_set=EVEN)
        assert "not a member" in str(exc)
        return
    members = EVEN.ranks
    for mode, (s, g, b) in both_modes(lambda x: (
            hvd.allreduce(x, op=hvd.Sum, process_set=EVEN),
            hvd.allgather(x, process_set=EVEN),
            hvd.broadcast(x, members[-1], process_set=EVEN)), x):
        assert_equal(s.numpy(), np.array([float(sum(members))], np.float32), mode)
        assert_equal(g.numpy(), np.array(members, np.float32), mode)
        assert_equal(b.numpy(), np.array([float(members[-1])], np.float32), mode)


# ------------------------------------------------------ helpers
def case_broadcast_variables_eager_and_in_function(core):
    r = hvd.rank()
    tf_var = tf.Variable(np.full((3, 2), r, np.float32))
    int_var = tf.Variable([r, r + 1], dtype=tf.int64)
    keras_var = keras.Variable(np.full(4, r + 0.5, np.float64))
    hvd.broadcast_variables([tf_var, int_var, keras_var], root_rank=hvd.size() - 1)
    last = hvd.size() - 1
    assert_equal(tf_var.numpy(), np.full((3, 2), last, np.float32))
    assert_equal(int_var.numpy(), np.array([last, last + 1], np.int64))
    assert_equal(keras.ops.convert_to_numpy(keras_var), np.full(4, last + 0.5))

    other = tf.Variable(np.full(2, r, np.float32))

    @tf.function
    def in_function():
        hvd.broadcast_variables([other], root_rank=0)

    in_function()
    assert_equal(other.numpy(), np.zeros(2, np.float32))
    values = hvd.broadcast_([tf_var], root_rank=0)
    assert_equal(values[0].numpy(), np.full((3, 2), last, np.float32))


def case_broadcast_object_and_allgather_object(core):
    r = hvd.rank()
    obj = {"rank": r, "payload": list(range(r + 3))} if r == 1 else None
    got = hvd.broadcast_object(obj, root_rank=1, name="cfg")
    assert got == {"rank": 1, "payload": [0, 1, 2, 3]}
    gathered = hvd.allgather_object({"r": r, "s": "x" * r})
    assert gathered == [{"r": q, "s": "x" * q} for q in range(hvd.size())]
    expect_raises(RuntimeError, tf.function(lambda: hvd.broadcast_object(1)))


def case_broadcast_object_fn_gives_roots_object_call_after_call(core):
    r = hvd.rank()
    bcast = hvd.broadcast_object_fn(root_rank=1)
    for step in range(3):
        got = bcast({"step": step, "from": r, "data": np.arange(step + r)})
        assert got["step"] == step and got["from"] == 1, got
        assert_equal(got["data"], np.arange(step + 1))
    named = hvd.broadcast_object_fn(root_rank=0, name="config")
    assert named(["a", r]) == ["a", 0]


# ------------------------------------------------------ gradient tape
def _mlp(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(3)])
    return model


def _loss(model, x, y):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y, model(x), from_logits=True))


def case_distributed_gradient_tape_matches_single_process_full_batch(core):
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng(7)
    per_rank, steps, lr = 4, 5, 0.3
    xs = rng.normal(size=(steps, n * per_rank, 8)).astype(np.float32)
    ys = rng.integers(0, 3, size=(steps, n * per_rank))

    for mode in ("eager", "tf.function"):
        model = _mlp(seed=r)  # different on every rank...
        hvd.broadcast_variables(model.variables, root_rank=0)  # ...until broadcast

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = _loss(model, x, y)
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(lr * g)
            return loss

        run = step if mode == "eager" else tf.function(step)
        for s in range(steps):
            shard = slice(r * per_rank, (r + 1) * per_rank)
            run(tf.constant(xs[s, shard]), tf.constant(ys[s, shard]))

        reference = _mlp(seed=0)  # rank 0's initial weights, one process, whole batch
        for s in range(steps):
            with tf.GradientTape() as tape:
                loss = _loss(reference, tf.constant(xs[s]), tf.constant(ys[s]))
            grads = tape.gradient(loss, reference.trainable_variables)
            for v, g in zip(reference.trainable_variables, grads):
                v.assign_sub(lr * g)
        for a, b in zip(model.trainable_variables, reference.trainable_variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=mode)


def case_partial_tape_leaves_local_layer_unreduced(core):
    n, r = hvd.size(), hvd.rank()
    shared = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
    local = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    x = tf.constant([[r + 1.0, 1.0]])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
    g_shared, g_local = tape.gradient(loss, [shared.kernel, local.kernel])
    # d loss / d shared.kernel[i, j] = x_i (the local kernel is ones): averaged.
    mean_x = np.mean([[q + 1.0, 1.0] for q in range(n)], axis=0)
    np.testing.assert_allclose(g_shared.numpy(), np.stack([mean_x, mean_x], axis=1))
    # d loss / d local.kernel = shared(x) = sum(x) per unit: kept, divided by size.
    np.testing.assert_allclose(g_local.numpy(), np.full((2, 1), (r + 2.0) / n))
    local_pairs, shared_pairs = tape.get_local_and_global_gradients(
        loss, [shared.kernel, local.kernel])
    assert [v is local.kernel for v, _ in local_pairs] == [True]
    assert [v is shared.kernel for v, _ in shared_pairs] == [True]
    np.testing.assert_allclose(local_pairs[0][1].numpy(), g_local.numpy())
    expect_raises(ValueError, hvd.PartialDistributedGradientTape, tf.GradientTape(),
                  local_layers=["not a layer"])


def case_gradient_tape_indexed_slices_and_sparse_as_dense(core):
    n, r = hvd.size(), hvd.rank()
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(n + 2, 3)
    ids = tf.constant([r, r + 1])
    expected = np.zeros((n + 2, 3), np.float32)
    for q in range(n):
        expected[[q, q + 1]] += 1.0 / n
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(embedding(ids))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        (grad,) = tape.gradient(loss, [embedding.embeddings])
        assert isinstance(grad, tf.IndexedSlices) != sparse_as_dense
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), expected, rtol=1e-6)


def case_gradient_tape_groups_predivide_sum_and_fp16(core):
    n, r = hvd.size(), hvd.rank()
    variables = [tf.Variable(np.ones(k, np.float32)) for k in (2, 3, 4)]

    def tape_grads(**kwargs):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(v * (r + 1.0) * (i + 1)) for i, v in enumerate(variables))
        return hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, variables)

    mean_scale = np.mean([q + 1.0 for q in range(n)])
    expected = [np.full(k, mean_scale * (i + 1), np.float32) for i, k in enumerate((2, 3, 4))]
    for kwargs in ({}, {"groups": 2}, {"groups": [[variables[2], variables[0]]]},
                   {"gradient_predivide_factor": 2.0},
                   {"compression": hvd.Compression.fp16}):
        for g, e in zip(tape_grads(**kwargs), expected):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-3, err_msg=str(kwargs))
    for g, e in zip(tape_grads(op=hvd.Sum), expected):
        np.testing.assert_allclose(g.numpy(), e * n, rtol=1e-6)
    expect_raises(ValueError, hvd.DistributedGradientTape, tf.GradientTape(), op=hvd.Sum,
                  gradient_predivide_factor=2.0)
    expect_raises(ValueError, hvd.DistributedGradientTape, tf.GradientTape(), groups=-1)
    # Horovod's positional order: (target, sources, output_gradients,
    # use_generic_names); tf.GradientTape's unconnected_gradients stood fourth.
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(v * (r + 1.0) * (i + 1)) for i, v in enumerate(variables))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, variables, None, True)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-6)
    unused = tf.Variable(np.ones(2, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variables[0])
    grads = hvd.DistributedGradientTape(tape).gradient(
        loss, [variables[0], unused], unconnected_gradients=tf.UnconnectedGradients.ZERO)
    np.testing.assert_allclose(grads[1].numpy(), np.zeros(2, np.float32))


def case_sync_batch_norm_matches_full_batch(core):
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng(11)
    x_all = rng.normal(2.0, 3.0, size=(4 * n, 5)).astype(np.float32)
    w_all = rng.normal(size=(4 * n, 5)).astype(np.float32)
    shard = slice(4 * r, 4 * r + 4)

    def one_step(layer, x, w, distributed):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_mean(out * w)
        dx = tape.gradient(loss, x)  # this rank's rows: not averaged
        variables = layer.trainable_variables
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        return out, tape.gradient(loss, variables) + [dx]

    sync = hvd.SyncBatchNormalization(momentum=0.5)
    out, grads = one_step(sync, tf.constant(x_all[shard]), tf.constant(w_all[shard]), True)
    ref = keras.layers.BatchNormalization(momentum=0.5)
    ref_out, ref_grads = one_step(ref, tf.constant(x_all), tf.constant(w_all), False)
    np.testing.assert_allclose(out.numpy(), ref_out.numpy()[shard], rtol=1e-4, atol=1e-4)
    for g, rg in zip(grads[:2], ref_grads[:2]):  # gamma, beta
        np.testing.assert_allclose(g.numpy(), rg.numpy(), rtol=1e-4, atol=1e-5)
    # Input gradient: this rank's rows of the full-batch gradient (scaled by
    # n, since each rank's loss is the mean over its own rows).
    np.testing.assert_allclose(grads[2].numpy() / n, ref_grads[2].numpy()[shard], rtol=1e-3,
                               atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(),
                               rtol=1e-4)
    expect_raises(ValueError, hvd.SyncBatchNormalization, fused=True)


# ------------------------------------------------------ names
def case_names_follow_horovods_tensorflow_naming(core):
    seen = []
    original = core.allreduce

    def spy(tensor, *args, **kwargs):
        seen.append(kwargs.get("name"))
        return original(tensor, *args, **kwargs)

    core.allreduce = spy
    try:
        hvd.allreduce(tf.ones(2))
        hvd.allreduce(tf.ones(2), name="given")

        @tf.function
        def traced(x):
            with tf.name_scope("scope"):
                a = hvd.allreduce(x)
                b = hvd.allreduce(x)
                c = hvd.allreduce(x, name="mine", ignore_name_scope=True)
            return a, b, c

        traced(tf.ones(2))
    finally:
        core.allreduce = original
    assert seen == ["HorovodAllreduce", "given", "scope/HorovodAllreduce_x_0",
                    "scope/HorovodAllreduce_x_0_1", "mine"], seen


# ------------------------------------------------------ errors
def case_mismatches_raise_failed_precondition_naming_the_ranks(core):
    r, n = hvd.rank(), hvd.size()
    exc = expect_raises(tf.errors.FailedPreconditionError, hvd.allreduce,
                        tf.ones([r + 1]), name="ragged")
    message = str(exc)
    assert "ragged" in message and all(f"rank {q}" in message for q in range(n)), message
    exc = expect_raises(tf.errors.FailedPreconditionError, hvd.allreduce,
                        tf.ones(2, tf.float32 if r == 0 else tf.float64), name="dtypes")
    assert "float32" in str(exc) and "float64" in str(exc), str(exc)
    exc = expect_raises(tf.errors.FailedPreconditionError, hvd.broadcast, tf.ones(2), r,
                        name="roots")
    assert "root" in str(exc), str(exc)


def case_mismatch_inside_function_raises_failed_precondition(core):
    r = hvd.rank()

    @tf.function
    def ragged(x):
        return hvd.allreduce(x, name="ragged_in_function")

    exc = expect_raises(tf.errors.OpError, ragged, tf.ones([r + 1]))
    assert type(exc) is tf.errors.FailedPreconditionError, type(exc)
    message = str(exc)
    assert "TensorMismatchError" in message and "rank 1" in message, message
    assert "[coordinator:" not in message, message

    # Nested functions and a call that only some ranks make fail the same way;
    # other errors keep TensorFlow's own classes.
    @tf.function
    def outer(x):
        return ragged(x) * 2.0

    exc = expect_raises(tf.errors.OpError, outer, tf.ones([r + 1]))
    assert type(exc) is tf.errors.FailedPreconditionError, type(exc)

    @tf.function
    def bad_root(x):
        return hvd.broadcast(x, root_rank=hvd.size() + 5, name="bad_root_in_function")

    exc = expect_raises(tf.errors.OpError, bad_root, tf.ones(2))
    assert type(exc) is tf.errors.InvalidArgumentError, type(exc)
    # The job goes on.
    np.testing.assert_allclose(tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))(
        tf.ones(2)).numpy(), [hvd.size()] * 2)


def case_invalid_arguments_raise_invalid_argument(core):
    n = hvd.size()
    expect_raises(tf.errors.InvalidArgumentError, hvd.allgather, tf.constant(1.0))
    exc = expect_raises(tf.errors.InvalidArgumentError, hvd.alltoall, tf.ones([n + 1]))
    assert "multiple" in str(exc)
    expect_raises(tf.errors.InvalidArgumentError, hvd.alltoall, tf.ones([2]),
                  splits=[1] * (n + 1))
    expect_raises(tf.errors.InvalidArgumentError, hvd.broadcast, tf.ones(2), n + 5)
    # Unsupported dtypes fail when the op is built, with TypeError as
    # TensorFlow's op registration does for Horovod's ops.
    exc = expect_raises(TypeError, hvd.allreduce, tf.constant(["s"]))
    assert "string" in str(exc)
    expect_raises(TypeError, hvd.allreduce, tf.constant([True]))
    expect_raises(TypeError, tf.function(lambda: hvd.allgather(tf.constant([1], tf.uint32))))


def case_a_dtype_one_rank_refuses_eagerly_fails_on_every_rank_naming_it(core):
    """Eagerly, the other ranks fail at once naming the refusing rank (in
    Horovod they wait forever); the job goes on."""
    r, n = hvd.rank(), hvd.size()
    bad = n - 1
    calls = [
        (hvd.allreduce, tf.ones(2), tf.constant(["s"]), dict(name="refused_dtype")),
        (hvd.grouped_allreduce, [tf.ones(2), tf.ones(1)],
         [tf.ones(2), tf.constant([1], tf.uint32)], {}),
        (hvd.allgather, tf.ones(2), tf.constant([1], tf.uint32), {}),
        (hvd.reducescatter, tf.ones(n), tf.constant([True] * n), dict(op=hvd.Sum)),
    ]
    for fn, good, spoiled, kwargs in calls:
        if r == bad:
            expect_raises(TypeError, fn, spoiled, **kwargs)
        else:
            exc = expect_raises(tf.errors.OpError, fn, good, **kwargs)
            assert f"rank {bad} rejected" in str(exc), (fn.__name__, str(exc))
    np.testing.assert_allclose(hvd.allreduce(tf.ones(2), op=hvd.Sum).numpy(), [n] * 2)


def case_jit_compile_raises_a_clear_error(core):
    @tf.function(jit_compile=True)
    def compiled(x):
        return hvd.allreduce(x) * 2

    exc = expect_raises(tf.errors.InvalidArgumentError, compiled, tf.ones(2))
    assert "jit_compile" in str(exc) and "XLA" in str(exc), str(exc)
    # The same collective without XLA works.
    assert_equal(tf.function(lambda x: hvd.allreduce(x) * 2)(tf.ones(2)).numpy(),
                 np.full(2, 2.0, np.float32))


# ------------------------------------------------------ timeline
def case_timeline_records_tensorflow_ops(core):
    path = os.path.join(tempfile.mkdtemp(prefix="tf_timeline_"), "timeline.json")
    hvd.start_timeline(path)  # rank 0 writes it
    hvd.allreduce(tf.ones(4), name="timeline_tensor")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            events = json.load(f)
        assert "timeline_tensor" in json.dumps(events), json.dumps(events)[:500]
