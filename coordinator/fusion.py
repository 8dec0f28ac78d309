"""Fusion buffers: many small tensors packed into one buffer per collective.

`FusionBuffers` keeps one reusable byte buffer per slot ("reduce", "send",
"recv"), grown on demand and never larger than the biggest fused response,
which the controller bounds by the fusion threshold. Steady-state training
therefore allocates nothing here after the first step.

`pack` and `unpack` copy tensors in and out, folding the pre- and post-scale
factors (and any dtype conversion, e.g. bfloat16 reduced as float32) into the
same pass. They are the NumPy reference that native kernels must match.
"""

import numpy as np

from coordinator import native

_EMPTY = np.empty(0, dtype=np.uint8)


class FusionBuffers:
    def __init__(self, limit=None):
        self._slots = {}
        # Buffers larger than this (a single tensor bigger than the fusion
        # threshold that still needs a conversion) are not kept.
        self.limit = limit

    def get(self, slot, count, dtype):
        """A 1-D view of `count` elements of `dtype` in buffer `slot`."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if self.limit is not None and nbytes > self.limit:
            return np.empty(count, dtype)
        buf = self._slots.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._slots[slot] = buf
        return buf[:nbytes].view(dtype)

    def nbytes(self):
        return sum(b.nbytes for b in self._slots.values())

    def clear(self):
        self._slots.clear()


def copy_scaled(src, dst, scale):
    """dst[...] = src * scale, in dst's dtype; src and dst are 1-D, same size."""
    if scale == 1.0:
        np.copyto(dst, src, casting="unsafe")
    elif src.dtype == dst.dtype and dst.dtype.kind == "f" and dst.dtype.itemsize >= 4:
        np.multiply(src, dst.dtype.type(scale), out=dst)
    else:
        np.copyto(dst, src, casting="unsafe")
        scale_inplace(dst, scale)


def scale_inplace(arr, scale):
    if scale == 1.0:
        return
    if arr.dtype.kind == "f" and arr.dtype.itemsize >= 4:
        np.multiply(arr, arr.dtype.type(scale), out=arr)
    elif arr.dtype in native.KINDS:  # float16, bfloat16: one native pass
        native.scale16(arr, scale)
    else:  # integers: scale in float64, round toward zero
        np.copyto(arr, arr * float(scale), casting="unsafe")


def pack(sources, buf, scale=1.0):
    """Copy each flat source into consecutive segments of `buf`."""
    offset = 0
    for src in sources:
        n = src.size
        copy_scaled(src.reshape(-1), buf[offset:offset + n], scale)
        offset += n
    return offset


def unpack(buf, outputs, scale=1.0):
    """Copy consecutive segments of `buf` into each output (any shape)."""
    offset = 0
    for out in outputs:
        n = out.size
        copy_scaled(buf[offset:offset + n], out.reshape(-1), scale)
        offset += n
    return offset


def as_bytes(arr):
    """A flat uint8 view of a C-contiguous array."""
    if arr.size == 0:
        return _EMPTY
    return arr.reshape(-1).view(np.uint8)
