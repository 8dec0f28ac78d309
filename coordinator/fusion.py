"""Fusion buffers: many small tensors packed into one buffer per collective.

`FusionBuffers` keeps one reusable byte buffer per (device, lane, slot): a
lane is a communicator whose operations run one after the other (see
executor.py), so operations of different lanes, in flight side by side,
never share a buffer; slots are "reduce", "send" and "recv". Buffers grow on
demand and never beyond the biggest fused response, which the controller
bounds by the fusion threshold. Steady-state training therefore allocates
nothing here after the first step.

`pack` and `unpack` copy tensors in and out, folding the pre- and post-scale
factors (and any dtype conversion, e.g. bfloat16 reduced as float32) into the
same pass. Plain copies and float32/float64 scaling go through
native/fusecopy.c, one call for all the tensors, where it was built;
`pack_reference` and `unpack_reference` are the NumPy way it must match,
and take the rest (conversions, 16-bit and integer scaling).
"""

import numpy as np

from coordinator import native

try:
    from coordinator import _native_fusecopy as fusecopy
except ImportError:  # built without a C compiler
    fusecopy = None

_EMPTY = np.empty(0, dtype=np.uint8)
_SCALED_KINDS = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}


class FusionBuffers:
    def __init__(self, limit=None):
        self._slots = {}
        # Buffers larger than this (a single tensor bigger than the fusion
        # threshold that still needs a conversion) are not kept.
        self.limit = limit

    def get(self, slot, count, dtype, lane=0, device=-1):
        """A 1-D view of `count` elements of `dtype` in buffer `slot` of
        `lane` on `device` (-1: host memory)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if self.limit is not None and nbytes > self.limit:
            return np.empty(count, dtype)
        key = (device, lane, slot)
        buf = self._slots.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._slots[key] = buf
        return buf[:nbytes].view(dtype)

    def nbytes(self):
        return sum(b.nbytes for b in self._slots.values())

    def clear(self):
        self._slots.clear()


def copy_scaled(src, dst, scale, divisor=1):
    """dst[...] = src * scale / divisor, in dst's dtype; src and dst are 1-D,
    same size."""
    if scale == 1.0 and divisor == 1:
        np.copyto(dst, src, casting="unsafe")
    elif src.dtype == dst.dtype and dst.dtype.kind == "f" and dst.dtype.itemsize >= 4:
        np.multiply(src, dst.dtype.type(scale / divisor), out=dst)
    else:
        np.copyto(dst, src, casting="unsafe")
        scale_inplace(dst, scale, divisor)


def scale_inplace(arr, scale, divisor=1):
    """arr *= scale / divisor. An integer average (no scale) is the exact
    quotient rounded toward zero, at any magnitude; integers with a scale
    are scaled in float64 and rounded toward zero, dividing last, so that
    an average that is a whole number comes out exact (6 * (1/3) would
    truncate to 1; 6 / 3 is 2)."""
    if scale == 1.0 and divisor == 1:
        return
    if arr.dtype.kind == "f" and arr.dtype.itemsize >= 4:
        np.multiply(arr, arr.dtype.type(scale / divisor), out=arr)
    elif arr.dtype in native.KINDS:  # float16, bfloat16: one native pass
        native.scale16(arr, scale / divisor)
    elif scale == 1.0 and arr.dtype.kind in "iu":
        # Floor division, then toward zero (float64 would lose int64's low
        # bits past 2**53).
        rest = arr % divisor
        np.floor_divide(arr, divisor, out=arr)
        if arr.dtype.kind == "i":
            arr += ((rest != 0) & (arr < 0)).astype(arr.dtype)
    else:  # integers
        scaled = arr * float(scale) if scale != 1.0 else arr.astype(np.float64)
        if divisor != 1:
            scaled /= divisor
        np.copyto(arr, scaled, casting="unsafe")


def _native_kind(dtype, plain):
    """fusecopy's kind for a copy of `dtype` elements, plain (no scaling) or
    scaled; None where only NumPy's way does it."""
    if fusecopy is None:
        return None
    return 0 if plain else _SCALED_KINDS.get(dtype)


def pack(sources, buf, scale=1.0):
    """Copy each flat source into consecutive segments of `buf`."""
    if sources and sources[0].dtype == buf.dtype:
        kind = _native_kind(buf.dtype, scale == 1.0)
        if kind is not None:
            done = fusecopy.pack(kind, sources, buf, scale)
            if done is not None:
                return done
    return pack_reference(sources, buf, scale)


def pack_reference(sources, buf, scale=1.0):
    """pack in NumPy: what native/fusecopy.c must match."""
    if scale == 1.0 and len(sources) > 1 and all(s.dtype == buf.dtype for s in sources):
        # One call instead of one per tensor (8 small tensors: 9 us against 14).
        total = sum(s.size for s in sources)
        np.concatenate([s.reshape(-1) for s in sources], out=buf[:total])
        return total
    offset = 0
    for src in sources:
        n = src.size
        copy_scaled(src.reshape(-1), buf[offset:offset + n], scale)
        offset += n
    return offset


def unpack(buf, outputs, scale=1.0, divisor=1):
    """Copy consecutive segments of `buf` into each output (any shape)."""
    if outputs and outputs[0].dtype == buf.dtype:
        plain = scale == 1.0 and divisor == 1
        kind = _native_kind(buf.dtype, plain)
        if kind is not None:
            done = fusecopy.unpack(kind, buf, outputs, 1.0 if plain else scale / divisor)
            if done is not None:
                return done
    return unpack_reference(buf, outputs, scale, divisor)


def unpack_reference(buf, outputs, scale=1.0, divisor=1):
    """unpack in NumPy: what native/fusecopy.c must match."""
    offset = 0
    for out in outputs:
        n = out.size
        copy_scaled(buf[offset:offset + n], out.reshape(-1), scale, divisor)
        offset += n
    return offset


def as_bytes(arr):
    """A flat uint8 view of a C-contiguous array."""
    if arr.size == 0:
        return _EMPTY
    return arr.reshape(-1).view(np.uint8)
