"""Multi-rank cases for the names horovod.keras has that
frontends.tensorflow.keras gained with the elastic work: Adasum and
PartialDistributedOptimizer (run by tests/test_keras_names.py)."""

import numpy as np

from tf_common import configure_tensorflow

configure_tensorflow()

import keras  # noqa: E402

import frontends.tensorflow.keras as hvd  # noqa: E402


def setup(core):
    hvd.init()


def _gradient_step(optimizer, grads_by_rank):
    """One apply() of this rank's gradient on a variable of zeros; returns
    the variable (SGD with lr 1: minus the reduced gradient)."""
    var = keras.Variable(np.zeros(3, np.float32))
    optimizer.apply([keras.ops.convert_to_tensor(grads_by_rank[hvd.rank()])], [var])
    return -keras.ops.convert_to_numpy(var)


def _adasum(a, b):
    """Adasum of two vectors (Maleki et al.)."""
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def case_adasum_is_exported_and_reduces_keras_gradients_by_adasum(core):
    assert hvd.Adasum == core.Adasum
    grads = [np.array([1.0, 2.0, 0.0], np.float32), np.array([0.0, 1.0, 3.0], np.float32)]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum)
    got = _gradient_step(opt, grads)
    np.testing.assert_allclose(got, _adasum(grads[0], grads[1]), rtol=1e-5)


def case_partial_distributed_optimizer_keeps_local_layers_local(core):
    keras.utils.set_random_seed(7)
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(2, name="local")
    model = keras.Sequential([keras.Input((4,)), shared, local])
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=local)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(hvd.rank())  # different data on every rank
    model.fit(rng.standard_normal((16, 4)), rng.standard_normal((16, 2)), batch_size=8,
              epochs=1, verbose=0, shuffle=False)
    flat = {layer.name: np.concatenate([w.ravel() for w in layer.get_weights()])
            for layer in (shared, local)}
    everyone = {name: core.allgather(value[None], name=f"partial.{name}")
                for name, value in flat.items()}
    np.testing.assert_array_equal(everyone["shared"][0], everyone["shared"][1])
    assert not np.allclose(everyone["local"][0], everyone["local"][1])


def case_partial_distributed_optimizer_checks_its_layers(core):
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])
    except ValueError as exc:
        assert "local layers must be" in str(exc)
    else:
        raise AssertionError("a non-layer was accepted as a local layer")
