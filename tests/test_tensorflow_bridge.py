"""In one process, without init: the copy-free paths between TensorFlow and
NumPy the frontend relies on, error translation, compression."""

import gc
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from coordinator.errors import (HorovodInternalError, NotInitializedError,  # noqa: E402
                                ShutdownError, StallError, TensorMismatchError)
from frontends.tensorflow import errors, tensor_bridge as bridge  # noqa: E402
from frontends.tensorflow.compression import Compression  # noqa: E402
from mpi_harness import ROOT  # noqa: E402


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
        # Another test initialised the coordinator in this worker: a fresh
        # process, which this check needs, costs a TensorFlow import.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", _BEFORE_INIT], env=env, capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 0 and "refused" in proc.stdout, proc.stdout + proc.stderr
        return
    import frontends.tensorflow as hvd

    with pytest.raises(tf.errors.FailedPreconditionError, match="init"):
        hvd.allreduce(tf.ones(2))


_BEFORE_INIT = """
import tensorflow as tf
import frontends.tensorflow as hvd
try:
    hvd.allreduce(tf.ones(2))
except tf.errors.FailedPreconditionError as exc:
    assert "init" in str(exc), exc
    print("refused")
"""


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


# ---------------------------------------------------------- the GPU path
# On this machine TensorFlow has no GPU: these tests tell the bridge that CPU
# tensors are GPU tensors, with CuPy the fake of tests/gpu_fakes.py (device
# memory is host memory). tests/mpi/tf_gpu_cases.py runs the collectives so.

@pytest.fixture
def as_if_on_gpu(monkeypatch):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_fakes

    from coordinator import gpu

    cp = gpu_fakes.fake_cupy()
    monkeypatch.setitem(gpu._modules, "cupy", cp)
    monkeypatch.setattr(bridge, "on_gpu", lambda tensor: True)
    monkeypatch.setattr(bridge, "_core_takes_devices", lambda: True)
    syncs = []
    sync = tf.test.experimental.sync_devices
    monkeypatch.setattr(tf.test.experimental, "sync_devices",
                        lambda: (syncs.append(1), sync())[1])
    cp.syncs = syncs
    return cp


def test_a_cpu_tensor_is_not_taken_for_a_gpu_tensor():
    assert not bridge.on_gpu(tf.constant([1.0]))
    assert bridge.on_gpu(type("T", (), {"device": "/job:localhost/replica:0/task:0/"
                                                  "device:GPU:1"})())


def test_gpu_tensors_become_device_views_after_one_device_sync(as_if_on_gpu):
    from coordinator import gpu

    values = [tf.constant([1.0, 2.0]), tf.constant([1.5, -2.0], tf.bfloat16),
              tf.constant([True, False]), tf.constant([3, 4], tf.int32)]
    arrays = bridge.as_arrays(values, on_host=(3,))
    assert as_if_on_gpu.syncs == [1]
    assert isinstance(arrays[0], as_if_on_gpu.ndarray)
    np.testing.assert_array_equal(arrays[0].get(), [1.0, 2.0])
    assert isinstance(arrays[1], gpu.BFloat16)  # its int16 bits, marked
    np.testing.assert_array_equal(arrays[1].array.get(),
                                  np.array([1.5, -2.0], tf.bfloat16.as_numpy_dtype).view(np.int16))
    assert arrays[2].dtype == np.uint8 and arrays[2].get().tolist() == [1, 0]
    assert isinstance(arrays[3], np.ndarray) and arrays[3].tolist() == [3, 4]
    assert len(as_if_on_gpu.imported) == 3


def test_device_results_come_back_as_tensors_of_the_asked_dtype(as_if_on_gpu):
    from coordinator import gpu

    bits = np.array([1.5, -2.0], tf.bfloat16.as_numpy_dtype).view(np.int16)
    for array, dtype, want in [
            (as_if_on_gpu.ndarray(np.array([1.0, 2.0], np.float32)), tf.float32, [1.0, 2.0]),
            (gpu.bfloat16(as_if_on_gpu.ndarray(bits.copy())), tf.bfloat16, [1.5, -2.0]),
            (as_if_on_gpu.ndarray(bits.copy()), tf.bfloat16, [1.5, -2.0]),
            (as_if_on_gpu.ndarray(np.array([1, 0], np.uint8)), tf.bool, [True, False])]:
        tensor = bridge.to_tensor(array, dtype)
        assert tensor.dtype == dtype and tensor.numpy().tolist() == want


