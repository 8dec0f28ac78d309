"""Horovod's TensorFlow elastic states over the coordinator on 2 ranks (run
by tests/test_tensorflow.py): `TensorFlowState` (variables),
`TensorFlowKerasState` / `KerasState` (a model and its optimizer), and
`elastic.run`'s reading of TensorFlow errors. Membership changes are the
elastic jobs' (tests/test_elastic_mpi.py); here, what a state keeps."""

import numpy as np

from tf_common import assert_equal, configure_tensorflow, expect_raises

configure_tensorflow()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402
import frontends.tensorflow.keras as hvd_keras  # noqa: E402
from coordinator.errors import DeadlockError, HorovodInternalError  # noqa: E402


def setup(core):
    hvd.init()


def _rank_values(shape, offset=0.0):
    return np.full(shape, hvd.rank() + 1.0 + offset, np.float32)


def case_tensorflow_state_syncs_from_rank_0_and_restores_its_commit(core):
    a = tf.Variable(_rank_values((2, 3)))
    b = tf.Variable(_rank_values((4,), 10.0))
    state = hvd.elastic.TensorFlowState([a, b], epoch=hvd.rank())
    state.sync()  # what elastic.run does first: everyone takes rank 0's
    assert_equal(a.numpy(), np.full((2, 3), 1.0, np.float32), "a after sync")
    assert_equal(b.numpy(), np.full((4,), 11.0, np.float32), "b after sync")
    assert state.epoch == 0
    a.assign_add(tf.ones((2, 3)))
    state.epoch = 1
    state.save()  # (commit = save + a check for host changes, outside a job none)
    a.assign(tf.zeros((2, 3)))
    b.assign(tf.zeros((4,)))
    state.epoch = 7
    state.restore()
    assert_equal(a.numpy(), np.full((2, 3), 2.0, np.float32), "a after restore")
    assert_equal(b.numpy(), np.full((4,), 11.0, np.float32), "b after restore")
    assert state.epoch == 1


def case_tensorflow_state_without_variables_holds_its_attributes_as_horovods(core):
    # Horovod's defaults to tf.compat.v1.global_variables(): none when
    # executing eagerly, so the state holds only its keyword attributes.
    # It raised ValueError here.
    state = hvd.elastic.TensorFlowState(epoch=hvd.rank(), batch=5)
    assert state.variables == []
    state.sync()
    assert (state.epoch, state.batch) == (0, 5)
    state.epoch = 3
    state.save()
    state.epoch = 9
    state.restore()
    assert state.epoch == 3


def case_tensorflow_state_of_a_tf1_graph_reads_and_writes_through_its_session(core):
    # A TF1 program's state: the graph's global variables, through the
    # session (Horovod's evaluates them in it and loads them back).
    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.get_variable("v", initializer=_rank_values((3,)))
        w = tf.compat.v1.get_variable("w", initializer=_rank_values((2,), 10.0))
        session = tf.compat.v1.Session(graph=graph)
        session.run(tf.compat.v1.global_variables_initializer())
        with session.as_default():
            state = hvd.elastic.TensorFlowState(epoch=hvd.rank())
        assert state.variables == [v, w] and state.session is session
        ops_before = len(graph.get_operations())
        state.sync()
        assert_equal(session.run(v), np.full(3, 1.0, np.float32), "v after sync")
        assert_equal(session.run(w), np.full(2, 11.0, np.float32), "w after sync")
        assert state.epoch == 0
        v.load(np.full(3, 5.0, np.float32), session)
        state.save()
        v.load(np.zeros(3, np.float32), session)
        w.load(np.zeros(2, np.float32), session)
        state.restore()
        assert_equal(session.run(v), np.full(3, 5.0, np.float32), "v after restore")
        assert_equal(session.run(w), np.full(2, 11.0, np.float32), "w after restore")
        state.sync()
        assert len(graph.get_operations()) == ops_before, "sync grew the graph"
        # Outside a default session, a graph's variables need one named.
        expect_raises(ValueError, hvd.elastic.TensorFlowState)
        session.close()


def _model():
    keras.utils.set_random_seed(hvd.rank())  # different weights on each rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _weights(variables):
    return [np.array(v) for v in variables]


