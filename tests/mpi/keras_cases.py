"""Multi-rank cases for frontends.tensorflow.keras (run by tests/test_keras.py).

Training results are checked against the same training done by one process
on the global batch: with equal per-rank batches and a mean loss, averaging
the ranks' gradients gives exactly the full batch's gradient.
"""

import os
import tempfile
import warnings

import numpy as np

from tf_common import configure_tensorflow, digits, expect_raises

configure_tensorflow()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd_tf  # noqa: E402
import frontends.tensorflow.keras as hvd  # noqa: E402
from frontends.tensorflow.keras.optimizer import _DistributedOptimizer  # noqa: E402

PER_RANK_BATCH = 8


def setup(core):
    hvd.init()


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(12, activation="relu"),
                             keras.layers.Dense(10)])


def _compile(model, optimizer, **kwargs):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False, **kwargs)
    return model


def _shards(samples_per_rank):
    """(this rank's x, y) and every rank's shards, from the digits."""
    n = hvd.size()
    x, y = digits(samples_per_rank * n)
    xs = [x[q * samples_per_rank:(q + 1) * samples_per_rank] for q in range(n)]
    ys = [y[q * samples_per_rank:(q + 1) * samples_per_rank] for q in range(n)]
    return xs, ys


def _global_batches(parts, per_rank_batch, passes=1):
    """The single-process data whose batch k is, for every pass of step k,
    every rank's k-th batch: what the ranks see together."""
    steps = len(parts[0]) // per_rank_batch
    out = []
    for step in range(0, steps, passes):
        for p in range(step, step + passes):
            for part in parts:
                out.append(part[p * per_rank_batch:(p + 1) * per_rank_batch])
    return np.concatenate(out)


def _assert_same_on_every_rank(core, model, what):
    flat = np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64)
    everyone = core.allgather(flat[None], name=f"same.{what}")
    for q in range(1, hvd.size()):
        np.testing.assert_array_equal(everyone[q], everyone[0], err_msg=f"{what}: rank {q}")


def _assert_same_weights(a, b, what, rtol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=1e-6, err_msg=what)


class _Record(keras.callbacks.Callback):
    def __init__(self, hook):
        super().__init__()
        self.rows = []
        self.hook = hook

    def on_epoch_end(self, epoch, logs=None):
        if self.hook == "epoch":
            self.rows.append(dict(logs))

    def on_batch_begin(self, batch, logs=None):
        if self.hook == "batch":
            self.rows.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


# -------------------------------------------------------------- fit
def case_fit_matches_single_process_full_batch_and_ranks_agree(core):
    r = hvd.rank()
    xs, ys = _shards(48)
    epochs = 3
    model = _compile(_model(seed=100 + r),  # different initial weights on every rank
                     hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    _assert_same_on_every_rank(core, model, "fit")

    reference = _compile(_model(seed=100), keras.optimizers.SGD(0.1, momentum=0.9))
    reference.fit(_global_batches(xs, PER_RANK_BATCH), _global_batches(ys, PER_RANK_BATCH),
                  batch_size=PER_RANK_BATCH * hvd.size(), epochs=epochs, shuffle=False,
                  verbose=0)
    _assert_same_weights(model, reference, "distributed fit vs one process")
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)


