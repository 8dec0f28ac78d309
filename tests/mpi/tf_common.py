"""Helpers shared by the TensorFlow and Keras case modules."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from core_cases import data, expect_raises  # noqa: E402,F401 (shared with the core's cases)

_THREADS_SET = []


def configure_tensorflow():
    """Small thread pools: these tests share 2 cores between ranks."""
    if not _THREADS_SET:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        _THREADS_SET.append(True)


def both_modes(fn, *args):
    """[fn(*args) run eagerly, fn(*args) run inside a tf.function]."""
    return [("eager", fn(*args)), ("tf.function", tf.function(fn)(*args))]


def assert_equal(actual, expected, what=""):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual, expected, err_msg=what)


def digits(n=None):
    """The bundled digits (coordinator/digits.py), scaled to [0, 1]."""
    from coordinator.digits import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    return (x, y) if n is None else (x[:n], y[:n])
