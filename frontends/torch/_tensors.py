"""The bridge between torch tensors and the arrays the core moves.

A contiguous CPU tensor reaches the core as a NumPy view of its own storage
(`Tensor.numpy()` shares memory), so results written through an `output=`
view land in the tensor itself, and arrays the core allocates become tensors
with `torch.from_numpy`, again without a copy. bfloat16, which NumPy lacks,
travels as ml_dtypes.bfloat16: the int16 view of the storage, reinterpreted.

GPU tensors: the core's MPI backend works on host memory and its submit
functions take no device yet, so a CUDA tensor is staged through a host copy
(the result is copied back to the tensor's device). When the core accepts
device arrays (`device=` on its *_async functions), `_core_takes_devices()`
turns true and CUDA tensors go to it as CuPy arrays over DLPack, zero-copy,
with their device id. Neither path runs on this CPU-only build.
"""

import functools
import inspect

import numpy as np
import torch

import coordinator as core

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
    return "device" in inspect.signature(core.allreduce_async).parameters


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


def bridge(tensor, what, reducible=False):
    """`tensor` as an array for the core; checks Horovod's preconditions."""
    check(tensor, what, reducible)
    if tensor.device.type == "cpu":
        return Bridged(tensor, _host_array(tensor), -1, False)
    if tensor.is_cuda and _core_takes_devices():  # pragma: no cover - needs a GPU
        import cupy

        return Bridged(tensor, cupy.from_dlpack(tensor.detach()), tensor.device.index, False)
    # Staging: the core works on a host copy; results are copied back.
    return Bridged(tensor, _host_array(tensor.detach().cpu()), -1, True)


def empty_like(tensor):
    """A new contiguous tensor for an output the core writes in place."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def to_tensor(array, like):
    """A torch tensor over an array the core returned, on `like`'s device."""
    out = _from_array(np.asarray(array)) if isinstance(array, np.ndarray) else \
        torch.from_dlpack(array)
    if out.device != like.device:
        out = out.to(like.device)
    return out