def test_outputs_for_device_arrays_are_device_arrays(as_if_on_gpu):
    from coordinator import gpu

    out = bridge.empty_like(as_if_on_gpu.ndarray(np.zeros((2, 3), np.float16)))
    assert isinstance(out, as_if_on_gpu.ndarray) and out.shape == (2, 3)
    assert out.dtype == np.float16
    marked = bridge.empty_like(gpu.bfloat16(as_if_on_gpu.ndarray(np.zeros(4, np.int16))))
    assert isinstance(marked, gpu.BFloat16) and marked.array.shape == (4,)
    host = bridge.empty_like(np.float32(1.0))  # a tf.numpy_function scalar
    assert isinstance(host, np.ndarray) and host.shape == ()


def test_without_cupy_gpu_tensors_are_copied_to_the_host(monkeypatch):
    monkeypatch.setattr(bridge, "on_gpu", lambda tensor: True)
    monkeypatch.setattr(bridge, "_core_takes_devices", lambda: False)
    (array,) = bridge.as_arrays([tf.constant([1.0, 2.0])])
    assert isinstance(array, np.ndarray) and array.tolist() == [1.0, 2.0]


def test_util_is_horovods_helpers_module():
    """`hvd.util` exists, as `horovod.tensorflow.util` does (Horovod's own
    TF tests call hvd.util._executing_eagerly())."""
    import keras

    import frontends.tensorflow as hvd
    from frontends.tensorflow import util

    assert hvd.util is util and util._executing_eagerly() is True
    assert tf.function(lambda: tf.constant(util._executing_eagerly()))().numpy() == False  # noqa: E712
    variables = [tf.Variable(1.0), [tf.Variable(2.0), keras.Variable(3.0)]]
    refs = hvd.vars_to_refs(variables)
    assert len({refs, hvd.vars_to_refs(variables)}) == 1
    back = hvd.refs_to_vars(refs)
    assert back[0] is variables[0] and back[1][0] is variables[1][0]
    assert back[1][1] is variables[1][1]
    calls = []
    twice = hvd._cache(lambda x: calls.append(x) or x * 2)
    assert twice(3) == 6 and twice(3) == 6 and calls == [3]
    assert float(hvd._make_subgraph(lambda: tf.constant(2.0) * 3)()) == 6.0


def test_a_gpu_ops_int32_result_in_host_memory_is_not_a_gpu_tensor():
    """TensorFlow keeps int32 results of GPU ops in host memory: `device`
    says GPU, `backing_device` says CPU, and DLPack exports a CPU array,
    which CuPy refuses. The backing device decides."""
    gpu_name = "/job:localhost/replica:0/task:0/device:GPU:0"
    cpu_name = "/job:localhost/replica:0/task:0/device:CPU:0"
    held_on_host = type("T", (), {"device": gpu_name, "backing_device": cpu_name})()
    on_device = type("T", (), {"device": gpu_name, "backing_device": gpu_name})()
    assert not bridge.on_gpu(held_on_host) and bridge.on_gpu(on_device)
    assert not bridge.on_gpu(tf.constant([1], tf.int32))


def _cuda_capsule():
    """A DLPack capsule marked as CUDA memory (NumPy's, its device type
    rewritten: only its header is read here), and its header's address."""
    import ctypes

    capsule = np.arange(4, dtype=np.float32).__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    base = get(capsule, b"dltensor")
    return capsule, base


def test_a_capsules_gpu_number_is_rewritten_in_place():
    import ctypes

    with pytest.raises(ValueError, match="not a CUDA"):
        bridge._retarget(np.zeros(2).__dlpack__(), 1)  # a CPU capsule is left alone
    capsule, base = _cuda_capsule()
    ptr = ctypes.sizeof(ctypes.c_void_p)
    ctypes.c_int32.from_address(base + ptr).value = 2  # kDLCUDA
    assert bridge._retarget(capsule, 3) is capsule
    assert ctypes.c_int32.from_address(base + ptr + 4).value == 3
    ctypes.c_int32.from_address(base + ptr).value = 1  # (back to CPU for its deleter)


