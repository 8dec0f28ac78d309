"""frontends.torch on one process: the API surface matches horovod.torch
0.28.1, tensors reach the core without copies, compression round-trips.
(Multi-rank behaviour: tests/test_torch_mpi.py.)"""

import inspect

import numpy as np
import pytest
import torch

import frontends.torch as hvd
from frontends.torch import _tensors
from horovod_signatures import AVG, GPS, NONE, REQUIRED, check_signature

# horovod.torch 0.28.1's signatures: (parameter, default or REQUIRED), in order.
R = REQUIRED
_REDUCE = [("average", None), ("name", None), ("op", None), ("prescale_factor", 1.0),
           ("postscale_factor", 1.0), ("process_set", GPS)]
_REDUCE_C = [("average", None), ("name", None), ("compression", NONE), ("op", None),
             ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", GPS)]
_RS = [("name", None), ("op", AVG), ("process_set", GPS), ("prescale_factor", 1.0),
       ("postscale_factor", 1.0)]
_RS_C = [("name", None), ("compression", NONE), ("op", AVG), ("process_set", GPS),
         ("prescale_factor", 1.0), ("postscale_factor", 1.0)]
HOROVOD_SIGNATURES = {
    "allreduce": [("tensor", R)] + _REDUCE_C,
    "allreduce_": [("tensor", R)] + _REDUCE,
    "allreduce_async": [("tensor", R)] + _REDUCE,
    "allreduce_async_": [("tensor", R)] + _REDUCE,
    "grouped_allreduce": [("tensors", R)] + _REDUCE_C,
    "grouped_allreduce_": [("tensors", R)] + _REDUCE,
    "grouped_allreduce_async": [("tensors", R)] + _REDUCE,
    "grouped_allreduce_async_": [("tensors", R)] + _REDUCE,
    "sparse_allreduce_async": [("tensor", R), ("name", R), ("op", R), ("process_set", GPS)],
    "allgather": [("tensor", R), ("name", None), ("process_set", GPS)],
    "allgather_async": [("tensor", R), ("name", None), ("process_set", GPS)],
    "grouped_allgather": [("tensors", R), ("name", None), ("process_set", GPS)],
    "grouped_allgather_async": [("tensors", R), ("name", None), ("process_set", GPS)],
    "broadcast": [("tensor", R), ("root_rank", R), ("name", None), ("process_set", GPS)],
    "broadcast_": [("tensor", R), ("root_rank", R), ("name", None), ("process_set", GPS)],
    "broadcast_async": [("tensor", R), ("root_rank", R), ("name", None), ("process_set", GPS)],
    "broadcast_async_": [("tensor", R), ("root_rank", R), ("name", None), ("process_set", GPS)],
    "alltoall": [("tensor", R), ("splits", None), ("name", None), ("process_set", GPS)],
    "alltoall_async": [("tensor", R), ("splits", None), ("name", None), ("process_set", GPS)],
    "reducescatter": [("tensor", R)] + _RS_C,
    "reducescatter_async": [("tensor", R)] + _RS,
    "grouped_reducescatter": [("tensors", R)] + _RS_C,
    "grouped_reducescatter_async": [("tensors", R)] + _RS,
    "join": [("device", -1)],
    "barrier": [("process_set", GPS)],
    "poll": [("handle", R)],
    "synchronize": [("handle", R)],
    "init": [("comm", None), ("process_sets", None)],
    "shutdown": [],
    "broadcast_parameters": [("params", R), ("root_rank", R)],
    "broadcast_optimizer_state": [("optimizer", R), ("root_rank", R), ("model", None)],
    "broadcast_object": [("obj", R), ("root_rank", 0), ("name", None), ("process_set", GPS)],
    "allgather_object": [("obj", R), ("name", None)],
    "DistributedOptimizer": [("optimizer", R), ("named_parameters", None),
                             ("compression", NONE), ("backward_passes_per_step", 1),
                             ("op", AVG), ("gradient_predivide_factor", 1.0), ("num_groups", 0),
                             ("groups", None), ("sparse_as_dense", False),
                             ("process_set", GPS)],
}
QUERIES = ["is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
           "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled",
           "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "cuda_built", "rocm_built",
           "ddl_built", "start_timeline", "stop_timeline", "add_process_set",
           "remove_process_set"]


@pytest.mark.parametrize("name", sorted(HOROVOD_SIGNATURES))
def test_signature_matches_horovod_torch(name):
    check_signature(getattr(hvd, name), HOROVOD_SIGNATURES[name], hvd)


def test_every_horovod_name_is_exported():
    for name in QUERIES + ["Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
                           "ProcessSet", "global_process_set", "HorovodInternalError",
                           "SyncBatchNorm"]:
        assert hasattr(hvd, name), name
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    from frontends.torch import mpi_ops  # Horovod scripts import from mpi_ops too

    for name in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                 "grouped_allreduce", "synchronize", "Average", "is_homogeneous",
                 "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
                 "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall",
                 "HorovodReducescatter", "HorovodGroupedReducescatter"):
        assert hasattr(mpi_ops, name), name


