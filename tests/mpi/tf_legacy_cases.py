"""Multi-rank cases for Horovod's TensorFlow 1 API in frontends.tensorflow
(legacy.py): broadcast_global_variables, BroadcastGlobalVariablesHook and the
DistributedOptimizer of a tf.compat.v1.train.Optimizer, in tf.compat.v1
graphs run by a Session (run by tests/test_tensorflow_legacy.py). Every
expected value is computed with NumPy from all ranks' inputs.

The gradients are mostly those of sum(w * c) for a coefficient tensor c that
differs between ranks: exactly c, so that every reduction can be checked
exactly.
"""

import contextlib
import warnings

import numpy as np

from tf_common import configure_tensorflow, data, expect_raises

configure_tensorflow()

import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402
from frontends.tensorflow import collectives  # noqa: E402

v1 = tf.compat.v1
LR = 0.1


def _config():
    # Two inter-op threads, as in tf_graph_cases.py.
    return v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)


def _session(graph):
    return v1.Session(graph=graph, config=_config())


def _initialize(sess):
    sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])


def _every_rank(value):
    """[value on rank 0, value on rank 1, ...] (gathered eagerly)."""
    return hvd.allgather_object(np.asarray(value))


def _assert_same_on_every_rank(value, what):
    for q, other in enumerate(_every_rank(value)):
        np.testing.assert_array_equal(other, value, err_msg=f"{what}: rank {q} differs")


def _coefficients(shapes, seed):
    """Per variable, every rank's coefficients: [[c_var_rank0, c_var_rank1...], ...]."""
    return [[data(q, shape, np.float32, seed + i) for q in range(hvd.size())]
            for i, shape in enumerate(shapes)]


def _linear_loss(variables, coefficients):
    r = hvd.rank()
    return tf.add_n([tf.reduce_sum(v * tf.constant(c[r]))
                     for v, c in zip(variables, coefficients)])


@contextlib.contextmanager
def _recorded_allreduces():
    """Records (number of tensors, op, prescale, postscale) of every grouped
    allreduce the reducer builds."""
    calls, original = [], collectives.grouped_allreduce

    def recording(tensors, *args, **kwargs):
        calls.append((len(tensors), kwargs.get("op"), kwargs.get("prescale_factor"),
                      kwargs.get("postscale_factor")))
        return original(tensors, *args, **kwargs)

    collectives.grouped_allreduce = recording
    try:
        yield calls
    finally:
        collectives.grouped_allreduce = original


def _reduced_gradients(shapes, seed, groups_of=None, local=(), **options):
    """The gradients DistributedOptimizer(**options).compute_gradients gives
    for sum(w * c) over variables of `shapes`, and the grouped allreduces it
    built; `groups_of(variables)` gives `groups`, `local` the indices of
    variables registered as local."""
    coefficients = _coefficients(shapes, seed)
    with tf.Graph().as_default() as graph, _recorded_allreduces() as calls:
        variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
        if groups_of is not None:
            options["groups"] = groups_of(variables)
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), **options)
        for i in local:
            opt.register_local_var(variables[i])
        grads_and_vars = opt.compute_gradients(_linear_loss(variables, coefficients))
        assert [v for _, v in grads_and_vars] == variables
    with _session(graph) as sess:
        _initialize(sess)
        grads = sess.run([g for g, _ in grads_and_vars])
    return grads, coefficients, calls