def case_fit_with_steps_per_execution_runs_collectives_in_a_loop(core):
    """Keras runs several steps inside one tf.while_loop: the allreduce is in
    the loop body, still in order on every rank."""
    r = hvd.rank()
    xs, ys = _shards(64)
    model = _compile(_model(seed=11), hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                     steps_per_execution=4)
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0)
    _assert_same_on_every_rank(core, model, "steps_per_execution")
    reference = _compile(_model(seed=11), keras.optimizers.SGD(0.1))
    reference.fit(_global_batches(xs, PER_RANK_BATCH), _global_batches(ys, PER_RANK_BATCH),
                  batch_size=PER_RANK_BATCH * hvd.size(), epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(model, reference, "steps_per_execution=4 vs one process")


def case_backward_passes_per_step_equals_a_larger_batch(core):
    r = hvd.rank()
    xs, ys = _shards(64)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.5),
                                         backward_passes_per_step=2,
                                         average_aggregated_gradients=True)
    model = _compile(_model(seed=7), optimizer)
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    passes = 64 // PER_RANK_BATCH
    assert int(optimizer.iterations) == passes, int(optimizer.iterations)
    _assert_same_on_every_rank(core, model, "accumulated")

    reference = _compile(_model(seed=7), keras.optimizers.SGD(0.2, momentum=0.5))
    reference.fit(_global_batches(xs, PER_RANK_BATCH, passes=2),
                  _global_batches(ys, PER_RANK_BATCH, passes=2),
                  batch_size=2 * PER_RANK_BATCH * hvd.size(), epochs=1, shuffle=False,
                  verbose=0)
    assert int(reference.optimizer.iterations) == passes // 2
    _assert_same_weights(model, reference, "2 passes per step vs a double batch")
    # The accumulators are not the optimizer's variables: checkpoints keep its layout.
    assert len(optimizer.variables) == len(reference.optimizer.variables)


def case_apply_gradients_local_vars_and_indexed_slices(core):
    n, r = hvd.size(), hvd.rank()
    shared = tf.Variable(np.zeros(3, np.float32))
    local = tf.Variable(np.zeros(3, np.float32))
    table = tf.Variable(np.zeros((n + 1, 2), np.float32))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.register_local_var(local)
    slices = tf.IndexedSlices(tf.ones([1, 2]) * (r + 1.0), tf.constant([r]),
                              dense_shape=tf.constant([n + 1, 2]))
    optimizer.apply_gradients([(tf.fill([3], r + 1.0), shared),
                               (tf.fill([3], r + 1.0), local), (slices, table)])
    mean = np.mean([q + 1.0 for q in range(n)])
    np.testing.assert_allclose(shared.numpy(), np.full(3, -mean))
    np.testing.assert_allclose(local.numpy(), np.full(3, -(r + 1.0) / n))
    expected = np.zeros((n + 1, 2))
    for q in range(n):
        expected[q] = -(q + 1.0) / n
    np.testing.assert_allclose(table.numpy(), expected)


# -------------------------------------------------------------- callbacks
def case_metric_average_callback_averages_logs(core):
    r = hvd.rank()
    xs, ys = _shards(32)
    raw, averaged = _Record("epoch"), _Record("epoch")
    model = _compile(_model(seed=3), hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[raw, hvd.callbacks.MetricAverageCallback(), averaged])
    for before, after in zip(raw.rows, averaged.rows):
        names = sorted(before)
        mine = np.array([before[k] for k in names], np.float64)
        everyone = core.allgather(mine[None], name=f"metrics.{len(names)}")
        assert sorted(after) == names
        np.testing.assert_allclose([after[k] for k in names], everyone.mean(axis=0),
                                   rtol=1e-12)
    losses = core.allgather(np.array([raw.rows[0]["loss"]]), name="metrics.raw")
    assert len(set(losses.tolist())) == hvd.size(), losses  # there was something to average


def case_learning_rate_warmup_follows_goyal_et_al(core):
    r, n = hvd.rank(), hvd.size()
    xs, ys = _shards(32)
    steps, warmup, initial = 32 // PER_RANK_BATCH, 2, 0.4
    lrs = _Record("batch")
    model = _compile(_model(seed=4), hvd.DistributedOptimizer(
        keras.optimizers.SGD(initial, momentum=0.9)))
    epochs = _Record("epoch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(
                      initial, warmup_epochs=warmup), lrs, epochs])
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            if epoch < warmup:
                e = epoch + batch / steps + 1.0 / steps
                expected.append(initial / n * (e * (n - 1) / warmup + 1))
            else:
                expected.append(expected[-1])
    np.testing.assert_allclose(lrs.rows, expected, rtol=1e-6)
    np.testing.assert_allclose(lrs.rows[steps * warmup - 1], initial, rtol=1e-6)
    np.testing.assert_allclose([row["lr"] for row in epochs.rows],
                               [expected[steps - 1], initial, initial], rtol=1e-6)
    # Keras 3 bakes SGD's momentum into the compiled step: correction is skipped, and said so.
    assert any("momentum correction is skipped" in str(w.message) for w in caught)
    assert model.optimizer.momentum == 0.9