def test_build_queries_before_init():
    assert hvd.mpi_built() is True
    assert hvd.gloo_built() is False and hvd.nccl_built() == 0
    assert hvd.cuda_built() is False and hvd.rocm_built() is False


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float16, torch.float32, torch.float64,
                                   torch.bool, torch.bfloat16])
def test_cpu_tensors_reach_the_core_as_views_of_their_storage(dtype):
    t = torch.zeros(3, 4, dtype=dtype)
    b = _tensors.bridge(t, "test")
    assert b.array.__array_interface__["data"][0] == t.data_ptr()
    assert b.array.shape == (3, 4) and b.array.dtype.itemsize == t.element_size()
    b.array[1, 2] = 1  # what the core writes lands in the tensor
    assert t[1, 2].item() == 1
    assert b.written() is t


def test_bfloat16_results_wrap_without_copy():
    import ml_dtypes

    arr = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = _tensors.to_tensor(arr, torch.empty(0, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.data_ptr() == arr.__array_interface__["data"][0]
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_unsupported_tensors_and_shared_in_place_targets_are_value_errors():
    with pytest.raises(ValueError, match="Tensor type torch.ComplexFloatTensor is not supported"):
        _tensors.bridge(torch.zeros(2, dtype=torch.complex64), "test")
    with pytest.raises(ValueError, match="not supported"):
        _tensors.bridge(torch.zeros(2, dtype=torch.bool), "test", reducible=True)
    shared = torch.zeros(3, 1).expand(3, 4)
    with pytest.raises(ValueError, match="share memory.*test"):
        _tensors.bridge(shared, "test", inplace=True)
    assert _tensors.bridge(shared, "test").array.flags.c_contiguous  # read only: a copy


@pytest.mark.parametrize("layout, distinct", [
    (lambda: torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), True),
    (lambda: torch.zeros(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d),
     True),
    (lambda: torch.zeros(4, 6)[:, ::2], True),
    (lambda: torch.zeros(4, 6).t(), True),
    (lambda: torch.zeros(5, 1, 3)[:, :, 1], True),
    (lambda: torch.zeros(3, 1).expand(3, 4), False),
    (lambda: torch.zeros(10).as_strided((3, 3), (2, 1)), False),  # rows overlap
    (lambda: torch.zeros(10).as_strided((3, 3), (3, 1)), True),
])
def test_a_tensor_that_is_not_contiguous_is_bridged_through_a_copy(layout, distinct):
    tensor = layout()
    assert _tensors._distinct_elements(tensor) is distinct
    if not distinct:
        return
    bridged = _tensors.bridge(tensor, "test", inplace=True)
    assert bridged.array.flags.c_contiguous and bridged.array.shape == tuple(tensor.shape)
    bridged.array[...] = np.arange(tensor.numel()).reshape(tensor.shape)
    assert bridged.written() is tensor
    assert torch.equal(tensor, torch.arange(tensor.numel(), dtype=tensor.dtype).reshape(
        tensor.shape))


def test_fp16_compression_round_trip():
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == torch.float64
    torch.testing.assert_close(back, x, atol=1e-3, rtol=0)
    ints = torch.arange(4)
    sent, ctx = hvd.Compression.fp16.compress(ints)
    assert sent is ints and hvd.Compression.fp16.decompress(sent, ctx) is ints
    same, ctx = hvd.Compression.none.compress(x)
    assert same is x and hvd.Compression.none.decompress(same, ctx) is x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")
def test_cuda_tensors_are_staged_through_host_memory_and_written_back():
    if _tensors._core_takes_devices():
        pytest.skip("the core takes device arrays, so nothing is staged")
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    b = _tensors.bridge(t, "test")
    assert isinstance(b.array, np.ndarray) and b.staged
    b.array[:] = 7
    assert b.written() is t and torch.equal(t.cpu(), torch.full((6,), 7.0))


def _fake_cupy_for_torch_streams(monkeypatch, cupy_14, made, delay=0.0):
    """A CuPy with only what _tensors._cupy_stream calls, noting in `made`
    each stream it wraps and the device current then; torch's current
    stream is one fake stream."""
    import time
    import types

    from coordinator import gpu

    current = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    def from_external(stream):
        time.sleep(delay)  # (CuPy lets go of the interpreter lock in its calls)
        made.append(("from_external", current[-1] if current else None))
        return object()

    def external(ptr, device):
        made.append(("ExternalStream", device))
        return object()

    stream_class = types.SimpleNamespace(**({"from_external": from_external} if cupy_14 else {}))
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device, Stream=stream_class,
                                                          ExternalStream=external))

    class TorchStream:
        cuda_stream = 0x1234

        def __cuda_stream__(self):
            return (0, self.cuda_stream)

    monkeypatch.setitem(gpu._modules, "cupy", cp)
    monkeypatch.setattr(_tensors, "_raw_stream", lambda device: 0x1234)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: TorchStream())
    monkeypatch.setattr(_tensors, "_cupy_streams", {})