# ------------------------------------------------- broadcast_global_variables
def case_broadcast_global_variables_sets_every_rank_to_roots_values(core):
    """Built after fed collectives (a training step's, one of them in a
    tf.cond), it runs without that step's feeds; local variables are left
    alone."""
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [3])
        step = hvd.allreduce(x, op=hvd.Sum)
        u = tf.Variable(tf.zeros([3]))
        two_passes = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR),
                                              backward_passes_per_step=2)
        train_op = two_passes.minimize(tf.reduce_sum(u * x))
        w = tf.Variable(data(r, (3, 2), np.float32, seed=1))
        b = v1.get_variable("b", initializer=data(r, (2,), np.float64, seed=2))
        count = tf.Variable(r + 10, dtype=tf.int64)
        kept = v1.Variable(float(r), collections=[v1.GraphKeys.LOCAL_VARIABLES])
        bcast = hvd.broadcast_global_variables(root)
        later = hvd.allreduce(tf.fill([2], float(r)), op=hvd.Sum)
        assert isinstance(bcast, tf.Operation)
    with _session(graph) as sess:
        _initialize(sess)
        sess.run(bcast)
        w_, b_, count_, kept_ = sess.run([w, b, count, kept])
        np.testing.assert_array_equal(w_, data(root, (3, 2), np.float32, seed=1))
        np.testing.assert_array_equal(b_, data(root, (2,), np.float64, seed=2))
        assert count_ == root + 10 and kept_ == r, (count_, kept_)
        np.testing.assert_array_equal(sess.run(step, {x: [r, 1, 2]}),
                                      [sum(range(n)), n, 2 * n])
        for _ in range(2):
            sess.run(train_op, {x: [r, 1, 2]})
        np.testing.assert_allclose(sess.run(u), -LR * 2 * np.array([(n - 1) / 2, 1, 2]),
                                   rtol=1e-6)
        # Collectives created after it follow the step's again.
        np.testing.assert_array_equal(sess.run(later, {x: [0, 0, 0]}), [sum(range(n))] * 2)


def case_broadcast_global_variables_refuses_eager_execution(core):
    exc = expect_raises(RuntimeError, hvd.broadcast_global_variables, 0)
    assert "does not support eager execution" in str(exc), str(exc)
    assert "hvd.broadcast_variables(" in str(exc), str(exc)


# ------------------------------------------------ BroadcastGlobalVariablesHook
def case_hook_broadcasts_when_a_monitored_training_session_starts(core):
    """The hook of Horovod's TF1 examples: the first step starts from rank
    0's weights, and the step (fed) averages the gradients."""
    n, r = hvd.size(), hvd.rank()
    xs = [data(q, (4, 2), np.float32, seed=3) / 8 for q in range(n)]
    hook = hvd.BroadcastGlobalVariablesHook(0)
    assert isinstance(hook, v1.train.SessionRunHook)
    assert (hook.root_rank, hook.bcast_op, hook.device) == (0, None, "")
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2])
        w = tf.Variable(data(r, (2, 1), np.float32, seed=4))
        loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        global_step = v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))
        train_op = opt.minimize(loss, global_step=global_step)
        with v1.train.MonitoredTrainingSession(hooks=[hook], config=_config()) as sess:
            start = sess.run(w)
            sess.run(train_op, {x: xs[r]})
            trained, steps = sess.run([w, global_step])
        built = hook.bcast_op
        hook.begin()
        assert hook.bcast_op is built, "begin() in the same graph built a second op"
    w0 = data(0, (2, 1), np.float32, seed=4)
    np.testing.assert_array_equal(start, w0)
    grads = [2 * xq.T @ (xq @ w0) / len(xq) for xq in xs]
    np.testing.assert_allclose(trained, w0 - LR * np.mean(grads, axis=0), rtol=1e-6)
    assert steps == 1, steps
    with tf.Graph().as_default() as graph:
        hook.begin()
        assert hook.bcast_op is not built and hook.bcast_op.graph is graph


def case_hook_in_a_plain_session_on_a_device(core):
    n, r = hvd.size(), hvd.rank()
    hook = hvd.BroadcastGlobalVariablesHook(n - 1, device="/cpu:0")
    with tf.Graph().as_default() as graph:
        w = tf.Variable(data(r, (5,), np.float32, seed=5))
        hook.begin()
        assert hook.bcast_op.device.upper().endswith("CPU:0"), hook.bcast_op.device
    with _session(graph) as sess:
        _initialize(sess)
        hook.after_create_session(sess, None)
        np.testing.assert_array_equal(sess.run(w), data(n - 1, (5,), np.float32, seed=5))


