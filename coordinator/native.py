"""Native kernels and their NumPy references, and how reductions are chosen.

`native/halfops.c` reduces and scales float16 and bfloat16 buffers (each
element widened to float32, combined, rounded back to nearest-even). With it,
16-bit tensors travel as 16-bit data and MPI reduces them through a
user-defined operation; Open MPI's own float16 reduction is about five times
slower than its float32 one, and it has no bfloat16. Without the extension
(no C compiler at install time), the NumPy reference below does the same
arithmetic, and 16-bit tensors are reduced in float32 instead, which is
faster than a Python callback.

`reduction(info, reduce_op)` tells a backend which dtype to reduce in and
which MPI datatype and op to use.
"""

import numpy as np

from coordinator import dtypes
from coordinator.wire import pb

try:
    from coordinator import _native_halfops as halfops
except ImportError:  # built without a C compiler
    halfops = None

OP_CODES = {pb.SUM: 0, pb.AVERAGE: 0, pb.MIN: 1, pb.MAX: 2, pb.PRODUCT: 3}
KINDS = {np.dtype(np.float16): 0}
if dtypes.BFLOAT16 is not None:
    KINDS[dtypes.BFLOAT16] = 1
_KIND_DTYPES = {code: dt for dt, code in KINDS.items()}
_COMBINE = {0: np.add, 1: np.minimum, 2: np.maximum, 3: np.multiply}


# ---- NumPy references -----------------------------------------------------------
def reduce_reference(op, kind, invec, inoutvec):
    """inoutvec = invec (op) inoutvec, computed in float32, rounded back."""
    dt = _KIND_DTYPES[kind]
    a = np.frombuffer(invec, dt).astype(np.float32)
    out = np.frombuffer(inoutvec, dt)
    with np.errstate(over="ignore", invalid="ignore"):
        out[...] = _COMBINE[op](a, out.astype(np.float32)).astype(dt)


def scale_reference(kind, buf, factor):
    dt = _KIND_DTYPES[kind]
    arr = np.frombuffer(buf, dt)
    with np.errstate(over="ignore", invalid="ignore"):
        arr[...] = (arr.astype(np.float32) * np.float32(factor)).astype(dt)


# ---- what backends call -----------------------------------------------------------
def scale16(arr, factor):
    """In-place scaling of a float16/bfloat16 array, in one pass when native."""
    kind = KINDS[arr.dtype]
    if halfops is not None:
        halfops.scale(kind, arr, factor)
    else:
        scale_reference(kind, arr, factor)


_user_ops = {}


def _user_op(op_code, kind):
    from mpi4py import MPI

    key = (op_code, kind)
    op = _user_ops.get(key)
    if op is None:
        reduce = halfops.reduce

        def fn(invec, inoutvec, datatype):
            reduce(op_code, kind, invec, inoutvec)

        op = _user_ops[key] = MPI.Op.Create(fn, commute=True)
    return op


def reduction(info, reduce_op):
    """(dtype to reduce in, MPI datatype, MPI op) for a tensor dtype and op."""
    from mpi4py import MPI

    if info.dtype in KINDS and halfops is not None and reduce_op in OP_CODES:
        return info.dtype, MPI.UINT16_T, _user_op(OP_CODES[reduce_op], KINDS[info.dtype])
    rdtype = info.reduce_dtype
    if info.dtype == np.float16:  # no native kernel: float32 beats MPI's float16
        rdtype = np.dtype(np.float32)
    mpi_op = {pb.SUM: MPI.SUM, pb.AVERAGE: MPI.SUM, pb.MIN: MPI.MIN, pb.MAX: MPI.MAX,
              pb.PRODUCT: MPI.PROD}[reduce_op]
    return rdtype, dtypes.mpi_datatype(rdtype), mpi_op
