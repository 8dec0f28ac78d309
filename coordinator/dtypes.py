"""The data types the coordinator moves, and how each maps to the wire and MPI.

One table, keyed by NumPy dtype: its wire enum, whether it can be reduced, and
the dtype a reduction runs in (bfloat16 is reduced in float32 because MPI has
no bfloat16 type).
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
    __slots__ = ("dtype", "wire", "name", "reducible", "reduce_dtype")

    def __init__(self, dtype, wire, reducible=True, reduce_dtype=None):
        self.dtype = np.dtype(dtype)
        self.wire = wire
        self.name = self.dtype.name
        self.reducible = reducible
        self.reduce_dtype = np.dtype(reduce_dtype) if reduce_dtype is not None else self.dtype


_INFOS = [
    DTypeInfo(np.uint8, pb.UINT8),
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
    _INFOS.append(DTypeInfo(BFLOAT16, pb.BFLOAT16, reduce_dtype=np.float32))

BY_DTYPE = {info.dtype: info for info in _INFOS}
BY_WIRE = {info.wire: info for info in _INFOS}

SUPPORTED_NAMES = ", ".join(info.name for info in _INFOS)


def info_for(dtype):
    """The DTypeInfo of a NumPy dtype, or None when it is not supported."""
    return BY_DTYPE.get(np.dtype(dtype))


def wire_name(wire):
    info = BY_WIRE.get(wire)
    return info.name if info is not None else f"dtype#{wire}"


def mpi_datatype(dtype):
    """The MPI datatype of a reducible NumPy dtype."""
    from mpi4py import MPI

    return MPI._typedict[np.dtype(dtype).char]
