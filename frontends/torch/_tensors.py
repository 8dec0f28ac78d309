"""The bridge between torch tensors and the arrays the core moves.

A contiguous CPU tensor reaches the core as a NumPy view of its own storage
(`Tensor.numpy()` shares memory), so results written through an `output=`
view land in the tensor itself, and arrays the core allocates become tensors
with `torch.from_numpy`, again without a copy. bfloat16, which NumPy lacks,
travels as ml_dtypes.bfloat16: the int16 view of the storage, reinterpreted.

CUDA tensors go to the core as CuPy arrays over the tensor's own memory
(`coordinator.gpu.view` of its data_ptr, cached per pointer, shape and
dtype), without a copy, so in-place results land in the tensor itself;
results come back with `torch.from_dlpack`, again without a copy. bfloat16
(which CuPy lacks) travels as the tensor's int16 view marked
`coordinator.gpu.bfloat16`, bool as its uint8 view. Each submission and
synchronize names torch's current stream as the caller's stream
(`on_torch_stream`), so the core records the tensors' ready point where
torch queued the work that wrote them, and synchronize orders torch's
stream after the result. Neither makes a CUDA call on the submitting
thread: in a gradient hook each one lets go of the interpreter lock and has
to win it back from the background thread (coordinator/gpu.py ReadyPoint).
Without CuPy, CUDA tensors are staged through a host copy instead (the
result is copied back).

A tensor that is not contiguous (channels_last, a transposed or sliced view)
goes to the core as a contiguous copy, and an in-place result is copied back
into it, so models in channels_last train as they are (Horovod refuses
them: horovod/horovod#3491). Only an in-place target whose elements share
memory (an expanded tensor) is refused: a result cannot be written into it.
"""

import contextlib
import functools
import threading

import numpy as np
import torch

from coordinator import dtypes as core_dtypes
from coordinator import gpu as core_gpu

# torch dtypes the core can move; reductions additionally exclude bool.
# bfloat16 needs ml_dtypes, imported when the first bfloat16 tensor comes.
SUPPORTED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.float32, torch.float64, torch.bool}
if core_dtypes.BFLOAT16_AVAILABLE:
    SUPPORTED.add(torch.bfloat16)
REDUCIBLE = SUPPORTED - {torch.bool}


def type_name(tensor):
    """Horovod's spelling of a tensor's type: torch.FloatTensor, torch.cuda.HalfTensor."""
    try:
        return tensor.type()
    except (TypeError, RuntimeError):
        return f"{tensor.device.type} {tensor.dtype}"


@functools.lru_cache(maxsize=None)
def _core_takes_devices():
    """True when the core can take CUDA tensors as they are (CuPy is installed)."""
    return core_gpu.cupy_installed()


_cupy_streams = {}  # (device, torch stream handle) -> the CuPy stream over it
# CuPy 14's Stream.from_external makes a Stream whose __del__ destroys the
# CUDA stream it wraps (here torch's): each wrapper is made once, under this
# lock (two threads may meet a new stream at once, and CuPy's calls let go
# of the interpreter lock), and kept in _cupy_streams for the life of the
# process.
_streams_lock = threading.Lock()

# torch's current stream as a raw handle: no torch.cuda.Stream object made.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# For CPU tensors, on every submission and synchronize: a generator-based
# context manager costs 0.9 us a use, this one 0.2.
_NOTHING = contextlib.nullcontext()


def on_torch_stream(device):
    """Names torch's current stream on `device` as the caller's stream for
    the core (nothing for the CPU, device -1)."""
    return _NOTHING if device < 0 else core_gpu.caller_stream(device, _cupy_stream(device))


def _cupy_stream(device):
    """torch's current stream on `device`, as a CuPy stream (made once per stream)."""
    handle = (_raw_stream(device) if _raw_stream is not None
              else torch.cuda.current_stream(device).cuda_stream)
    wrapped = _cupy_streams.get((device, handle))
    if wrapped is None:
        with _streams_lock:
            wrapped = _cupy_streams.get((device, handle))
            if wrapped is None:
                wrapped = _cupy_streams[(device, handle)] = _wrap_stream(device)
    return wrapped


def _wrap_stream(device):
    cp = core_gpu.cupy()
    stream = torch.cuda.current_stream(device)
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        with cp.cuda.Device(device):  # (it takes the current device for the stream's)
            return cp.cuda.Stream.from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream, device)  # CuPy before 14


class Bridged:
    """One tensor as the core sees it: `array` goes to the core, `tensor()`
    returns the torch result once the core has written or returned it."""

    __slots__ = ("tensor_in", "array", "device", "staged")

    def __init__(self, tensor_in, array, device, staged=None):
        self.tensor_in = tensor_in
        self.array = array
        self.device = device
        self.staged = staged  # the copy of tensor_in that `array` views, if any

    def written(self):
        """The tensor after the core wrote `array` in place."""
        if self.staged is not None:
            self.tensor_in.detach().copy_(self.staged)  # (a parameter, too)
        return self.tensor_in


