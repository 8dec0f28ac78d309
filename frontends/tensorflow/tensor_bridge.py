"""Moving tensors between TensorFlow and the coordinator without copying.

The coordinator works on NumPy arrays. What each direction costs, measured on
TensorFlow 2.21 (CPU):

- TensorFlow -> NumPy. An eager CPU tensor's `_numpy()` is a view of its
  buffer (`numpy()` is that view copied). Inside a `tf.function`,
  `tf.numpy_function` hands its Python body views of the input tensors too.
  Either way: no copy.
- NumPy -> TensorFlow. `tf.convert_to_tensor` always copies (about 90 us per
  MB here). Two ways avoid it, and both need a buffer aligned to 64 bytes,
  which NumPy does not promise: DLPack (`from_dlpack`, used eagerly) and the
  return value of a `tf.numpy_function` body (TensorFlow adopts an aligned
  array and copies an unaligned one). So results are written into buffers
  from `aligned_empty`. Results the coordinator allocates itself (allgather,
  alltoall, reducescatter: their size is known only after negotiation) are
  adopted when they happen to be aligned and copied once otherwise.

DLPack on an unaligned buffer does not fail cleanly: TensorFlow aborts the
process on first use. `to_tensor` therefore checks alignment first.
"""

import math

import numpy as np
import tensorflow as tf

# TensorFlow's CPU allocator and kernels assume this alignment (Eigen).
ALIGNMENT = 64


def _address(array):
    return array.__array_interface__["data"][0]


def is_aligned(array):
    return _address(array) % ALIGNMENT == 0


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous array whose data starts on a 64-byte
    boundary, so TensorFlow can adopt it without a copy."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -_address(raw) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def as_numpy(value):
    """A NumPy view of a tensor's memory (tensors off the CPU are copied to
    the host); variables are read first, NumPy arrays pass through and other
    Python values go through `np.asarray`.

    The view aliases a tensor TensorFlow treats as immutable: read it, never
    write it."""
    if isinstance(value, np.ndarray):
        return value
    if not hasattr(value, "_numpy"):
        if not (tf.is_tensor(value) or isinstance(value, tf.Variable)
                or hasattr(value, "__tf_tensor__")):
            return np.asarray(value)
        value = tf.convert_to_tensor(value)
    return value._numpy()


def _adoptable(array):
    return (array.size > 0 and array.dtype.kind in "biuf" and array.flags.c_contiguous
            and array.flags.writeable and is_aligned(array))


def to_tensor(array):
    """An eager tensor holding `array`: adopted through DLPack when it is
    aligned (no copy), copied otherwise (unaligned, empty, bfloat16)."""
    if _adoptable(array):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def adoptable_result(array):
    """`array` as a `tf.numpy_function` body should return it: TensorFlow
    adopts aligned arrays, and copies the rest itself."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)
