"""Multi-rank cases for frontends.tensorflow in graphs run all at once (run by
tests/test_tensorflow.py).

A graph that holds many collectives with no dependencies between them lets
TensorFlow's executor start them in any order, and the order differs between
ranks. Each collective holds an executor thread until every rank has
submitted it, so without an order fixed in the graph the job deadlocks once
the ranks' threads are all waiting on collectives the others have not
started. These cases build such graphs (tf.compat.v1 graphs run by a
Session, and tf.function) and check the results against NumPy; a deadlock
shows as a case timeout.
"""

import numpy as np

from tf_common import assert_equal, configure_tensorflow, data

configure_tensorflow()

import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402

RUNS = 5  # session.run calls per graph: each is a fresh chance for the ranks to disagree


def everyone(shape, dtype, seed):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def _session(graph):
    # Two inter-op threads, as two blocked collectives are enough to stall.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2,
                                      intra_op_parallelism_threads=1)
    return tf.compat.v1.Session(graph=graph, config=config)


def _mixed_collectives():
    """Builds 26 independent collectives of mixed ops and dtypes in the
    current graph or function; returns {label: (output, expected)}."""
    n, r = hvd.size(), hvd.rank()
    built = {}
    for i, dtype in enumerate([np.float32, np.float64, np.int32] * 3):
        inputs = everyone((3, i + 1), dtype, seed=100 + i)
        x = tf.constant(inputs[r])
        total = np.sum(inputs, axis=0, dtype=dtype)
        built[f"sum {i}"] = (hvd.allreduce(x, op=hvd.Sum), total)
        average = total / n if np.dtype(dtype).kind == "f" else np.trunc(
            total.astype(np.float64) / n).astype(dtype)
        built[f"average {i}"] = (hvd.allreduce(x, op=hvd.Average), average)
    for i, dtype in enumerate([np.float32, np.int64, np.float64]):
        parts = [data(q, (q + 1, 2), dtype, seed=200 + i) for q in range(n)]
        built[f"allgather {i}"] = (hvd.allgather(tf.constant(parts[r])), np.concatenate(parts))
    for i, dtype in enumerate([np.float64, np.int32, np.float32]):
        root = i % n
        inputs = everyone((2, 2), dtype, seed=300 + i)
        built[f"broadcast {i}"] = (hvd.broadcast(tf.constant(inputs[r]), root), inputs[root])
    grouped_inputs = [everyone((4,), np.float32, seed=400), everyone((2, 3), np.int64, seed=401)]
    grouped = hvd.grouped_allreduce([tf.constant(g[r]) for g in grouped_inputs], op=hvd.Sum)
    for j, (out, per_rank) in enumerate(zip(grouped, grouped_inputs)):
        built[f"grouped allreduce {j}"] = (out, np.sum(per_rank, axis=0,
                                                       dtype=per_rank[0].dtype))
    gathered_inputs = [[data(q, (q + 1,), np.int32, seed=500) for q in range(n)],
                       [data(q, (1, 2), np.float64, seed=501) for q in range(n)]]
    gathered = hvd.grouped_allgather([tf.constant(g[r]) for g in gathered_inputs])
    for j, (out, parts) in enumerate(zip(gathered, gathered_inputs)):
        built[f"grouped allgather {j}"] = (out, np.concatenate(parts))
    return built


def _check(results, built, mode):
    for label, (_, expected) in built.items():
        _assert_matches(results[label], expected, f"{mode}: {label}")


def _assert_matches(actual, expected, what):
    """Equal, up to rounding for floats (Average divides)."""
    if np.asarray(expected).dtype.kind == "f":
        assert np.asarray(actual).dtype == expected.dtype, what
        np.testing.assert_allclose(actual, expected, rtol=1e-6, err_msg=what)
    else:
        assert_equal(actual, expected, what)


