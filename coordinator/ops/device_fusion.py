"""Device fusion: many tensors copied into one device buffer, and back, each
way by ONE kernel launch, with the pre- or post-scale (and any widening)
folded into the same pass; no host round trip.

A copy is described by segments, (device pointer, element count) each,
laid end to end in the buffer; a segment with pointer 0 is padding (zeros
on the way in, skipped on the way out). The pointers and the running
offsets travel to the device as one table: written into pinned host memory
and copied with `cudaMemcpyAsync` on the operation's stream, so nothing
waits (a copy from pageable memory would make the host wait for the
stream). Each thread of the kernel finds its element's segment by binary
search in the offsets.

Scaling follows the host path (fusion.py, native.py): float32 and float64
multiply by scale / divisor in their own precision; float16 and bfloat16
are widened to float32, multiplied and rounded to nearest even; an integer
average is divided in integers (exact, toward zero); integers with a scale
are scaled in float64 and truncated toward zero, dividing last.
"""

import numpy as np

_FLOAT16 = r"""
typedef unsigned short bits16;
__device__ __forceinline__ float load_float16(bits16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ bits16 store_float16(float f) {
    bits16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
"""

_PRELUDE = r"""
__device__ __forceinline__ float load_bfloat16(bits16 b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ bits16 store_bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bits16)((u >> 16) | 0x40u);  // NaN stays NaN
    return (bits16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                 // nearest even
}
// The segment holding element i: the last k with offsets[k] <= i.
__device__ __forceinline__ int segment_of(const long long* offsets, int n, long long i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}
"""

# kind: (C type, compute type, load into compute type, store from it)
_KINDS = {
    "int8": ("signed char", "double", "(double)({})", "(signed char)({})"),
    "uint8": ("unsigned char", "double", "(double)({})", "(unsigned char)({})"),
    "int16": ("short", "double", "(double)({})", "(short)({})"),
    "uint16": ("unsigned short", "double", "(double)({})", "(unsigned short)({})"),
    "int32": ("int", "double", "(double)({})", "(int)({})"),
    "int64": ("long long", "double", "(double)({})", "(long long)({})"),
    "float16": ("bits16", "float", "load_float16({})", "store_float16({})"),
    "bfloat16": ("bits16", "float", "load_bfloat16({})", "store_bfloat16({})"),
    "float32": ("float", "float", "({})", "({})"),
    "float64": ("double", "double", "({})", "({})"),
}

_KERNEL = r"""
extern "C" __global__ void {name}(const long long* table, int n, {buf_t}* buf, long long total,
                                  double scale, double divisor, int scaled) {{
    const long long* offsets = table + n;
    long long step = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {{
        int k = segment_of(offsets, n, i);
        {seg_t}* seg = ({seg_t}*)table[k];
        long long j = i - offsets[k];
        {body}
    }}
}}
"""

# The conversion of `x` (kind src) into `y` (kind dst); unscaled it is a plain
# C conversion (a copy for equal kinds, exact for integers of any width).
_CONVERT = r"""{dst_t} y;
        if (!scaled) {{ y = ({dst_t})x; }}
        else {{ {compute} v = {load}; {scale} y = {store}; }}"""

_PACK = r"""if (seg == 0) {{ buf[i] = 0; continue; }}
        {src_t} x = seg[j];
        {convert}
        buf[i] = y;"""

_UNPACK = r"""if (seg == 0) continue;
        {src_t} x = buf[i];
        {convert}
        seg[j] = y;"""


# Between integer kinds, an average (scale 1) divides in integers: C's
# division rounds toward zero, exactly (a double loses int64's low bits
# past 2**53).
_CONVERT_INT = r"""{dst_t} y;
        if (!scaled) {{ y = ({dst_t})x; }}
        else if (scale == 1.0) {{ y = ({dst_t})((long long)x / (long long)divisor); }}
        else {{ double v = (double)(x); v = v * scale; if (divisor != 1.0) v = v / divisor;
                y = ({dst_t})(v); }}"""


def _convert(src, dst):
    src_t, _, load, _ = _KINDS[src]
    dst_t, compute, _, store = _KINDS[dst]
    if src.startswith(("int", "uint")) and dst.startswith(("int", "uint")):
        return _CONVERT_INT.format(dst_t=dst_t)  # (no kind wider than int64)
    if compute == "double" and dst.startswith(("int", "uint")):
        scale = "v = v * scale; if (divisor != 1.0) v = v / divisor;"
    else:
        scale = f"v = v * ({compute})(scale / divisor);"
    return _CONVERT.format(dst_t=dst_t, compute=compute, load=load.format("x"), scale=scale,
                           store=store.format("v"))


