"""Native kernels and their NumPy references.

`native/halfops.c` reduces and scales float16 and bfloat16 buffers (each
element widened to float32, combined, rounded back to nearest-even). With it,
16-bit tensors travel as 16-bit data and MPI reduces them through a
user-defined operation; Open MPI's own float16 reduction is about five times
slower than its float32 one, and it has no bfloat16. Without the extension
(no C compiler at install time), the NumPy reference below does the same
arithmetic, and 16-bit tensors are reduced in float32 instead, which is
faster than a Python callback.

`native/minmax.c` reduces float32 and float64 Min and Max so that NaN
propagates, as np.minimum and np.maximum do: Open MPI's MPI_MIN and MPI_MAX
compare with `<` and `>` and keep or drop a NaN depending on the order they
combine the ranks in. The result is the same whatever that order: a NaN in
either operand gives the default quiet NaN, and -0.0 counts below +0.0 (IEEE
754-2019 minimum/maximum). The 16-bit kernels follow the same rule. Without
the extension, the NumPy reference runs in the same MPI user-defined
operation; integer Min and Max keep MPI's built-in ops.

How the MPI backend uses these kernels (as MPI user-defined operations) is
its own matter: coordinator/ops/mpi_reduce.py. The third kernel,
`native/fusecopy.c` (one call to fill or empty a fusion buffer), has its
NumPy reference beside its use, in coordinator/fusion.py.
"""

from functools import partial

import numpy as np

from coordinator import dtypes
from coordinator.wire import pb

try:
    from coordinator import _native_halfops as halfops
except ImportError:  # built without a C compiler
    halfops = None
try:
    from coordinator import _native_minmax as minmax
except ImportError:  # built without a C compiler
    minmax = None

OP_CODES = {pb.SUM: 0, pb.AVERAGE: 0, pb.MIN: 1, pb.MAX: 2, pb.PRODUCT: 3}
KINDS = {np.dtype(np.float16): 0}  # bfloat16 (1) joins once it is loaded
_KIND_DTYPES = {0: np.dtype(np.float16)}


def _add_bfloat16(dt):
    KINDS[dt] = 1
    _KIND_DTYPES[1] = dt


dtypes.on_bfloat16(_add_bfloat16)

MINMAX_CODES = {pb.MIN: 1, pb.MAX: 2}
MINMAX_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_MINMAX_DTYPES = {code: dt for dt, code in MINMAX_KINDS.items()}
_BITS = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


# ---- NumPy references -----------------------------------------------------------
def _min_or_max(op, a, b, out=None):
    """np.minimum / np.maximum (op 1 / 2) made independent of operand order:
    NaN gives the default quiet NaN, and -0.0 counts below +0.0. For ordered
    operands both argument orders give the same value except for a pair of
    zeros, where the bits OR to -0.0 (min) and AND to +0.0 (max). `out` may
    be `b`."""
    ufunc, combine = (np.minimum, np.bitwise_or) if op == 1 else (np.maximum, np.bitwise_and)
    swapped = ufunc(b, a)
    out = ufunc(a, b, out=out)
    nan = np.isnan(out)
    bits = _BITS[out.dtype]
    combine(out.view(bits), swapped.view(bits), out=out.view(bits))
    np.copyto(out, np.nan, where=nan)
    return out


_COMBINE = {0: np.add, 1: partial(_min_or_max, 1), 2: partial(_min_or_max, 2),
            3: np.multiply}


def reduce_reference(op, kind, invec, inoutvec):
    """inoutvec = invec (op) inoutvec, computed in float32, rounded back."""
    dt = _KIND_DTYPES[kind]
    a = np.frombuffer(invec, dt).astype(np.float32)
    out = np.frombuffer(inoutvec, dt)
    with np.errstate(over="ignore", invalid="ignore"):
        out[...] = _COMBINE[op](a, out.astype(np.float32)).astype(dt)


def minmax_reference(op, kind, invec, inoutvec):
    """inoutvec = min (op 1) or max (op 2) of invec and inoutvec, float32
    (kind 0) or float64 (kind 1), as native/minmax.c computes it."""
    dt = _MINMAX_DTYPES[kind]
    out = np.frombuffer(inoutvec, dt)
    with np.errstate(invalid="ignore"):
        _min_or_max(op, np.frombuffer(invec, dt), out, out=out)


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