def check(tensor, what, reducible=False):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    allowed = REDUCIBLE if reducible else SUPPORTED
    if tensor.dtype not in allowed:
        raise ValueError(f"Tensor type {type_name(tensor)} is not supported. ({what}; "
                         f"supported: {', '.join(sorted(str(d)[6:] for d in allowed))})")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported here; use "
                         "sparse_allreduce_async or sparse_as_dense=True")
    if tensor.dtype is torch.bfloat16 and core_dtypes.bfloat16() is None:
        # (installed, but it failed to import: else it is not in SUPPORTED)
        raise ValueError(f"{what}: bfloat16 tensors need the ml_dtypes package, which "
                         "failed to import")


def _check_target(tensor, what):
    """An in-place result can be copied back into `tensor` (not contiguous)."""
    if not _distinct_elements(tensor):
        raise ValueError(f"An in-place result cannot be written into a tensor whose elements "
                         f"share memory. ({what}: strides {tuple(tensor.stride())} for shape "
                         f"{tuple(tensor.shape)}, as an expanded tensor's; pass "
                         "tensor.contiguous() and read the result from it)")


def _distinct_elements(tensor):
    """True when no two elements of `tensor` share memory: its dimensions,
    ordered by stride, each step over all the previous ones."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape)
                               if sz > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _host_array(tensor):
    """A NumPy view of a contiguous CPU tensor (no copy)."""
    # detach() only when needed: it is a call into torch that gives up the GIL.
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(core_dtypes.bfloat16())
    return t.numpy()


def _from_array(array):
    """A tensor over a NumPy array the core allocated (no copy)."""
    if core_dtypes.is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# What CuPy views each torch dtype as (it has no bfloat16 and stores bool as a byte).
_CUPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                torch.float64: np.float64, torch.uint8: np.uint8, torch.int8: np.int8,
                torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
                torch.bool: np.uint8, torch.bfloat16: np.int16}

# CuPy views of CUDA tensors, by (data_ptr, shape, dtype): a gradient's
# memory is the same step after step. A view does not keep its memory
# alive: the tensor it came from does, for as long as the core uses it
# (Bridged holds it), and a view of freed memory that is reused for a
# tensor of the same shape and dtype is a right view of that tensor.
_views = {}
_MAX_VIEWS = 8192


def _device_array(tensor):
    """A CuPy view of a contiguous CUDA tensor (no copy, no call into CUDA)."""
    dtype = _CUPY_DTYPES.get(tensor.dtype)
    if dtype is None or tensor.numel() == 0:
        return _dlpack_array(tensor)
    key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
    array = _views.get(key)
    if array is None:
        if len(_views) >= _MAX_VIEWS:
            _views.clear()
        array = _views[key] = core_gpu.view(key[0], tuple(tensor.shape), dtype,
                                            tensor.get_device())
    return core_gpu.bfloat16(array) if tensor.dtype is torch.bfloat16 else array


def _dlpack_array(tensor):
    """A CuPy view of a contiguous CUDA tensor through DLPack (no copy)."""
    cp = core_gpu.cupy()
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bfloat16:
        return core_gpu.bfloat16(cp.from_dlpack(t.view(torch.int16)))
    if t.dtype == torch.bool:
        return cp.from_dlpack(t.view(torch.uint8))
    return cp.from_dlpack(t)


def bridge(tensor, what, reducible=False, inplace=False):
    """`tensor` as an array for the core; checks Horovod's preconditions
    (`inplace`: the core writes its result there)."""
    check(tensor, what, reducible)
    tensor_in, staged = tensor, None
    if not tensor.is_contiguous():  # the core works on a contiguous copy
        if inplace:
            _check_target(tensor, what)
        tensor = staged = tensor.detach().contiguous()
    if tensor.is_cpu:  # (tensor.device.type costs 0.3 us, is_cpu 0.07)
        return Bridged(tensor_in, _host_array(tensor), -1, staged)
    if tensor.is_cuda and _core_takes_devices():
        return Bridged(tensor_in, _device_array(tensor), tensor.get_device(), staged)
    # Staging: the core works on a host copy; results are copied back.
    host = tensor.detach().cpu()
    return Bridged(tensor_in, _host_array(host), -1, host)


def empty_like(tensor):
    """A new contiguous tensor for an output the core writes in place."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def to_tensor(array, like):
    """A torch tensor over an array the core returned (no copy), with `like`'s
    dtype, on `like`'s device."""
    if isinstance(array, np.ndarray):
        out = _from_array(array)
    else:
        out = torch.from_dlpack(array)
        if out.dtype != like.dtype and out.element_size() == like.element_size():
            out = out.view(like.dtype)  # bfloat16 came back as int16, bool as uint8
    if out.device != like.device:
        out = out.to(like.device)
    return out
