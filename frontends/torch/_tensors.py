"""The bridge between torch tensors and the arrays the core moves.

A contiguous CPU tensor reaches the core as a NumPy view of its own storage
(`Tensor.numpy()` shares memory), so results written through an `output=`
view land in the tensor itself, and arrays the core allocates become tensors
with `torch.from_numpy`, again without a copy. bfloat16, which NumPy lacks,
travels as ml_dtypes.bfloat16: the int16 view of the storage, reinterpreted.

CUDA tensors go to the core as CuPy arrays over DLPack (`cupy.from_dlpack`),
without a copy, so in-place results land in the tensor itself; results come
back with `torch.from_dlpack`, again without a copy. bfloat16 (which CuPy
lacks) travels as the tensor's int16 view marked `coordinator.gpu.bfloat16`,
bool as its uint8 view. Around each submission torch's current stream is
made CuPy's current stream (`on_torch_stream`), so the core records the
tensor's ready event where torch queued the work that wrote it, and
synchronize orders torch's stream after the result. Without CuPy, CUDA
tensors are staged through a host copy instead (the result is copied back).
"""

import contextlib
import functools

import numpy as np
import torch

from coordinator import gpu as core_gpu

try:
    import ml_dtypes

    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes comes with the core's deps
    _BFLOAT16 = None

# torch dtypes the core can move; reductions additionally exclude bool.
SUPPORTED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.float32, torch.float64, torch.bool}
if _BFLOAT16 is not None:
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


# For CPU tensors, on every submission and synchronize: a generator-based
# context manager costs 0.9 us a use, this one 0.2.
_NOTHING = contextlib.nullcontext()


def on_torch_stream(device):
    """Makes torch's current stream on `device` CuPy's current stream too
    (nothing for the CPU, device -1)."""
    return _NOTHING if device < 0 else _on_device_stream(device)


@contextlib.contextmanager
def _on_device_stream(device):
    cp = core_gpu.cupy()
    stream = torch.cuda.current_stream(device)
    key = (device, stream.cuda_stream)
    wrapped = _cupy_streams.get(key)
    if wrapped is None:
        if hasattr(cp.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
            wrapped = cp.cuda.Stream.from_external(stream)
        else:  # CuPy before 14
            wrapped = cp.cuda.ExternalStream(stream.cuda_stream, device)
        _cupy_streams[key] = wrapped
    with cp.cuda.Device(device), wrapped:
        yield


class Bridged:
    """One tensor as the core sees it: `array` goes to the core, `tensor()`
    returns the torch result once the core has written or returned it."""

    __slots__ = ("tensor_in", "array", "device", "staged")

    def __init__(self, tensor_in, array, device, staged):
        self.tensor_in = tensor_in
        self.array = array
        self.device = device
        self.staged = staged

    def written(self):
        """The tensor after the core wrote `array` in place."""
        if self.staged:
            self.tensor_in.copy_(_from_array(self.array))
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
    if not tensor.is_contiguous():
        raise ValueError(f"Tensor is required to be contiguous. ({what}: call .contiguous() "
                         "first)")


def _host_array(tensor):
    """A NumPy view of a contiguous CPU tensor (no copy)."""
    # detach() only when needed: it is a call into torch that gives up the GIL.
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BFLOAT16)
    return t.numpy()


def _from_array(array):
    """A tensor over a NumPy array the core allocated (no copy)."""
    if array.dtype == _BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _device_array(tensor):
    """A CuPy view of a contiguous CUDA tensor (no copy)."""
    cp = core_gpu.cupy()
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype == torch.bfloat16:
        return core_gpu.bfloat16(cp.from_dlpack(t.view(torch.int16)))
    if t.dtype == torch.bool:
        return cp.from_dlpack(t.view(torch.uint8))
    return cp.from_dlpack(t)


def bridge(tensor, what, reducible=False):
    """`tensor` as an array for the core; checks Horovod's preconditions."""
    check(tensor, what, reducible)
    if tensor.is_cpu:  # (tensor.device.type costs 0.3 us, is_cpu 0.07)
        return Bridged(tensor, _host_array(tensor), -1, False)
    if tensor.is_cuda and _core_takes_devices():
        return Bridged(tensor, _device_array(tensor), tensor.device.index, False)
    # Staging: the core works on a host copy; results are copied back.
    return Bridged(tensor, _host_array(tensor.detach().cpu()), -1, True)


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