# ------------------------------------------------------------ tf.function
def case_many_independent_collectives_in_one_tf_function(core):
    """TensorFlow's automatic control dependencies already run these in
    program order (ordering.py adds nothing in a tf.function); this pins it."""
    expected = {}

    @tf.function
    def step():
        built = _mixed_collectives()
        expected.update({k: e for k, (_, e) in built.items()})
        return {k: out for k, (out, _) in built.items()}

    assert len(expected) == 0
    for _ in range(RUNS):
        outs = step()
        assert len(outs) >= 20, len(outs)
        for label, want in expected.items():
            _assert_matches(outs[label].numpy(), want, f"tf.function: {label}")


# ------------------------------------------------ tf.compat.v1 Session
def case_many_independent_collectives_in_one_session_run(core):
    with tf.Graph().as_default() as graph:
        built = _mixed_collectives()
    assert len(built) >= 20, len(built)
    fetches = {k: out for k, (out, _) in built.items()}
    with _session(graph) as sess:
        for _ in range(RUNS):
            _check(sess.run(fetches), built, "session.run")


def case_objects_are_exchanged_with_a_tf1_graph_as_the_default(core):
    """Horovod ran these through a session in TF1 graphs; here they need none."""
    r = hvd.rank()
    with tf.Graph().as_default():
        assert not tf.executing_eagerly()
        assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
        assert hvd.allgather_object(r * 10) == [q * 10 for q in range(hvd.size())]
        bcast = hvd.broadcast_object_fn(root_rank=hvd.size() - 1)
        assert bcast(("cfg", r)) == ("cfg", hvd.size() - 1)


def case_session_fetching_some_collectives(core):
    """Fetching a subset of a graph's collectives works, the same subset on
    every rank, run after run."""
    with tf.Graph().as_default() as graph:
        built = _mixed_collectives()
    labels = sorted(built)
    with _session(graph) as sess:
        for subset in (labels[::3], labels[-4:], labels[:2], labels):
            results = sess.run({k: built[k][0] for k in subset})
            _check(results, {k: built[k] for k in subset}, f"subset {subset}")


def case_session_collectives_feed_later_collectives(core):
    """Collectives that consume other collectives' results, next to
    independent ones, with gradients (the backward collectives are built
    after the forward ones)."""
    n, r = hvd.size(), hvd.rank()
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [3])
        layers = [x]
        for i in range(8):
            layers.append(hvd.allreduce(layers[-1] * (r + 1.0), op=hvd.Average)
                          + hvd.broadcast(tf.fill([3], float(i)), i % n))
        side = [hvd.allreduce(tf.fill([2], float(r + i)), op=hvd.Sum) for i in range(12)]
        loss = tf.reduce_sum(layers[-1])
        (grad,) = tf.gradients(loss, [x])
    mean_scale = np.mean([q + 1.0 for q in range(n)])
    value = np.arange(3, dtype=np.float32)
    for i in range(8):
        value = value * mean_scale + i
    with _session(graph) as sess:
        for _ in range(RUNS):
            out, got_side, got_grad = sess.run([layers[-1], side, grad],
                                               {x: np.arange(3, dtype=np.float32)})
            np.testing.assert_allclose(out, value, rtol=1e-5)
            for i, s in enumerate(got_side):
                assert_equal(s, np.full(2, sum(q + i for q in range(n)), np.float32))
            # Each allreduce's gradient is the same averaging allreduce of the
            # incoming gradient, then the local factor (r + 1).
            np.testing.assert_allclose(got_grad, np.full(3, (r + 1.0) * mean_scale ** 7),
                                       rtol=1e-5)


def _control_flow_graph():
    """Collectives inside tf.cond and tf.while_loop between independent ones;
    returns (fetches, expected)."""
    n, r = hvd.size(), hvd.rank()
    fetches, expected = [], []
    for i in range(6):
        fetches.append(hvd.allreduce(tf.fill([2], float(r + i)), op=hvd.Sum))
        expected.append(np.full(2, sum(q + i for q in range(n)), np.float32))
    pred = tf.constant(True)
    fetches.append(tf.cond(pred, lambda: hvd.allreduce(tf.ones([2]) * (r + 1.0), op=hvd.Sum),
                           lambda: tf.zeros([2])))
    expected.append(np.full(2, sum(q + 1.0 for q in range(n)), np.float32))

    def body(i, acc):
        # Reads acc, so iterations do not overlap (each reuses the op's name).
        x = tf.fill([2], tf.cast(i, tf.float32)) + 0.0 * acc
        return i + 1, acc + hvd.allreduce(x, op=hvd.Sum)

    fetches.append(tf.while_loop(lambda i, acc: i < 4, body, (tf.constant(0), tf.zeros([2])))[1])
    expected.append(np.full(2, n * (0 + 1 + 2 + 3), np.float32))
    for i in range(6):
        fetches.append(hvd.allgather(tf.fill([1], r * 10 + i)))
        expected.append(np.array([q * 10 + i for q in range(n)], np.int32))
    return fetches, expected


