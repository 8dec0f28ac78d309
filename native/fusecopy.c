/*
 * Copies many tensors into one fusion buffer, and out of it, in one call.
 *
 * A training step's small gradients are fused into one buffer for one MPI
 * call. In NumPy each tensor costs a Python-level call or two on the way in
 * and on the way out (about 1.5 us a tensor here, 0.6 ms of a step of
 * ResNet-50's 161 gradients); here the whole list is one call. The NumPy
 * reference is coordinator/fusion.py (pack and unpack without this module);
 * tests/test_native.py checks that they agree bit for bit.
 *
 *   pack(kind, sources, buf, factor)    buf = concatenation of sources (scaled)
 *   unpack(kind, buf, outputs, factor)  each output = its segment of buf (scaled)
 *
 * kind 0 copies the bytes (factor unused); kind 1 multiplies float32
 * elements by (float)factor, kind 2 float64 elements by factor, as
 * np.multiply(src, dtype.type(factor), out=dst) does. Both return the
 * number of buf's elements written or read, or None, having copied nothing,
 * when a tensor is not a C-contiguous (for outputs, writable) buffer of
 * buf's item format: the caller then takes NumPy's way, which converts.
 * The GIL is released while a large copy runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

enum { KIND_BYTES = 0, KIND_F32 = 1, KIND_F64 = 2 };

/* Copies of fewer bytes than this keep the GIL: releasing and taking it
 * back costs more than they do. */
#define RELEASE_GIL_BYTES (1 << 18)

static int check_kind(int kind, const Py_buffer *buf) {
    if (kind == KIND_F32 && buf->itemsize == 4) return 0;
    if (kind == KIND_F64 && buf->itemsize == 8) return 0;
    if (kind == KIND_BYTES) return 0;
    PyErr_Format(PyExc_ValueError, "kind %d does not match an item size of %zd", kind,
                 buf->itemsize);
    return -1;
}

static int same_format(const Py_buffer *a, const Py_buffer *b) {
    const char *fa = a->format ? a->format : "B";
    const char *fb = b->format ? b->format : "B";
    return a->itemsize == b->itemsize && strcmp(fa, fb) == 0;
}

static void copy_scaled(int kind, char *dst, const char *src, Py_ssize_t nbytes,
                        double factor) {
    Py_ssize_t i, n;
    if (kind == KIND_F32) {
        float f = (float)factor;
        float *d = (float *)dst;
        const float *s = (const float *)src;
        n = nbytes / 4;
        for (i = 0; i < n; i++) d[i] = s[i] * f;
    } else if (kind == KIND_F64) {
        double *d = (double *)dst;
        const double *s = (const double *)src;
        n = nbytes / 8;
        for (i = 0; i < n; i++) d[i] = s[i] * factor;
    } else {
        memcpy(dst, src, (size_t)nbytes);
    }
}

/* The tensors' buffers, taken from the list `seq` (writable for outputs),
 * each checked against the fusion buffer `buf`; *total: their bytes. */
static Py_buffer *take_views(PyObject *seq, const Py_buffer *buf, int writable,
                             Py_ssize_t *count, Py_ssize_t *total) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i, got = 0, bytes = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    Py_buffer *views;
    *count = -1;
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], flags) < 0) {
            PyErr_Clear();  /* not contiguous, read-only, no buffer: NumPy's way */
            goto fail;
        }
        got++;
        if (!same_format(&views[i], buf)) goto fail;  /* a conversion: NumPy's way */
        bytes += views[i].len;
    }
    if (bytes > buf->len) {
        PyErr_Format(PyExc_ValueError, "the tensors hold %zd bytes; the fusion buffer %zd",
                     bytes, buf->len);
        goto fail;
    }
    *count = n;
    *total = bytes;
    return views;
fail:
    for (i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    return NULL;
}

static void copy_all(int kind, char *base, const Py_buffer *views, Py_ssize_t n,
                     double factor, int packing) {
    Py_ssize_t i, offset = 0;
    for (i = 0; i < n; i++) {
        if (packing)
            copy_scaled(kind, base + offset, views[i].buf, views[i].len, factor);
        else
            copy_scaled(kind, views[i].buf, base + offset, views[i].len, factor);
        offset += views[i].len;
    }
}

static PyObject *fuse(PyObject *args, int packing) {
    int kind;
    double factor;
    PyObject *list, *target, *seq, *result = NULL;
    Py_buffer buf, *views;
    Py_ssize_t n, total, i;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (packing ? PyBUF_WRITABLE : 0);
    if (packing) {
        if (!PyArg_ParseTuple(args, "iOOd", &kind, &list, &target, &factor)) return NULL;
    } else {
        if (!PyArg_ParseTuple(args, "iOOd", &kind, &target, &list, &factor)) return NULL;
    }
    if (PyObject_GetBuffer(target, &buf, flags) < 0) {
        PyErr_Clear();  /* a dtype with no buffer format (bfloat16): NumPy's way */
        Py_RETURN_NONE;
    }
    if (check_kind(kind, &buf) < 0) goto done_buf;
    seq = PySequence_Fast(list, "the tensors must be a list or a tuple");
    if (seq == NULL) goto done_buf;
    views = take_views(seq, &buf, !packing, &n, &total);
    if (views == NULL && n == -1 && !PyErr_Occurred()) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else if (views != NULL) {
        if (total >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            copy_all(kind, (char *)buf.buf, views, n, factor, packing);
            Py_END_ALLOW_THREADS
        } else {
            copy_all(kind, (char *)buf.buf, views, n, factor, packing);
        }
        for (i = 0; i < n; i++) PyBuffer_Release(&views[i]);
        PyMem_Free(views);
        result = PyLong_FromSsize_t(buf.itemsize ? total / buf.itemsize : 0);
    }
    Py_DECREF(seq);
done_buf:
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *pack(PyObject *self, PyObject *args) { return fuse(args, 1); }

static PyObject *unpack(PyObject *self, PyObject *args) { return fuse(args, 0); }

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS,
     "pack(kind, sources, buf, factor) -> elements: the sources, one after the other, into "
     "buf (kind 0 bytes, 1 float32 scaled, 2 float64 scaled)"},
    {"unpack", unpack, METH_VARARGS,
     "unpack(kind, buf, outputs, factor) -> elements: consecutive segments of buf into the "
     "outputs (kind 0 bytes, 1 float32 scaled, 2 float64 scaled)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_fusecopy",
                                    "One-call copies into and out of fusion buffers.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native_fusecopy(void) { return PyModule_Create(&module); }
