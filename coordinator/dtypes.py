"""The data types the coordinator moves, and how each maps to the wire.

One table, keyed by NumPy dtype: its wire enum and whether it can be reduced.
How a backend reduces each dtype (MPI reduces bfloat16 through a native
kernel or in float32) is the backend's policy (ops/mpi_reduce.py).

bfloat16 comes from the ml_dtypes package, imported on first need, not with
the core: ml_dtypes 0.7 takes 1.1 s of CPU to import under NumPy 2.4 (its
ufunc loops are registered one by one, each compared with the ones before).
A bfloat16 array can only exist once ml_dtypes is imported, so the tables
learn the dtype when one is first looked up (`BY_DTYPE`, `BY_WIRE`,
`info_for`), when `bfloat16()` or `BFLOAT16` is asked for, or at import
where ml_dtypes is already loaded (TensorFlow loads it). Tables elsewhere
that hold bfloat16 (the native kernels' kinds, MPI's reduce-as policy)
register with `on_bfloat16`.
"""

import importlib.util
import os
import sys
import threading

import numpy as np

from coordinator.wire import pb

BFLOAT16_NAME = "bfloat16"


class DTypeInfo:
    __slots__ = ("dtype", "wire", "name", "reducible")

    def __init__(self, dtype, wire, reducible=True):
        self.dtype = np.dtype(dtype)
        self.wire = wire
        self.name = self.dtype.name
        self.reducible = reducible


class _ByDtype(dict):
    """DTypeInfo by NumPy dtype; a bfloat16 key loads bfloat16 first."""

    def __missing__(self, key):
        if is_bfloat16(key):  # (loaded by the check)
            return dict.__getitem__(self, key)
        raise KeyError(key)


class _ByWire(dict):
    """DTypeInfo by wire enum; pb.BFLOAT16 loads bfloat16 first."""

    def __missing__(self, key):
        if key == pb.BFLOAT16 and bfloat16() is not None:
            return dict.__getitem__(self, key)
        raise KeyError(key)


_INFOS = [
    DTypeInfo(np.uint8, pb.UINT8),
    DTypeInfo(np.uint16, pb.UINT16),
    DTypeInfo(np.int8, pb.INT8),
    DTypeInfo(np.int16, pb.INT16),
    DTypeInfo(np.int32, pb.INT32),
    DTypeInfo(np.int64, pb.INT64),
    DTypeInfo(np.float16, pb.FLOAT16),
    DTypeInfo(np.float32, pb.FLOAT32),
    DTypeInfo(np.float64, pb.FLOAT64),
    DTypeInfo(np.bool_, pb.BOOL, reducible=False),
]

BY_DTYPE = _ByDtype((info.dtype, info) for info in _INFOS)
BY_WIRE = _ByWire((info.wire, info) for info in _INFOS)

# Whether bfloat16 can be had, without importing it (a path lookup).
BFLOAT16_AVAILABLE = importlib.util.find_spec("ml_dtypes") is not None

SUPPORTED_NAMES = ", ".join([info.name for info in _INFOS]
                            + ([BFLOAT16_NAME] if BFLOAT16_AVAILABLE else []))

_bf16 = None         # the dtype once loaded
_bf16_done = False   # set last: loading was tried and every table has it
_bf16_hooks = []
# The frontend's thread and the background thread may ask at once; neither
# may see "no bfloat16" while the other is still importing it.
_bf16_lock = threading.Lock()


def _fresh_lock_in_child():
    # A child forked while another thread of its parent held the lock would
    # wait for it for ever: that thread does not exist in the child.
    global _bf16_lock
    _bf16_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def bfloat16():
    """ml_dtypes' bfloat16 dtype, loaded and registered on first call; None
    where ml_dtypes is not installed."""
    if _bf16_done:
        return _bf16
    with _bf16_lock:
        if not _bf16_done:
            _load_bfloat16()
    return _bf16


def _load_bfloat16():
    global _bf16, _bf16_done
    try:
        import ml_dtypes
    except ImportError:
        _bf16_done = True
        return
    dt = np.dtype(ml_dtypes.bfloat16)
    info = DTypeInfo(dt, pb.BFLOAT16)
    dict.__setitem__(BY_DTYPE, dt, info)
    dict.__setitem__(BY_WIRE, pb.BFLOAT16, info)
    for hook in _bf16_hooks:
        hook(dt)
    _bf16 = dt
    globals()["BFLOAT16"] = dt
    _bf16_done = True


def on_bfloat16(hook):
    """Call hook(dtype) once bfloat16 is loaded (now, if it is)."""
    with _bf16_lock:
        _bf16_hooks.append(hook)
        if _bf16 is not None:
            hook(_bf16)


def is_bfloat16(dtype):
    """Whether a NumPy dtype is bfloat16, without importing ml_dtypes for
    any other dtype (ml_dtypes' dtypes are of kind "V": a cheap first test
    on the per-tensor paths)."""
    if getattr(dtype, "kind", None) != "V" or dtype.name != BFLOAT16_NAME:
        return False
    bf16 = bfloat16()
    return bf16 is not None and dtype == bf16


def __getattr__(name):
    # `dtypes.BFLOAT16`: the dtype (None without ml_dtypes), loaded on first read.
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def info_for(dtype):
    """The DTypeInfo of a NumPy dtype, or None when it is not supported."""
    try:
        return BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        return None


def info_for_wire(wire):
    """The DTypeInfo of a wire enum, or None when it is not supported."""
    try:
        return BY_WIRE[wire]
    except KeyError:
        return None


def wire_name(wire):
    info = info_for_wire(wire)
    return info.name if info is not None else f"dtype#{wire}"


if "ml_dtypes" in sys.modules:  # already paid for (TensorFlow, JAX)
    bfloat16()