def kernel_source(direction, tensor_kind, buffer_kind):
    """CUDA source of the pack (tensors -> buffer) or unpack kernel."""
    name = f"coordinator_{direction}_{tensor_kind}_{buffer_kind}"
    tensor_t, buffer_t = _KINDS[tensor_kind][0], _KINDS[buffer_kind][0]
    if direction == "pack":
        body = _PACK.format(src_t=tensor_t, convert=_convert(tensor_kind, buffer_kind))
    else:
        body = _UNPACK.format(src_t=buffer_t, convert=_convert(buffer_kind, tensor_kind))
    return name, _FLOAT16 + _PRELUDE + _KERNEL.format(name=name, buf_t=buffer_t, seg_t=tensor_t,
                                                      body=body)


class Tables:
    """One operation's segment tables, in pinned host memory and on the
    device, per slot ("pack", "unpack"), rewritten by a later operation: the
    caller makes sure that one starts only once this one's work is done
    (nccl_ops.py keeps two sets per lane, taken in turn)."""

    def __init__(self, cp):
        self.cp = cp
        self._slots = {}  # slot -> (pinned host int64 array, device int64 array)

    def upload(self, slot, segments, stream):
        """The device table of `segments` ([ptrs | offsets]) and the total count."""
        n = len(segments)
        need = 2 * n + 1
        host, dev = self._slots.get(slot, (None, None))
        if host is None or host.size < need:
            cap = max(need, 256)
            host = np.ndarray((cap,), np.int64, buffer=self.cp.cuda.alloc_pinned_memory(cap * 8))
            dev = self.cp.empty(cap, np.int64)
            self._slots[slot] = (host, dev)
        host[:n] = [ptr for ptr, _ in segments]
        host[n] = 0
        np.cumsum([count for _, count in segments], out=host[n + 1:need])
        self.cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, need * 8,
                                         self.cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        return dev, int(host[need - 1])


class Kernels:
    """The pack and unpack kernels, compiled on first use per pair of kinds
    (kinds are dtype names: "float32", "bfloat16", ...)."""

    BLOCK = 256
    MAX_BLOCKS = 4096  # a grid-stride loop covers the rest

    def __init__(self, cp):
        self.cp = cp
        self._compiled = {}

    def _kernel(self, direction, tensor_kind, buffer_kind):
        key = (direction, tensor_kind, buffer_kind)
        kernel = self._compiled.get(key)
        if kernel is None:
            name, source = kernel_source(*key)
            kernel = self._compiled[key] = self.cp.RawKernel(source, name)
        return kernel

    def pack(self, tables, stream, segments, buf, tensor_kind, buffer_kind, scale=1.0):
        """buf[...] = the segments end to end, times `scale`, on `stream` (the
        current stream)."""
        self._launch(tables, "pack", stream, segments, buf, tensor_kind, buffer_kind, scale, 1)

    def unpack(self, tables, stream, buf, segments, buffer_kind, tensor_kind, scale=1.0,
               divisor=1):
        """Each segment = its part of `buf` times scale / divisor."""
        self._launch(tables, "unpack", stream, segments, buf, tensor_kind, buffer_kind, scale,
                     divisor)

    def _launch(self, tables, direction, stream, segments, buf, tensor_kind, buffer_kind, scale,
                divisor):
        scaled = scale != 1.0 or divisor != 1
        if not scaled and tensor_kind == buffer_kind and _in_place(segments, buf):
            return
        table, total = tables.upload(direction, segments, stream)
        if total == 0:
            return
        blocks = min((total + self.BLOCK - 1) // self.BLOCK, self.MAX_BLOCKS)
        kernel = self._kernel(direction, tensor_kind, buffer_kind)
        kernel((blocks,), (self.BLOCK,), (table, np.int32(len(segments)), buf, np.int64(total),
                                          np.float64(scale), np.float64(divisor),
                                          np.int32(scaled)))


def _in_place(segments, buf):
    """True when the only segment is `buf` itself (nothing to copy)."""
    return len(segments) == 1 and segments[0][0] == buf.data.ptr
