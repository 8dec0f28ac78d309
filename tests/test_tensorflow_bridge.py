"""In one process, without init: the copy-free paths between TensorFlow and
NumPy the frontend relies on, error translation, compression."""

import gc
import os
import weakref

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from coordinator.errors import (HorovodInternalError, NotInitializedError,  # noqa: E402
                                ShutdownError, StallError, TensorMismatchError)
from frontends.tensorflow import errors, tensor_bridge as bridge  # noqa: E402
from frontends.tensorflow.compression import Compression  # noqa: E402


def address(array):
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 3), (1000,)])
@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float16, np.float64])
def test_aligned_empty_starts_on_64_bytes(shape, dtype):
    array = bridge.aligned_empty(shape, dtype)
    assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
    if array.size:
        assert address(array) % 64 == 0


def test_as_numpy_views_eager_tensors_and_variable_reads_without_copying():
    tensor = tf.range(10.0)
    assert address(bridge.as_numpy(tensor)) == address(tensor._numpy())
    variable = tf.Variable(np.arange(4.0))
    view = bridge.as_numpy(variable)
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0]
    plain = np.ones(3)
    assert bridge.as_numpy(plain) is plain
    assert bridge.as_numpy([1, 2]).tolist() == [1, 2]


def test_to_tensor_adopts_aligned_arrays_and_keeps_them_alive():
    array = bridge.aligned_empty((1000,), np.float32)
    array[:] = np.arange(1000)
    tensor = bridge.to_tensor(array)
    assert address(tensor._numpy()) == address(array)  # no copy
    owner = weakref.ref(array.base)
    del array
    gc.collect()
    assert owner() is not None  # the tensor holds the buffer
    assert float(tf.reduce_sum(tensor)) == 499500.0
    del tensor
    gc.collect()
    assert owner() is None


def test_to_tensor_copies_what_it_cannot_adopt():
    unaligned = bridge.aligned_empty((65,), np.uint8)[1:].view(np.uint8)
    unaligned[:] = 7
    tensor = bridge.to_tensor(unaligned)  # DLPack here would crash TensorFlow later
    assert address(tensor._numpy()) != address(unaligned)
    assert int(tf.reduce_sum(tf.cast(tensor, tf.int32))) == 7 * 64
    assert bridge.to_tensor(np.zeros((0, 3), np.float32)).shape == (0, 3)
    import ml_dtypes

    bf16 = np.ones(4, ml_dtypes.bfloat16)
    assert bridge.to_tensor(bf16).dtype == tf.bfloat16


def test_numpy_function_passes_views_and_adopts_aligned_results():
    """The two TensorFlow behaviours that make a collective inside a
    tf.function copy-free."""
    seen = {}

    def body(x):
        seen["input"] = address(x)
        out = bridge.aligned_empty(x.shape, x.dtype)
        np.multiply(x, 2, out=out)
        seen["output"] = address(out)
        return out

    @tf.function
    def run(x):
        return tf.numpy_function(body, [x], tf.float32)

    x = tf.range(1024.0)
    y = run(x)
    assert seen["input"] == address(x._numpy())
    assert seen["output"] == address(y._numpy())
    np.testing.assert_array_equal(y.numpy(), 2 * np.arange(1024.0, dtype=np.float32))


def test_core_errors_become_horovods_tf_error_types():
    cases = [
        (TensorMismatchError("rank 0 sent (2,); rank 1 sent (3,)"),
         tf.errors.FailedPreconditionError),
        (NotInitializedError("not initialized"), tf.errors.FailedPreconditionError),
        (ShutdownError("shut down"), tf.errors.UnknownError),
        (StallError("stalled"), tf.errors.UnknownError),
        (HorovodInternalError("failed"), tf.errors.UnknownError),
        (ValueError("bad splits"), tf.errors.InvalidArgumentError),
    ]
    for exc, expected in cases:
        translated = errors.translate(exc)
        assert type(translated) is expected and str(exc) in str(translated), exc
    other = KeyError("x")
    assert errors.translate(other) is other


def test_collective_before_init_raises_failed_precondition():
    import coordinator

    if coordinator.is_initialized():
        pytest.skip("another test initialised the coordinator in this process")
    import frontends.tensorflow as hvd

    with pytest.raises(tf.errors.FailedPreconditionError, match="init"):
        hvd.allreduce(tf.ones(2))


def test_jit_compile_is_refused_when_tracing():
    import frontends.tensorflow as hvd

    @tf.function(jit_compile=True)
    def compiled(x):
        return hvd.allreduce(x)

    with pytest.raises(tf.errors.InvalidArgumentError, match="jit_compile=True"):
        compiled(tf.ones(2))


def test_fp16_compression_casts_floats_only():
    x = tf.constant([1.5, 2.25], tf.float64)
    compressed, ctx = Compression.fp16.compress(x)
    assert compressed.dtype == tf.float16
    restored = Compression.fp16.decompress(compressed, ctx)
    assert restored.dtype == tf.float64 and restored.numpy().tolist() == [1.5, 2.25]
    ints = tf.constant([1, 2])
    same, ctx = Compression.fp16.compress(ints)
    assert same.dtype == tf.int32 and Compression.fp16.decompress(same, ctx).dtype == tf.int32
    assert Compression.none.compress(x)[0] is x