def case_session_collectives_in_cond_and_while_loop(core):
    with tf.Graph().as_default() as graph:
        fetches, expected = _control_flow_graph()
    with _session(graph) as sess:
        for _ in range(RUNS):
            for i, (got, want) in enumerate(zip(sess.run(fetches), expected)):
                assert_equal(got, want, f"fetch {i}")


def case_session_collectives_in_v1_control_flow(core):
    """The same with TensorFlow 1 control flow (while-loop frames, cond
    contexts), where control inputs may not cross frames."""
    from tensorflow.python.ops import control_flow_v2_toggles as toggles

    was_v2 = toggles.control_flow_v2_enabled()
    toggles.disable_control_flow_v2()
    try:
        with tf.Graph().as_default() as graph:
            fetches, expected = _control_flow_graph()
    finally:
        if was_v2:
            toggles.enable_control_flow_v2()
    with _session(graph) as sess:
        for _ in range(RUNS):
            for i, (got, want) in enumerate(zip(sess.run(fetches), expected)):
                assert_equal(got, want, f"fetch {i}")


def case_session_gradients_through_while_loop_and_function_calls(core):
    """tf.gradients through a while loop and tf.function calls that hold
    collectives, next to plain ones (a While op must not get control inputs:
    its gradient adds inputs to it)."""
    n, r = hvd.size(), hvd.rank()

    @tf.function
    def f(y):
        return hvd.allreduce(y, op=hvd.Sum) + hvd.broadcast(y, 0)

    def body(i, acc):
        return i + 1, acc + hvd.allreduce(acc * 2.0, op=hvd.Sum)

    with tf.Graph().as_default() as graph:
        x = tf.constant([1.0, 2.0])
        a = hvd.allreduce(x, op=hvd.Sum)
        w = tf.while_loop(lambda i, acc: i < 3, body, (tf.constant(0), x))[1]
        c = f(x) + f(2.0 * x)
        b = hvd.broadcast(x, 0)
        loss = sum(tf.reduce_sum(t) for t in (a, w, c, b))
        (grad,) = tf.gradients(loss, [x])
    x_np = np.array([1.0, 2.0], np.float32)
    root = 1.0 if r == 0 else 0.0
    expected = [n * x_np, (1 + 2 * n) ** 3 * x_np, 3 * (n + 1) * x_np, x_np,
                # Horovod's gradients: Sum allreduce -> n; broadcast -> 1 on
                # the root, 0 elsewhere; the loop -> (1 + 2n) per iteration.
                np.full(2, (1 + 2 * n) ** 3 + n + 3 * (n + root) + root, np.float32)]
    with _session(graph) as sess:
        for _ in range(RUNS):
            for label, got, want in zip("awcbg", sess.run([a, w, c, b, grad]), expected):
                np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=label)


def case_session_mismatch_raises_failed_precondition_naming_the_ranks(core):
    """As eagerly and in tf.function: Horovod's kernels set a failed
    precondition's status, whatever runs the graph."""
    me = hvd.rank()
    graph = tf.Graph()
    with graph.as_default():
        out = hvd.allreduce(tf.ones([3 + me]), name="session.mismatch")
    with _session(graph) as sess:
        try:
            sess.run(out)
        except tf.errors.FailedPreconditionError as exc:
            assert "session.mismatch" in exc.message and "rank 1" in exc.message, exc.message
            assert "[coordinator:" not in exc.message, exc.message
        else:
            raise AssertionError("a mismatch in a Session ran")
    assert_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), np.full(2, float(hvd.size()), np.float32))