@pytest.mark.parametrize("logical,expected", [(1, [2]), (2, None)])
def test_tensorflows_gpu_numbers_map_to_cuda_ordinals(monkeypatch, logical, expected):
    """With `set_visible_devices(gpus[2], 'GPU')` (Horovod's recipe for
    local rank 2) TensorFlow's GPU:0 is CUDA device 2, and its DLPack
    capsules name 0 (tensorflow/tensorflow#47866). A GPU split into logical
    ones has no known mapping: numbers are taken as they are."""
    visible = [types.SimpleNamespace(name="/physical_device:GPU:2")]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: visible)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: [0] * logical)
    bridge._cuda_ordinals.cache_clear()
    try:
        assert bridge._cuda_ordinals() == expected
        assert bridge._cuda_ordinal(0) == (2 if expected else 0)
        assert bridge._tf_gpu(2) == (0 if expected else 2)
    finally:
        bridge._cuda_ordinals.cache_clear()


def test_a_gpu_without_memory_growth_is_said_once(monkeypatch, caplog):
    visible = [types.SimpleNamespace(name="/physical_device:GPU:0")]
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: visible)
    monkeypatch.setattr(tf.config.experimental, "get_memory_growth", lambda device: False)
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    bridge._check_memory_growth.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="coordinator"):
            bridge._check_memory_growth(0)
            bridge._check_memory_growth(0)
        said = [r for r in caplog.records if "set_memory_growth" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        bridge._check_memory_growth.cache_clear()


def test_a_gpu_tensor_reaches_cupy_and_comes_back_under_each_ones_gpu_number(monkeypatch):
    """Where TensorFlow's GPU:0 is CUDA device 2: CuPy is handed a capsule
    (and a device) naming 2, and TensorFlow one naming 0."""
    import ctypes

    from coordinator import gpu

    ptr = ctypes.sizeof(ctypes.c_void_p)
    capsule, base = _cuda_capsule()
    ctypes.c_int32.from_address(base + ptr).value = 2  # kDLCUDA, TensorFlow's GPU:0
    seen = {}

    def from_dlpack(producer):
        seen["device"] = producer.__dlpack_device__()
        seen["capsule_id"] = ctypes.c_int32.from_address(base + ptr + 4).value
        return "a cupy array"

    monkeypatch.setitem(gpu._modules, "cupy", types.SimpleNamespace(from_dlpack=from_dlpack))
    monkeypatch.setattr(bridge, "_cuda_ordinals", lambda: [2])
    monkeypatch.setattr(bridge, "_check_memory_growth", lambda tf_gpu: None)
    monkeypatch.setattr(tf.experimental.dlpack, "to_dlpack", lambda view: capsule)
    view = types.SimpleNamespace(__dlpack_device__=lambda: (2, 0))
    assert bridge._device_array(types.SimpleNamespace(dtype=tf.float32), view) == "a cupy array"
    assert seen == {"device": (2, 2), "capsule_id": 2}

    out, out_base = _cuda_capsule()
    ctypes.c_int32.from_address(out_base + ptr).value = 2
    ctypes.c_int32.from_address(out_base + ptr + 4).value = 2  # CuPy's CUDA device 2
    result = types.SimpleNamespace(__dlpack__=lambda: out, device=types.SimpleNamespace(id=2))
    monkeypatch.setattr(bridge, "_on_host", lambda array: False)
    monkeypatch.setattr(bridge, "_results_may_be_queued", lambda: False)
    monkeypatch.setattr(tf.experimental.dlpack, "from_dlpack",
                        lambda c: ctypes.c_int32.from_address(out_base + ptr + 4).value)
    assert bridge.to_tensor(result, tf.float32) == 0  # TensorFlow's GPU:0
    for b in (base, out_base):
        ctypes.c_int32.from_address(b + ptr).value = 1  # (back to CPU for the deleters)