@pytest.mark.parametrize("cupy_14", [True, False])
def test_torchs_stream_is_wrapped_for_cupy_on_its_own_device(monkeypatch, cupy_14):
    """CuPy 14's Stream.from_external takes the stream's device from the
    current one: it is made with the tensor's device current (a stream
    wrapped for another device would make `with stream` raise there).
    Older CuPy: ExternalStream, told the device. Once per torch stream."""
    made = []
    _fake_cupy_for_torch_streams(monkeypatch, cupy_14, made)
    first = _tensors._cupy_stream(1)
    assert _tensors._cupy_stream(1) is first
    assert made == [("from_external", 1) if cupy_14 else ("ExternalStream", 1)]


def test_threads_meeting_a_new_torch_stream_wrap_it_once(monkeypatch):
    """CuPy 14's Stream.from_external returns a Stream whose __del__ destroys
    the CUDA stream it wraps: a second wrapper made by a thread that met the
    same torch stream at the same time, then dropped, would destroy torch's
    stream. One wrapper per stream, kept."""
    import threading

    made = []
    _fake_cupy_for_torch_streams(monkeypatch, True, made, delay=0.05)
    got = []
    threads = [threading.Thread(target=lambda: got.append(_tensors._cupy_stream(0)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == 4 and all(g is got[0] for g in got), (made, got)
    assert list(_tensors._cupy_streams.values()) == [got[0]]


def test_state_handlers_take_horovods_parameter_names():
    from frontends.torch import elastic

    for cls, name in ((elastic.ModelStateHandler, "model"),
                      (elastic.OptimizerStateHandler, "optimizer"),
                      (elastic.SamplerStateHandler, "sampler")):
        assert list(inspect.signature(cls.__init__).parameters)[1:] == [name], cls
