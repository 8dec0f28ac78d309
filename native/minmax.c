/*
 * Min and max of float32 and float64 buffers that propagate NaN.
 *
 * Open MPI's MPI_MIN and MPI_MAX compare with `<` and `>`, so a NaN held by
 * one rank is kept or dropped depending on the order MPI combines the ranks
 * in. The coordinator reduces float Min and Max with an MPI user-defined
 * operation built on this kernel instead. The NumPy reference is
 * coordinator/native.py (minmax_reference); tests/test_native.py checks they
 * agree bit for bit.
 *
 *   reduce(op, kind, invec, inoutvec)   inoutvec[i] = invec[i] (op) inoutvec[i]
 *
 * op: 1 min, 2 max (the codes of halfops.c). kind: 0 float32, 1 float64.
 * The result does not depend on the order of the operands, so every rank
 * holds the same bits whatever order MPI combined them in:
 *   - a NaN in either operand gives the default quiet NaN (positive, no
 *     payload);
 *   - -0.0 counts below +0.0: min(-0, +0) = -0, max(-0, +0) = +0 (IEEE
 *     754-2019 minimum and maximum). np.minimum returns its second operand
 *     for equal inputs, which would make the sign depend on the order.
 * The GIL is released while the loops run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

enum { OP_MIN = 1, OP_MAX = 2 };
enum { KIND_F32 = 0, KIND_F64 = 1 };

static const uint32_t QNAN32 = 0x7fc00000u;
static const uint64_t QNAN64 = 0x7ff8000000000000ull;

/* ---- scalar rule ----------------------------------------------------------
 * For ordered operands, (a < b ? a : b) and (b < a ? b : a) are the same
 * value, and differ only for -0/+0, where their bits OR to -0 (min) and AND
 * to +0 (max). The vector loops below compute the same thing with
 * minps/maxps, which are exactly `a < b ? a : b` / `a > b ? a : b`. */

#define DEFINE_SCALAR(NAME, T, U, QNAN)                                         \
    static inline T NAME(int op, T a, T b) {                                    \
        U ua, ub, r;                                                            \
        T x, y, out;                                                            \
        if (a != a || b != b) {                                                 \
            r = QNAN;                                                           \
        } else {                                                                \
            x = op == OP_MIN ? (a < b ? a : b) : (a > b ? a : b);               \
            y = op == OP_MIN ? (b < a ? b : a) : (b > a ? b : a);               \
            memcpy(&ua, &x, sizeof ua);                                         \
            memcpy(&ub, &y, sizeof ub);                                         \
            r = op == OP_MIN ? (ua | ub) : (ua & ub);                           \
        }                                                                       \
        memcpy(&out, &r, sizeof out);                                           \
        return out;                                                             \
    }

DEFINE_SCALAR(combine_f32, float, uint32_t, QNAN32)
DEFINE_SCALAR(combine_f64, double, uint64_t, QNAN64)

/* ---- AVX loops ------------------------------------------------------------ */

#ifdef HAVE_X86
__attribute__((target("avx")))
static Py_ssize_t reduce_f32_avx(int op, const float *in, float *inout, Py_ssize_t n) {
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32((int)QNAN32));
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(in + i), b = _mm256_loadu_ps(inout + i), r, nan;
        if (op == OP_MIN)
            r = _mm256_or_ps(_mm256_min_ps(a, b), _mm256_min_ps(b, a));
        else
            r = _mm256_and_ps(_mm256_max_ps(a, b), _mm256_max_ps(b, a));
        nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
        r = _mm256_or_ps(_mm256_andnot_ps(nan, r), _mm256_and_ps(nan, qnan));
        _mm256_storeu_ps(inout + i, r);
    }
    return i;
}

__attribute__((target("avx")))
static Py_ssize_t reduce_f64_avx(int op, const double *in, double *inout, Py_ssize_t n) {
    const __m256d qnan = _mm256_castsi256_pd(_mm256_set1_epi64x((long long)QNAN64));
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d a = _mm256_loadu_pd(in + i), b = _mm256_loadu_pd(inout + i), r, nan;
        if (op == OP_MIN)
            r = _mm256_or_pd(_mm256_min_pd(a, b), _mm256_min_pd(b, a));
        else
            r = _mm256_and_pd(_mm256_max_pd(a, b), _mm256_max_pd(b, a));
        nan = _mm256_cmp_pd(a, b, _CMP_UNORD_Q);
        r = _mm256_or_pd(_mm256_andnot_pd(nan, r), _mm256_and_pd(nan, qnan));
        _mm256_storeu_pd(inout + i, r);
    }
    return i;
}

static int has_avx(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx");
    }
    return cached;
}
#endif

static void reduce_loop(int op, int kind, const void *in, void *inout, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (kind == KIND_F32) {
        const float *a = in;
        float *b = inout;
#ifdef HAVE_X86
        if (has_avx()) i = reduce_f32_avx(op, a, b, n);
#endif
        for (; i < n; i++) b[i] = combine_f32(op, a[i], b[i]);
    } else {
        const double *a = in;
        double *b = inout;
#ifdef HAVE_X86
        if (has_avx()) i = reduce_f64_avx(op, a, b, n);
#endif
        for (; i < n; i++) b[i] = combine_f64(op, a[i], b[i]);
    }
}

/* ---- Python binding -------------------------------------------------------- */

static PyObject *py_reduce(PyObject *self, PyObject *args) {
    int op, kind;
    Py_buffer in, inout;
    if (!PyArg_ParseTuple(args, "iiy*w*", &op, &kind, &in, &inout)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t item = kind == KIND_F64 ? 8 : 4;
    if (op != OP_MIN && op != OP_MAX) {
        PyErr_Format(PyExc_ValueError, "unknown min/max op %d (1 min, 2 max)", op);
        goto done;
    }
    if (kind != KIND_F32 && kind != KIND_F64) {
        PyErr_Format(PyExc_ValueError, "unknown float kind %d (0 float32, 1 float64)", kind);
        goto done;
    }
    if (in.len != inout.len || in.len % item) {
        PyErr_Format(PyExc_ValueError,
                     "buffers of %zd and %zd bytes: need equal sizes, multiples of %zd",
                     in.len, inout.len, item);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    reduce_loop(op, kind, in.buf, inout.buf, in.len / item);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&in);
    PyBuffer_Release(&inout);
    return result;
}

static PyMethodDef methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(op, kind, invec, inoutvec): inoutvec = min or max of invec and inoutvec, "
     "in place; NaN propagates, -0.0 < +0.0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "coordinator._native_minmax",
    "NaN-propagating min and max of float32 and float64 buffers.", -1, methods,
};

PyMODINIT_FUNC PyInit__native_minmax(void) { return PyModule_Create(&module); }