# ---------------------------------------------------- DistributedOptimizer
def _full_batch_descent(w, b, x, y, steps, lr):
    """Gradient descent on mean((x @ w + b - y)^2) over the whole batch
    (the mean of every element, as tf.reduce_mean takes it)."""
    for _ in range(steps):
        err = x @ w + b - y
        w = w - lr * 2 * x.T @ err / err.size
        b = b - lr * 2 * err.sum(axis=0) / err.size
    return w, b


def case_gradient_descent_matches_one_process_on_the_full_batch(core):
    """Each rank feeds its slice of the batch; the weights after five steps
    are those of one process training on the whole batch."""
    n, r = hvd.size(), hvd.rank()
    steps, rows = 5, 4
    x_all = np.concatenate([data(q, (rows, 3), np.float32, seed=6) / 8 for q in range(n)])
    y_all = np.concatenate([data(q, (rows, 2), np.float32, seed=7) / 8 for q in range(n)])
    w0 = data(0, (3, 2), np.float32, seed=8) / 8
    mine = slice(r * rows, (r + 1) * rows)
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [None, 3])
        y = v1.placeholder(tf.float32, [None, 2])
        w = tf.Variable(w0)
        b = tf.Variable(tf.zeros([2]))
        loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        global_step = v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))
        train_op = opt.minimize(loss, global_step=global_step)
    assert isinstance(opt, v1.train.Optimizer)
    assert opt.get_name() == "DistributedGradientDescentOptimizer", opt.get_name()
    with _session(graph) as sess:
        _initialize(sess)
        for _ in range(steps):
            sess.run(train_op, {x: x_all[mine], y: y_all[mine]})
        w_, b_, step_ = sess.run([w, b, global_step])
    want_w, want_b = _full_batch_descent(w0, np.zeros(2, np.float32), x_all, y_all, steps, LR)
    np.testing.assert_allclose(w_, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b_, want_b, rtol=1e-5, atol=1e-6)
    assert step_ == steps, step_


def case_optimizer_reduces_eagerly_too(core):
    """minimize(callable) outside any graph: the gradients are averaged at once."""
    shapes = [(2, 3), (4,)]
    coefficients = _coefficients(shapes, seed=9)
    variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), name="Eager")
    for _ in range(2):
        opt.minimize(lambda: _linear_loss(variables, coefficients), var_list=variables)
    for v, c in zip(variables, coefficients):
        np.testing.assert_allclose(v.numpy(), -2 * LR * np.mean(c, axis=0), rtol=1e-6)


def case_sum_op_sums_and_the_predivide_factor_splits_the_average(core):
    n = hvd.size()
    shapes = [(3,), (2, 2)]
    grads, coefficients, calls = _reduced_gradients(shapes, seed=11, op=hvd.Sum)
    for g, c in zip(grads, coefficients):
        np.testing.assert_array_equal(g, np.sum(c, axis=0))
    assert calls == [(2, hvd.Sum, 1.0, 1.0)], calls
    grads, coefficients, calls = _reduced_gradients(shapes, seed=11,
                                                    gradient_predivide_factor=4.0)
    for g, c in zip(grads, coefficients):
        np.testing.assert_allclose(g, np.sum(c, axis=0) / n, rtol=1e-6)
    assert calls == [(2, hvd.Average, 0.25, 4.0)], calls


