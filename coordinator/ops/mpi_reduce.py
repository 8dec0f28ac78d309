"""The MPI backend's reduction policy: for a tensor's dtype and reduce op,
which dtype the reduction runs in and which MPI datatype and op carry it.

- float16 and bfloat16 travel as 16-bit data and are reduced by the native
  kernels (coordinator/native.py) inside an MPI user-defined op: Open MPI's
  own float16 reduction is about five times slower than its float32 one,
  and MPI has no bfloat16 type. Without the kernels they are reduced in
  float32 (faster than a Python callback).
- float32 and float64 Min and Max go through a user-defined op that
  propagates NaN from any rank (Open MPI's MPI_MIN and MPI_MAX compare with
  `<` and drop it, depending on the order they combine the ranks in).
- 8- and 16-bit integer Sum, Average and Product go through a user-defined
  op that wraps as their arithmetic does (NumPy's add and multiply). Open
  MPI 5's AVX reduction module adds them with saturating instructions on
  vectors of 16 elements or more (int8 of 289 elements summed to 127 where
  8-bit arithmetic, torch, TensorFlow and shorter tensors give -56); its
  scalar path wraps. (Summing them in int32 instead would also wrap, but
  needs four times the memory: 8.6 GB for a 2 G-element int8 tensor.) Min
  and Max use the built-in ops.
- Everything else uses MPI's built-in ops.

Other backends (NCCL) have their own policy: it reduces float16 and
bfloat16 natively.
"""

import numpy as np
from mpi4py import MPI

from coordinator import dtypes, native
from coordinator.wire import pb

# Reduced in another dtype when no native kernel handles them.
_REDUCE_AS = {np.dtype(np.float16): np.dtype(np.float32)}
dtypes.on_bfloat16(lambda dt: _REDUCE_AS.__setitem__(dt, np.dtype(np.float32)))

# Summed and multiplied by a user-defined op that wraps (see the module doc).
_WRAPPING = {np.dtype(t): code for code, t in enumerate((np.int8, np.uint8, np.int16,
                                                        np.uint16))}
_WRAPPING_DTYPES = {code: dt for dt, code in _WRAPPING.items()}
_WRAPPING_OPS = {pb.SUM: 0, pb.AVERAGE: 0, pb.PRODUCT: 1}


def _wrapping_reduce(op_code, kind, invec, inoutvec):
    """inoutvec = invec + inoutvec (op 0) or invec * inoutvec (op 1), wrapping."""
    dt = _WRAPPING_DTYPES[kind]
    out = np.frombuffer(inoutvec, dt)
    (np.add if op_code == 0 else np.multiply)(np.frombuffer(invec, dt), out, out=out)

_BUILTIN = {pb.SUM: MPI.SUM, pb.AVERAGE: MPI.SUM, pb.MIN: MPI.MIN, pb.MAX: MPI.MAX,
            pb.PRODUCT: MPI.PROD}

_user_ops = {}


def mpi_datatype(dtype):
    """The MPI datatype of a reducible NumPy dtype."""
    return MPI._typedict[np.dtype(dtype).char]


def _user_op(reduce, op_code, kind):
    """One MPI user-defined op per (kernel, op, kind), created on first use.
    mpi4py calls `fn` once per chunk MPI reduces (see README, Native kernels,
    for what that costs against a built-in op)."""
    key = (reduce, op_code, kind)
    op = _user_ops.get(key)
    if op is None:
        def fn(invec, inoutvec, datatype):
            reduce(op_code, kind, invec, inoutvec)

        op = _user_ops[key] = MPI.Op.Create(fn, commute=True)
    return op


def reduction(info, reduce_op):
    """(dtype to reduce in, MPI datatype, MPI op) for a tensor dtype and op."""
    halfops = native.halfops  # read at each call: the benchmark toggles it
    if info.dtype in native.KINDS and halfops is not None and reduce_op in native.OP_CODES:
        return info.dtype, MPI.UINT16_T, _user_op(halfops.reduce, native.OP_CODES[reduce_op],
                                                  native.KINDS[info.dtype])
    if info.dtype in _WRAPPING and reduce_op in _WRAPPING_OPS:
        return info.dtype, mpi_datatype(info.dtype), _user_op(
            _wrapping_reduce, _WRAPPING_OPS[reduce_op], _WRAPPING[info.dtype])
    rdtype = _REDUCE_AS.get(info.dtype, info.dtype)
    if reduce_op in native.MINMAX_CODES and rdtype in native.MINMAX_KINDS:
        reduce = native.minmax.reduce if native.minmax is not None else native.minmax_reference
        return rdtype, mpi_datatype(rdtype), _user_op(
            reduce, native.MINMAX_CODES[reduce_op], native.MINMAX_KINDS[rdtype])
    return rdtype, mpi_datatype(rdtype), _BUILTIN[reduce_op]