def case_learning_rate_schedule_staircase_and_smooth(core):
    r = hvd.rank()
    xs, ys = _shards(16)
    lrs = _Record("batch")
    model = _compile(_model(seed=5), hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)))
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=4, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateScheduleCallback(
                  0.2, 0.5, start_epoch=1, end_epoch=3, momentum_correction=False), lrs])
    per_epoch = lrs.rows[::2]
    np.testing.assert_allclose(per_epoch, [1.0, 0.2, 0.1, 0.1], rtol=1e-6)

    lrs = _Record("batch")
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateScheduleCallback(
                  0.3, lambda epoch: 1.0 + epoch, staircase=False), lrs])
    np.testing.assert_allclose(lrs.rows, [0.3, 0.3 * 1.5], rtol=1e-6)
    expect_raises(ValueError, hvd.callbacks.LearningRateScheduleCallback, None, 0.5)


def case_best_model_checkpoint_keeps_the_best_epoch(core):
    r = hvd.rank()
    xs, ys = _shards(32)
    path = os.path.join(tempfile.mkdtemp(prefix=f"best_{r}_"), "best.keras")
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    checkpoint.filepath = path
    weights = []

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append((logs["loss"], [w.copy() for w in self.model.get_weights()]))

    model = _compile(_model(seed=6), hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    # A huge learning rate in the last epoch makes it the worst one.
    model.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateScheduleCallback(
                  0.1, lambda e: 1.0 if e < 2 else 500.0, momentum_correction=False),
                  hvd.callbacks.MetricAverageCallback(), Snapshot(), checkpoint])
    losses = [loss for loss, _ in weights]
    best = int(np.argmin(losses))
    assert best < 2, losses
    saved = keras.models.load_model(path)  # plain Keras: no Horovod needed to load it
    for a, b in zip(saved.get_weights(), weights[best][1]):
        np.testing.assert_array_equal(a, b)
    assert type(saved.optimizer) is keras.optimizers.SGD
    unset = hvd.callbacks.BestModelCheckpoint()
    expect_raises(ValueError, model.fit, xs[r], ys[r], epochs=1, verbose=0, callbacks=[unset])


