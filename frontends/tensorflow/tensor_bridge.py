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

GPU tensors, eagerly, where CuPy is installed: the core gets CuPy views of
their memory through DLPack (no copy) and its NCCL backend reduces them on
the device; results come back through DLPack, again without a copy, as
tensors on the same GPU. bfloat16 (which CuPy lacks) travels as its int16
bitcast marked `coordinator.gpu.bfloat16`, bool as a uint8 cast. Python
cannot reach TensorFlow's compute stream (torch's is reachable, and there
the core only records an event on it): so before the core reads a GPU
tensor, every device TensorFlow uses is synchronised once per call
(`tf.test.experimental.sync_devices`), which blocks the calling thread until
TensorFlow's queued GPU work is done. Results need no such step: a blocking
collective returns once the device work that wrote them has finished (with
HOROVOD_ENABLE_ASYNC_COMPLETION, once it is queued: then `to_tensor` waits
for CuPy's current stream, which synchronize made wait for that work).
Without CuPy, GPU tensors are copied to the host and back as before. Inside
a `tf.function` collectives are `tf.numpy_function`s, which TensorFlow runs
on the host: GPU tensors are copied to the host and the results back by
TensorFlow itself.
"""

import ctypes
import functools
import logging
import math
import os

import numpy as np
import tensorflow as tf

from coordinator import gpu as core_gpu

log = logging.getLogger("coordinator")

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


def on_gpu(tensor):
    """True for an eager tensor whose memory is on a GPU. `device` names
    where its op ran; TensorFlow keeps the int32 results of GPU ops in host
    memory, which `backing_device` says (DLPack exports them as CPU arrays,
    which CuPy refuses)."""
    try:
        where = tensor.backing_device
    except Exception:  # (not an eager tensor)
        where = getattr(tensor, "device", None)
    return ":GPU:" in (where or "")


# DLPack's DLManagedTensor begins with a DLTensor: data (a pointer), then
# its DLDevice: device_type and device_id, two int32s.
_DEVICE_TYPE_AT, _DEVICE_ID_AT = ctypes.sizeof(ctypes.c_void_p), ctypes.sizeof(ctypes.c_void_p) + 4
_KDLCUDA = 2


def _retarget(capsule, device_id):
    """Sets the device id a (not yet consumed) CUDA DLPack capsule names."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    base = get(capsule, b"dltensor")
    if ctypes.c_int32.from_address(base + _DEVICE_TYPE_AT).value != _KDLCUDA:
        raise ValueError("not a CUDA DLPack capsule")
    ctypes.c_int32.from_address(base + _DEVICE_ID_AT).value = device_id
    return capsule


@functools.lru_cache(maxsize=None)
def _cuda_ordinals():
    """TensorFlow's GPU numbers -> CUDA device ordinals. They differ where
    the program hid GPUs from TensorFlow (Horovod's recipe:
    `tf.config.set_visible_devices(gpus[hvd.local_rank()], 'GPU')` makes
    every rank's GPU TensorFlow's GPU:0), and TensorFlow's DLPack names its
    own number (tensorflow/tensorflow#47866). None where TensorFlow splits a
    GPU into several logical ones (no mapping is known): numbers are then
    taken as they are."""
    visible = tf.config.get_visible_devices("GPU")
    if len(visible) != len(tf.config.list_logical_devices("GPU")):
        return None
    return [int(d.name.rsplit(":", 1)[1]) for d in visible]


def _cuda_ordinal(tf_gpu):
    ordinals = _cuda_ordinals()
    return ordinals[tf_gpu] if ordinals and tf_gpu < len(ordinals) else tf_gpu


def _tf_gpu(ordinal):
    ordinals = _cuda_ordinals()
    return ordinals.index(ordinal) if ordinals and ordinal in ordinals else ordinal


@functools.lru_cache(maxsize=None)
def _check_memory_growth(tf_gpu):
    """Says once per GPU when TensorFlow may hold nearly all of its memory:
    the core's results and NCCL's buffers come from CuPy's pool beside it."""
    if os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true":
        return
    try:
        growth = tf.config.experimental.get_memory_growth(
            tf.config.get_visible_devices("GPU")[tf_gpu])
    except Exception:
        return
    if not growth:
        log.warning("TensorFlow reserves most of GPU:%d's memory unless memory growth is on, "
                    "and the coordinator's results come from CuPy's memory pool on the same "
                    "GPU: call tf.config.experimental.set_memory_growth(gpu, True) before "
                    "TensorFlow uses the GPU (as Horovod's examples do), or set "
                    "TF_FORCE_GPU_ALLOW_GROWTH=true", tf_gpu)


@functools.lru_cache(maxsize=None)
def _core_takes_devices():
    """True when the core can take GPU tensors as they are (CuPy is installed)."""
    return core_gpu.cupy_installed()


class _Exported:
    """A DLPack producer over a capsule TensorFlow exported. TensorFlow's own
    `__dlpack__` refuses the consumer's stream, which CuPy always passes;
    the tensor's writers have finished (`as_arrays`), so none is needed."""

    __slots__ = ("capsule", "device")

    def __init__(self, capsule, device):
        self.capsule = capsule
        self.device = device

    def __dlpack__(self, stream=None, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _device_view(tensor):
    """The tensor as the core's device dtypes hold it (TensorFlow ops)."""
    if tensor.dtype == tf.bfloat16:
        return tf.bitcast(tensor, tf.int16)
    if tensor.dtype == tf.bool:
        return tf.cast(tensor, tf.uint8)
    return tensor


def _device_array(original, view):
    cp = core_gpu.cupy("a GPU tensor")
    capsule = tf.experimental.dlpack.to_dlpack(view)
    kind, tf_gpu = view.__dlpack_device__()
    device = (kind, tf_gpu)
    if kind == _KDLCUDA:
        _check_memory_growth(tf_gpu)
        ordinal = _cuda_ordinal(tf_gpu)
        if ordinal != tf_gpu:  # CuPy takes the capsule's number for a CUDA ordinal
            device = (kind, ordinal)
            _retarget(capsule, ordinal)
    array = cp.from_dlpack(_Exported(capsule, device))
    return core_gpu.bfloat16(array) if original.dtype == tf.bfloat16 else array


def as_arrays(values, on_host=()):
    """Arrays for the core, one per value: `as_numpy` of each, except that
    eager GPU tensors become CuPy views of their memory where CuPy is
    installed (see the module doc; one device synchronisation for all).
    Values whose index is in `on_host` (arguments such as alltoall's
    splits, which the core reads on the host) always go through NumPy."""
    on_device = _core_takes_devices() and [
        i for i, v in enumerate(values) if i not in on_host and tf.is_tensor(v) and on_gpu(v)]
    if not on_device:
        return [as_numpy(v) for v in values]
    views = {i: _device_view(values[i]) for i in on_device}
    tf.test.experimental.sync_devices()  # TensorFlow's writers (and the casts) are done
    return [_device_array(values[i], views[i]) if i in views else as_numpy(v)
            for i, v in enumerate(values)]


def _on_host(array):
    """True for a NumPy array or scalar (what a `tf.numpy_function` body
    gets), or anything else that is not a device array."""
    return isinstance(array, (np.ndarray, np.generic)) or not core_gpu.is_device_array(array)


def empty_like(array):
    """An uninitialised output for the core to write `array`'s result into:
    aligned host memory for a host array (`aligned_empty`), device memory
    on the same GPU for a device array."""
    if _on_host(array):
        return aligned_empty(np.shape(array), array.dtype)
    bf16 = isinstance(array, core_gpu.BFloat16)
    device = array.array if bf16 else array
    cp = core_gpu.cupy()
    with cp.cuda.Device(device.device.id):
        out = cp.empty(device.shape, device.dtype)
    return core_gpu.bfloat16(out) if bf16 else out


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


def _results_may_be_queued():
    from coordinator import runtime

    rt = runtime.current()
    return rt is not None and rt.config.async_completion


def _adoptable(array):
    return (array.size > 0 and array.dtype.kind in "biuf" and array.flags.c_contiguous
            and array.flags.writeable and is_aligned(array))


def to_tensor(array, dtype=None):
    """An eager tensor holding `array`: adopted through DLPack when it is
    aligned (no copy), copied otherwise (unaligned, empty, bfloat16). A
    device array becomes a tensor on its GPU, through DLPack; `dtype` says
    what its bits are (bfloat16 comes back from the device as int16, bool
    as uint8)."""
    if _on_host(array):
        array = np.asarray(array)
        if _adoptable(array):
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        return tf.convert_to_tensor(array)
    if isinstance(array, core_gpu.BFloat16):
        array = array.array
    if _results_may_be_queued():
        # HOROVOD_ENABLE_ASYNC_COMPLETION: the result may still be being
        # written; synchronize made CuPy's current stream wait for it, but
        # TensorFlow reads on streams of its own, so wait here on the host.
        core_gpu.cupy().cuda.get_current_stream().synchronize()
    # __dlpack__() with no max_version gives the unversioned capsule
    # TensorFlow takes; CuPy 13.4.0's toDlpack() gave a versioned one.
    dlpack = getattr(array, "__dlpack__", None)
    capsule = dlpack() if dlpack is not None else array.toDlpack()
    ordinal = array.device.id
    tf_gpu = _tf_gpu(ordinal)
    if tf_gpu != ordinal:  # TensorFlow reads the capsule's number as its own GPU's
        _retarget(capsule, tf_gpu)
    tensor = tf.experimental.dlpack.from_dlpack(capsule)
    if dtype == tf.bfloat16 and tensor.dtype != tf.bfloat16:
        return tf.bitcast(tensor, tf.bfloat16)
    if dtype == tf.bool and tensor.dtype != tf.bool:
        return tf.cast(tensor, tf.bool)
    return tensor


def adoptable_result(array):
    """`array` as a `tf.numpy_function` body should return it: TensorFlow
    adopts aligned arrays, and copies the rest itself."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)
