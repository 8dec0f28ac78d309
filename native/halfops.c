/*
 * Reductions and scaling of 16-bit floats (IEEE float16 and bfloat16).
 *
 * Open MPI reduces float16 in software, element by element, about five times
 * slower than it reduces float32, and has no bfloat16 type at all. These
 * kernels let the coordinator send 16-bit data as 16-bit data and reduce it
 * with an MPI user-defined operation: each element is widened to float32,
 * combined, and rounded back to nearest-even. The NumPy reference for every
 * kernel is coordinator/native.py; tests/test_native.py checks they agree.
 *
 *   reduce(op, kind, invec, inoutvec)   inoutvec[i] = invec[i] (op) inoutvec[i]
 *   scale(kind, buf, factor)            buf[i] = buf[i] * factor
 *
 * op: 0 sum, 1 min, 2 max, 3 product. kind: 0 float16, 1 bfloat16.
 * Buffers are any writable (inout) / readable (in) buffer of 2-byte items.
 * The GIL is released while the loops run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2, OP_PROD = 3 };
enum { KIND_F16 = 0, KIND_BF16 = 1 };

/* ---- scalar conversions ------------------------------------------------ */

static inline float u32_as_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_as_u32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return u32_as_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32_scalar(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) return u32_as_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    if (exp == 31) return u32_as_f32(sign | 0x7f800000u | (man << 13));
    return u32_as_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16_scalar(float f) {
    uint32_t u = f32_as_u32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds to inf (>= 65520) */
    if (abs < 0x38800000u) {                     /* below the smallest normal */
        /* subnormal or zero: round(value * 2^24) to nearest even */
        float a = u32_as_f32(abs) * 16777216.0f;
        float r = nearbyintf(a); /* default rounding mode: ties to even */
        return sign | (uint16_t)r;
    }
    /* normal: rebias the exponent and round the mantissa, ties to even */
    uint32_t mant_round = abs + 0xfffu + ((abs >> 13) & 1u);
    return sign | (uint16_t)((mant_round - 0x38000000u) >> 13);
}

/* ---- vector loops -------------------------------------------------------- */

/* Min and max follow native/minmax.c: a NaN in either operand gives the
 * default quiet NaN, and -0 counts below +0, so the result does not depend on
 * the order MPI combines the ranks in. */
static inline float min_or_max(int op, float a, float b) {
    if (isnan(a) || isnan(b)) return u32_as_f32(0x7fc00000u);
    uint32_t x = f32_as_u32(op == OP_MIN ? (a < b ? a : b) : (a > b ? a : b));
    uint32_t y = f32_as_u32(op == OP_MIN ? (b < a ? b : a) : (b > a ? b : a));
    return u32_as_f32(op == OP_MIN ? (x | y) : (x & y));
}

static inline float combine(int op, float a, float b) {
    switch (op) {
    case OP_MIN: case OP_MAX: return min_or_max(op, a, b);
    case OP_PROD: return a * b;
    default: return a + b;
    }
}

#ifdef HAVE_X86
__attribute__((target("f16c,avx")))
static Py_ssize_t reduce_f16_f16c(int op, const uint16_t *in, uint16_t *inout, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (op == OP_SUM || op == OP_PROD) {
        for (; i + 8 <= n; i += 8) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i)));
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(inout + i)));
            __m256 c = op == OP_SUM ? _mm256_add_ps(a, b) : _mm256_mul_ps(a, b);
            _mm_storeu_si128((__m128i *)(inout + i),
                             _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    return i;
}

__attribute__((target("f16c,avx")))
static Py_ssize_t scale_f16_f16c(uint16_t *buf, Py_ssize_t n, float factor) {
    Py_ssize_t i = 0;
    __m256 s = _mm256_set1_ps(factor);
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(buf + i)));
        _mm_storeu_si128((__m128i *)(buf + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(a, s), _MM_FROUND_TO_NEAREST_INT));
    }
    return i;
}