def case_keras_state_builds_the_optimizer_and_syncs_model_and_optimizer(core):
    model = _model()
    assert not model.optimizer.built
    state = hvd_keras.elastic.KerasState(model, batch=0)
    assert model.optimizer.built  # a new worker holds the same variables as the others
    state.sync()
    x = np.ones((4, 3), np.float32)
    model.train_on_batch(x, np.zeros((4, 2), np.float32))  # momentum becomes non-zero
    mine = _weights(model.variables) + _weights(model.optimizer.variables)
    gathered = hvd.allgather_object(mine)
    for other in gathered[1:]:  # the same start and the same batch: the same everywhere
        for got, want in zip(other, gathered[0]):
            assert_equal(got, want, "after sync and one batch")
    state.batch = 1
    state.save()
    model.train_on_batch(x, np.ones((4, 2), np.float32))
    state.batch = 2
    state.restore()
    for got, want in zip(_weights(model.variables) + _weights(model.optimizer.variables),
                         mine):
        assert_equal(got, want, "after restore")
    assert state.batch == 1
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    expect_raises(ValueError, hvd.elastic.TensorFlowKerasState, unbuilt)


def case_run_reads_a_failed_collective_from_a_tensorflow_error(core):
    """Inside elastic.run a tf.errors.OpError that stands for a failed
    collective is a HorovodInternalError (outside an elastic job it then
    propagates); any other TensorFlow error stays what it was."""
    state = hvd.elastic.TensorFlowState([tf.Variable(_rank_values((1,)))])

    def failing(error):
        @hvd.elastic.run
        def train(state):
            raise error
        return train

    lost = tf.errors.UnknownError(None, None, "HorovodAllreduce_grad_0: rank 1 exited")
    exc = expect_raises(HorovodInternalError, failing(lost), state)
    assert exc.__cause__ is lost
    bad = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]")
    assert expect_raises(tf.errors.InvalidArgumentError, failing(bad), state) is bad


class _ElasticJob:
    """An elastic job's membership whose resets are only counted, so that a
    case sees whether elastic.run would reset without re-forming anything."""

    hosts_version = 0
    added_last = 0

    def __init__(self):
        self.resets = 0

    def communicator(self):
        return None


def _run_in_a_fake_elastic_job(func, state):
    """elastic.run(func)(state): (what it returned or the error it raised,
    the resets it made)."""
    from coordinator.elastic import membership
    import frontends.tensorflow.elastic as tf_elastic

    job = _ElasticJob()
    saved = membership.current, tf_elastic.make_reset
    membership.current = lambda: job
    tf_elastic.make_reset = lambda shutdown, init: lambda: setattr(job, "resets",
                                                                   job.resets + 1)
    try:
        try:
            return hvd.elastic.run(func)(state), job.resets
        except tf.errors.OpError as exc:
            return exc, job.resets
    finally:
        membership.current, tf_elastic.make_reset = saved


def case_run_raises_the_programs_own_mistakes_without_resetting(core):
    """A mismatch (eager and inside a tf.function) or a deadlock reaches
    elastic.run as a TensorFlow error: a reset would meet it again, so it
    leaves run() as it came, where a lost worker's error resets the job."""
    state = hvd.elastic.TensorFlowState([tf.Variable(_rank_values((1,)))])
    mine = np.ones(3 + hvd.rank(), np.float32)

    @tf.function
    def graph_allreduce(x):
        return hvd.allreduce(x, name="mismatched_in_graph")

    def deadlocked(x):
        raise DeadlockError("Deadlocked allreduce of tensor 'acc0': rank 1 did not submit it")

    @tf.function
    def graph_deadlock(x):
        return tf.numpy_function(deadlocked, [x], tf.float32)

    mistakes = [lambda: hvd.allreduce(tf.constant(mine), name="mismatched_eagerly"),
                lambda: graph_allreduce(tf.constant(mine)),
                lambda: graph_deadlock(tf.constant(mine))]
    for mistake in mistakes:
        calls = []

        def train(state):
            calls.append(1)
            return "replayed" if len(calls) > 1 else mistake()

        exc, resets = _run_in_a_fake_elastic_job(train, state)
        assert isinstance(exc, tf.errors.OpError) and resets == 0, (exc, resets)
        assert "Mismatched shape" in exc.message or "Deadlocked" in exc.message, exc.message
        assert any("did not reset the job" in note for note in exc.__notes__), exc

    calls = []

    def lost_then_done(state):
        calls.append(1)
        if len(calls) == 1:
            raise tf.errors.UnknownError(None, None, "HorovodAllreduce_grad_0: rank 1 exited")
        return "done"

    assert _run_in_a_fake_elastic_job(lost_then_done, state) == ("done", 1)
