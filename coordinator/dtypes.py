"""The data types the coordinator moves, and how each maps to the wire.

One table, keyed by NumPy dtype: its wire enum and whether it can be reduced.
How a backend reduces each dtype (MPI reduces bfloat16 through a native
kernel or in float32) is the backend's policy (ops/mpi_reduce.py).
"""

import numpy as np

from coordinator.wire import pb

try:  # bfloat16 is optional
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes ships with TensorFlow and JAX
    ml_dtypes = None
    BFLOAT16 = None


class DTypeInfo:
    __slots__ = ("dtype", "wire", "name", "reducible")

    def __init__(self, dtype, wire, reducible=True):
        self.dtype = np.dtype(dtype)
        self.wire = wire
        self.name = self.dtype.name
        self.reducible = reducible


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
if BFLOAT16 is not None:
    _INFOS.append(DTypeInfo(BFLOAT16, pb.BFLOAT16))

BY_DTYPE = {info.dtype: info for info in _INFOS}
BY_WIRE = {info.wire: info for info in _INFOS}

SUPPORTED_NAMES = ", ".join(info.name for info in _INFOS)


def info_for(dtype):
    """The DTypeInfo of a NumPy dtype, or None when it is not supported."""
    return BY_DTYPE.get(np.dtype(dtype))


def wire_name(wire):
    info = BY_WIRE.get(wire)
    return info.name if info is not None else f"dtype#{wire}"