# -------------------------------------------------------------- saving
def case_load_model_wraps_the_saved_optimizer_with_its_state(core):
    r = hvd.rank()
    xs, ys = _shards(32)
    directory = hvd_tf.broadcast_object(tempfile.mkdtemp(prefix="load_model_") if r == 0
                                        else None, root_rank=0, name="load_model_dir")
    path = os.path.join(directory, "model.keras")
    if r == 0:
        model = _compile(_model(seed=8), keras.optimizers.SGD(0.05, momentum=0.9))
        model.fit(xs[0], ys[0], batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
        model.save(path)
    hvd_tf.barrier()
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedOptimizer)
    assert type(loaded.optimizer).__name__ == "SGD"
    plain = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations) == int(plain.optimizer.iterations) == 32 // 8
    for a, b in zip(loaded.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a),
                                      keras.ops.convert_to_numpy(b))
    # Training continues from the saved state, averaged across ranks.
    loaded.fit(xs[r], ys[r], batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    plain.fit(_global_batches(xs, PER_RANK_BATCH), _global_batches(ys, PER_RANK_BATCH),
              batch_size=PER_RANK_BATCH * hvd.size(), epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(loaded, plain, "loaded then trained")
    expect_raises(ValueError, hvd.load_model, path, legacy_opts=True)


def case_optimizer_keeps_the_wrapped_class_and_config(core):
    adam = keras.optimizers.Adam(learning_rate=0.01, beta_1=0.8, clipnorm=1.0)
    wrapped = hvd.DistributedOptimizer(adam, compression=hvd.Compression.fp16)
    assert isinstance(wrapped, keras.optimizers.Adam) and type(wrapped).__name__ == "Adam"
    assert wrapped.get_config() == adam.get_config()
    assert wrapped is not adam and not adam.built
    same_route = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(same_route, _DistributedOptimizer)
    expect_raises(ValueError, hvd.DistributedOptimizer, wrapped)
    expect_raises(ValueError, hvd.DistributedOptimizer, keras.optimizers.SGD(), op=hvd_tf.Max)
    expect_raises(ValueError, hvd_tf.DistributedOptimizer, keras.optimizers.SGD(),
                  op=hvd_tf.Adasum)
    # A TF1 optimizer takes frontends.tensorflow's own route (legacy.py); other
    # objects are refused.
    legacy = hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    assert isinstance(legacy, tf.compat.v1.train.Optimizer)
    assert not isinstance(legacy, _DistributedOptimizer)
    expect_raises(ValueError, hvd_tf.DistributedOptimizer, object())  # Horovod's type
    # Horovod's Keras optimizer takes a predivide factor with Sum (a sum has
    # no division to split); the TF-level one refuses it, as Horovod's.
    hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd_tf.Sum, gradient_predivide_factor=2.0)
    expect_raises(ValueError, hvd_tf.DistributedOptimizer, keras.optimizers.SGD(),
                  op=hvd_tf.Sum, gradient_predivide_factor=2.0)


def case_tf_level_optimizer_of_a_keras_optimizer_reduces_with_its_op_and_says_horovod_would_not(
        core):
    import warnings

    n, r = hvd.size(), hvd.rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd_tf.Sum)
    assert any("averages" in str(w.message) for w in caught), [str(w.message) for w in caught]
    v = tf.Variable([0.0])
    opt.apply([tf.constant([r + 1.0])], [v])
    total = n * (n + 1) / 2
    np.testing.assert_allclose(v.numpy(), [-total])  # summed, as asked


def case_jit_compiled_train_step_raises_a_clear_error(core):
    r = hvd.rank()
    xs, ys = _shards(16)
    model = _model(seed=9)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    exc = expect_raises(tf.errors.InvalidArgumentError, model.fit, xs[r], ys[r],
                        batch_size=PER_RANK_BATCH, epochs=1, verbose=0)
    assert "jit_compile" in str(exc), str(exc)


def case_fit_with_mismatched_models_raises_failed_precondition(core):
    # Rank 0's hidden layer is wider: its gradients disagree in shape. (Names
    # given: an earlier case built one more model on rank 0, and Keras'
    # generated names, which the allreduces are named after, would differ.)
    r = hvd.rank()
    xs, ys = _shards(16)
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(13 if r == 0 else 12, activation="relu",
                                                 name="hidden"),
                              keras.layers.Dense(10, name="logits")], name="mismatched")
    _compile(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    exc = expect_raises(tf.errors.FailedPreconditionError, model.fit, xs[r], ys[r],
                        batch_size=PER_RANK_BATCH, epochs=1, verbose=0)
    message = str(exc)
    assert "shape" in message and "rank 0" in message and "rank 1" in message, message


def case_keras_module_collectives(core):
    n, r = hvd.size(), hvd.rank()
    np.testing.assert_allclose(hvd.allreduce([1.0, r]).numpy(),
                               [1.0, np.mean(range(n))])
    np.testing.assert_allclose(hvd.allreduce([1.0, r], op=hvd.Sum).numpy(),
                               [float(n), float(sum(range(n)))])
    np.testing.assert_array_equal(hvd.allgather([r]).numpy(), np.arange(n))
    np.testing.assert_array_equal(hvd.broadcast([r, r], root_rank=n - 1).numpy(),
                                  [n - 1, n - 1])
    np.testing.assert_allclose(hvd.reducescatter(np.ones((n, 2), np.float32)).numpy(),
                               np.ones((1, 2)))
    expect_raises(RuntimeError, hvd.broadcast_global_variables, 0)