/* bfloat16 <-> float32 is a 16-bit shift, so AVX2 integer ops do it. */
__attribute__((target("avx2")))
static Py_ssize_t reduce_bf16_avx2(int op, const uint16_t *in, uint16_t *inout, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (op != OP_SUM && op != OP_PROD) return 0;
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(in + i))), 16));
        __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(inout + i))), 16));
        __m256 c = op == OP_SUM ? _mm256_add_ps(a, b) : _mm256_mul_ps(a, b);
        __m256i u = _mm256_castps_si256(c);
        __m256i top = _mm256_srli_epi32(u, 16);
        /* round to nearest even: add 0x7fff plus the lowest kept bit */
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(top, one))), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(c, c, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(top, quiet), nan);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128((__m128i *)(inout + i), _mm256_castsi256_si128(packed));
    }
    return i;
}

static int has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2");
    }
    return cached;
}

static int has_f16c(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    }
    return cached;
}
#endif

static void reduce_loop(int op, int kind, const uint16_t *in, uint16_t *inout, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (kind == KIND_F16) {
#ifdef HAVE_X86
        if (has_f16c()) i = reduce_f16_f16c(op, in, inout, n);
#endif
        for (; i < n; i++)
            inout[i] = f32_to_f16_scalar(
                combine(op, f16_to_f32_scalar(in[i]), f16_to_f32_scalar(inout[i])));
    } else {
#ifdef HAVE_X86
        if (has_avx2()) i = reduce_bf16_avx2(op, in, inout, n);
#endif
        for (; i < n; i++)
            inout[i] = f32_to_bf16(combine(op, bf16_to_f32(in[i]), bf16_to_f32(inout[i])));
    }
}

static void scale_loop(int kind, uint16_t *buf, Py_ssize_t n, float factor) {
    Py_ssize_t i = 0;
    if (kind == KIND_F16) {
#ifdef HAVE_X86
        if (has_f16c()) i = scale_f16_f16c(buf, n, factor);
#endif
        for (; i < n; i++) buf[i] = f32_to_f16_scalar(f16_to_f32_scalar(buf[i]) * factor);
    } else {
        for (; i < n; i++) buf[i] = f32_to_bf16(bf16_to_f32(buf[i]) * factor);
    }
}

/* ---- Python bindings ----------------------------------------------------- */

static int check_args(int op, int kind) {
    if (op < OP_SUM || op > OP_PROD) {
        PyErr_Format(PyExc_ValueError, "unknown reduce op %d", op);
        return -1;
    }
    if (kind != KIND_F16 && kind != KIND_BF16) {
        PyErr_Format(PyExc_ValueError, "unknown 16-bit kind %d", kind);
        return -1;
    }
    return 0;
}

static PyObject *py_reduce(PyObject *self, PyObject *args) {
    int op, kind;
    Py_buffer in, inout;
    if (!PyArg_ParseTuple(args, "iiy*w*", &op, &kind, &in, &inout)) return NULL;
    PyObject *result = NULL;
    if (check_args(op, kind) < 0) goto done;
    if (in.len != inout.len || in.len % 2) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes: need equal, even sizes",
                     in.len, inout.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    reduce_loop(op, kind, (const uint16_t *)in.buf, (uint16_t *)inout.buf, in.len / 2);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&in);
    PyBuffer_Release(&inout);
    return result;
}

static PyObject *py_scale(PyObject *self, PyObject *args) {
    int kind;
    Py_buffer buf;
    double factor;
    if (!PyArg_ParseTuple(args, "iw*d", &kind, &buf, &factor)) return NULL;
    PyObject *result = NULL;
    if (check_args(OP_SUM, kind) < 0) goto done;
    if (buf.len % 2) {
        PyErr_SetString(PyExc_ValueError, "buffer size must be even");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    scale_loop(kind, (uint16_t *)buf.buf, buf.len / 2, (float)factor);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(op, kind, invec, inoutvec): inoutvec = invec (op) inoutvec, in place."},
    {"scale", py_scale, METH_VARARGS, "scale(kind, buf, factor): buf *= factor, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordinator._native_halfops",
    "Reductions and scaling of float16 and bfloat16 buffers.", -1, methods,
};

PyMODINIT_FUNC PyInit__native_halfops(void) { return PyModule_Create(&module); }