def case_groups_choose_the_grouped_allreduces(core):
    shapes = [(3,), (2,), (2, 2)]

    def sizes(groups_of=None, **options):
        grads, coefficients, calls = _reduced_gradients(shapes, 12, groups_of, **options)
        for g, c in zip(grads, coefficients):
            np.testing.assert_allclose(g, np.mean(c, axis=0), rtol=1e-6)
        return [size for size, *_ in calls]

    assert sizes() == [3]
    assert sizes(lambda vs: [[vs[0], vs[2]]]) == [2, 1]
    assert sizes(lambda vs: 2) == [2, 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sizes(num_groups=3) == [1, 1, 1]
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught


def case_local_variables_keep_their_gradient_scaled_or_not(core):
    n = hvd.size()
    shapes = [(3,), (2,)]
    for scale in (True, False):
        grads, coefficients, calls = _reduced_gradients(shapes, seed=13, local=[1],
                                                        scale_local_gradients=scale)
        np.testing.assert_allclose(grads[0], np.mean(coefficients[0], axis=0), rtol=1e-6)
        own = coefficients[1][hvd.rank()]
        np.testing.assert_allclose(grads[1], own / n if scale else own, rtol=1e-6)
        assert calls == [(1, hvd.Average, 1.0, 1.0)], calls


def _embedding_step(sparse_as_dense, **options):
    """One step on sum(gather(E, ids) * c), ids differing between ranks;
    returns (the gradient's type, E after the step, every rank's dense
    gradient)."""
    n, r = hvd.size(), hvd.rank()
    ids = [[q, q + 1, 0] for q in range(n)]
    cs = [data(q, (3, 2), np.float32, seed=14) for q in range(n)]
    with tf.Graph().as_default() as graph:
        table = tf.Variable(tf.zeros([n + 1, 2]))
        loss = tf.reduce_sum(tf.gather(table, ids[r]) * cs[r])
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR),
                                       sparse_as_dense=sparse_as_dense, **options)
        grads_and_vars = opt.compute_gradients(loss)
        train_op = opt.apply_gradients(grads_and_vars)
    dense = [np.zeros((n + 1, 2), np.float32) for _ in range(n)]
    for q in range(n):
        np.add.at(dense[q], ids[q], cs[q])
    with _session(graph) as sess:
        _initialize(sess)
        sess.run(train_op)
        return type(grads_and_vars[0][0]), sess.run(table), dense


def case_sparse_gradients_are_gathered_or_reduced_dense(core):
    for sparse_as_dense in (False, True):
        kind, table, dense = _embedding_step(sparse_as_dense)
        assert (kind is tf.IndexedSlices) == (not sparse_as_dense), kind
        np.testing.assert_allclose(table, -LR * np.mean(dense, axis=0), rtol=1e-6,
                                   err_msg=f"sparse_as_dense={sparse_as_dense}")


def _two_pass_run(average, steps=4):
    """backward_passes_per_step=2 on sum(w * x) with x fed per step (the
    gradient is x); returns per step (gradient returned, w, global_step)
    and every rank's x per step."""
    n, r = hvd.size(), hvd.rank()
    xs = [[data(q, (2,), np.float32, seed=20 + s) for q in range(n)] for s in range(steps)]
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [2])
        w = tf.Variable(tf.zeros([2]))
        global_step = v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(1.0),
                                       backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        grads_and_vars = opt.compute_gradients(tf.reduce_sum(w * x))
        train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
    seen = []
    with _session(graph) as sess:
        _initialize(sess)
        for s in range(steps):
            _, grad = sess.run([train_op, grads_and_vars[0][0]], {x: xs[s][r]})
            seen.append((grad, *sess.run([w, global_step])))
    return seen, xs


def case_two_backward_passes_per_step_reduce_and_apply_every_second_pass(core):
    """Horovod's test_local_gradient_aggregation, in a graph: the first pass
    of each pair returns the local gradient and applies nothing; the second
    returns the pair's reduced sum (halved with average_aggregated_gradients)
    and applies it; global_step counts passes."""
    r = hvd.rank()
    for average in (False, True):
        seen, xs = _two_pass_run(average)
        w = np.zeros(2, np.float32)
        for s, (grad, w_now, step) in enumerate(seen):
            what = f"average={average}, pass {s + 1}"
            if s % 2 == 0:
                np.testing.assert_array_equal(grad, xs[s][r], err_msg=what)
            else:
                pair = np.mean(np.add(xs[s - 1], xs[s]), axis=0) / (2 if average else 1)
                np.testing.assert_allclose(grad, pair, rtol=1e-6, err_msg=what)
                w = w - pair
            np.testing.assert_allclose(w_now, w, rtol=1e-6, err_msg=what)
            assert step == s + 1, (what, step)


class _ConstantGradients(v1.train.Optimizer):
    """The optimizer of Horovod's test_local_gradient_aggregation: every
    gradient is rank + 1 (IndexedSlices when `sparse`), and applying one
    adds it to its variable."""

    def __init__(self, sparse):
        super().__init__(use_locking=False, name="ConstantGradients")
        self.sparse = sparse

    def compute_gradients(self, var_list, **kwargs):
        value = float(hvd.rank() + 1)
        if self.sparse:
            grads = [tf.IndexedSlices(tf.fill([2], value), tf.constant([0, 1]),
                                      tf.constant([2])) for _ in var_list]
        else:
            grads = [tf.fill([2], value) for _ in var_list]
        return list(zip(grads, var_list))

    def _resource_apply_dense(self, grad, handle):
        return handle.assign_add(grad, read_value=False)


def case_four_backward_passes_as_horovods_local_gradient_aggregation_test(core):
    """Horovod's test_local_gradient_aggregation(_sparse), which its copy
    for this project leaves out (TF1 only): running only the apply op, ten
    times, the variables grow by the average of the ranks' gradients once
    every four passes."""
    n = hvd.size()
    for sparse in (False, True):
        with tf.Graph().as_default() as graph:
            variables = [tf.Variable(tf.zeros([2])) for _ in range(3)]
            opt = hvd.DistributedOptimizer(_ConstantGradients(sparse), sparse_as_dense=sparse,
                                           backward_passes_per_step=4,
                                           average_aggregated_gradients=True)
            apply_op = opt.apply_gradients(opt.compute_gradients(variables))
        with _session(graph) as sess:
            _initialize(sess)
            for i in range(10):
                sess.run(apply_op)
                want = (i + 1) // 4 * sum(q + 1 for q in range(n)) / n
                for v in sess.run(variables):
                    np.testing.assert_allclose(v, [want, want], rtol=1e-6,
                                               err_msg=f"sparse={sparse}, pass {i + 1}")


def case_two_backward_passes_per_step_with_sparse_gradients(core):
    """Horovod's test_local_gradient_aggregation_sparse: IndexedSlices are
    accumulated dense with sparse_as_dense, refused without."""
    exc = expect_raises(ValueError, _embedding_step, False, backward_passes_per_step=2)
    assert "sparse_as_dense" in str(exc), str(exc)
    kind, table, _ = _embedding_step(True, backward_passes_per_step=2)
    np.testing.assert_array_equal(table, np.zeros_like(table))  # one pass: nothing applied


def case_slots_and_variables_are_the_wrapped_optimizers(core):
    shapes = [(3,)]
    (c,) = _coefficients(shapes, seed=15)
    with tf.Graph().as_default() as graph:
        w = tf.Variable(tf.zeros([3]))
        inner = v1.train.MomentumOptimizer(LR, momentum=0.9)
        opt = hvd.DistributedOptimizer(inner)
        train_op = opt.minimize(_linear_loss([w], [c]))
        slot = opt.get_slot(w, "momentum")
        assert slot is not None and slot is inner.get_slot(w, "momentum")
        assert opt.get_slot_names() == ["momentum"] == inner.get_slot_names()
        assert opt.variables() == inner.variables() == [slot]
    with _session(graph) as sess:
        _initialize(sess)
        for _ in range(2):
            sess.run(train_op)
        w_, slot_ = sess.run([w, slot])
    g = np.mean(c, axis=0)
    np.testing.assert_allclose(slot_, 1.9 * g, rtol=1e-6)
    np.testing.assert_allclose(w_, -LR * 2.9 * g, rtol=1e-6)


# ------------------------------------------------------------------ Adasum
def _adasum_pair(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot = np.dot(a.ravel(), b.ravel())
    return (1 - dot / (2 * np.dot(a.ravel(), a.ravel()))) * a + \
        (1 - dot / (2 * np.dot(b.ravel(), b.ravel()))) * b


def case_adasum_combines_the_ranks_steps_every_backward_passes_per_step(core):
    """Each rank steps on its own gradient; on every second step the ranks
    combine how far each variable moved with Adasum (checked against the
    formula on 2 ranks) and all continue from there."""
    n, r = hvd.size(), hvd.rank()
    shapes = [(3,), (2, 2)]
    coefficients = _coefficients(shapes, seed=16)
    starts = [data(0, shape, np.float32, seed=17) for shape in shapes]
    with tf.Graph().as_default() as graph:
        variables = [tf.Variable(s) for s in starts]
        inner = v1.train.GradientDescentOptimizer(LR)
        opt = hvd.DistributedOptimizer(inner, op=hvd.Adasum, backward_passes_per_step=2)
        train_op = opt.minimize(_linear_loss(variables, coefficients))
    assert isinstance(opt, v1.train.Optimizer)
    assert opt.get_name() == "DistributedDeltaGradientDescentOptimizer", opt.get_name()
    assert opt.get_slot_names() == ["delta_start"], opt.get_slot_names()
    assert opt.get_slot(variables[0], "delta_start") is not None
    with _session(graph) as sess:
        _initialize(sess)
        sess.run(train_op)
        local = sess.run(variables)
        sess.run(train_op)
        combined = sess.run(variables)
    for v, s, c in zip(local, starts, coefficients):
        np.testing.assert_allclose(v, s - LR * c[r], rtol=1e-6)
    for v, s, c in zip(combined, starts, coefficients):
        _assert_same_on_every_rank(v, "after the exchange")
        if n == 2:
            moved = _adasum_pair(-2 * LR * c[0], -2 * LR * c[1])
            np.testing.assert_allclose(v, s + moved, rtol=1e-5)


def case_adasum_exchanges_every_step_eagerly(core):
    n = hvd.size()
    shapes = [(3,)]
    coefficients = _coefficients(shapes, seed=18)
    start = data(0, (3,), np.float32, seed=19)
    w = tf.Variable(start)
    opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum)
    opt.minimize(lambda: _linear_loss([w], coefficients), var_list=[w])
    _assert_same_on_every_rank(w.numpy(), "after one eager step")
    if n == 2:
        (c,) = coefficients
        np.testing.assert_allclose(w.numpy(), start + _adasum_pair(-LR * c[0], -LR * c[1]),
                                   rtol=1e-5)


# --------------------------------------------------------- argument errors
def case_optimizer_argument_errors(core):
    def sgd():
        return v1.train.GradientDescentOptimizer(LR)

    exc = expect_raises(ValueError, hvd.DistributedOptimizer, sgd(), op=hvd.Sum,
                        gradient_predivide_factor=2.0)
    assert "gradient_predivide_factor" in str(exc), str(exc)
    # Horovod checks the arguments before it looks at the optimizer.
    expect_raises(ValueError, hvd.DistributedOptimizer, object(), op=hvd.Sum,
                  gradient_predivide_factor=2.0)
    exc = expect_raises(ValueError, hvd.DistributedOptimizer, sgd(), op=hvd.Adasum,
                        average_aggregated_gradients=True)
    assert "average_aggregated_gradients" in str(exc), str(exc)
    for groups in (0, -1):
        expect_raises(ValueError, hvd.DistributedOptimizer, sgd(), groups=groups)
    exc = expect_raises(ValueError, hvd.DistributedOptimizer, sgd(),
                        backward_passes_per_step=2)
    assert "eager execution" in str(exc), str(exc)
    exc = expect_raises(NotImplementedError, hvd.DistributedOptimizer, sgd(), op=hvd.Adasum,
                        process_set=hvd.ProcessSet([0]))
    assert "process sets" in str(exc), str(exc)
    expect_raises(ValueError, hvd.DistributedOptimizer, object())  # Horovod's type
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2)
        exc = expect_raises(ValueError, opt.apply_gradients, [(tf.constant(1.0), w)])
        assert "compute_gradients" in str(exc), str(exc)
