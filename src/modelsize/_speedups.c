/* modelsize._speedups: optional compiled kernels (the package works without them).
 *
 * cast_f32_bf16(src) -> (bytes, max_abs, max_rel, overflow)
 *
 *   float32 elements (little-endian) rounded to bfloat16 in one pass, with the error the cast
 *   made, exactly as modelsize.slimming.cast computes it with NumPy in a dozen passes:
 *
 *   - rounding to nearest, ties to even (the top 16 bits of the float32 after adding 0x7FFF
 *     and the lowest kept bit); a NaN keeps its top bits with the quiet bit set;
 *   - max_abs: the largest |x - bf16(x)| (exact in float32), over the values whose cast is
 *     finite; max_rel: the largest |x - bf16(x)| / |x| in float32 arithmetic, 0/0 skipped;
 *   - overflow: how many finite values rounded to infinity (they count in neither maximum);
 *   - NaN and infinities in the source count in neither maximum. Where no value counts, a
 *     maximum is NaN (0.0 for an empty source), as NumPy's fmax.reduce gives.
 *
 *   The GIL is released while it runs: slim casts pieces on every core.
 *
 * Built by setup.py as an optional extension; modelsize.slimming.cast falls back to NumPy
 * where it is missing, and the tests compare both on the values that matter (ties,
 * subnormals, signed zeros, NaN, infinities, overflow).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t round_bf16(uint32_t u) {
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* The common case: no NaN, infinity or overflow in [0, n). Returns how many elements had an
 * all-ones exponent before or after the cast (0: the output and the maxima are right;
 * otherwise the caller redoes the block with cast_block_careful: a negative NaN's rounding
 * wraps around to zero). Branch-free, for the vectorizer: the maxima are taken on the bits
 * (non-negative finite floats order as their bits do), and a zero's relative error, 0/0,
 * is left out by dividing by 1 instead and not counting it. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* 256-bit vectors where the CPU has them (picked once, at load), 128-bit SSE2 elsewhere. */
__attribute__((target_clones("avx2", "default")))
#endif
static Py_ssize_t cast_block_fast(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                                  float *max_abs, float *max_rel, int *seen_abs, int *seen_rel) {
    int32_t ma = -1, mr = -1;
    int32_t hits = 0, nonzero = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = in[i];
        uint32_t r = round_bf16(u);
        out[i] = (uint16_t)r;
        hits += ((u & 0x7F800000u) == 0x7F800000u) | ((r & 0x7F80u) == 0x7F80u);
        uint32_t mag = u & 0x7FFFFFFFu;
        nonzero += mag != 0;
        float x = bits_float(u);
        float d = fabsf(x - bits_float(r << 16));
        float ax = bits_float(mag);
        float q = d / (mag != 0 ? ax : 1.0f);
        int32_t db, qb;
        memcpy(&db, &d, 4);
        memcpy(&qb, &q, 4);
        ma = db > ma ? db : ma;
        mr = qb > mr ? qb : mr;
    }
    if (hits) return hits;
    if (n) {
        float a, b;
        memcpy(&a, &ma, 4);
        *seen_abs = 1;
        if (a > *max_abs) *max_abs = a;
        if (nonzero) {
            memcpy(&b, &mr, 4);
            *seen_rel = 1;
            if (b > *max_rel) *max_rel = b;
        }
    }
    return 0;
}

/* Every case: NaN (quieted), infinities, finite values that overflow to infinity. */
static void cast_block_careful(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                               float *max_abs, float *max_rel, int *seen_abs, int *seen_rel,
                               Py_ssize_t *overflow) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = in[i];
        uint32_t mag = u & 0x7FFFFFFFu;
        if (mag > 0x7F800000u) { /* NaN: keep its top bits, set the quiet bit */
            out[i] = (uint16_t)((u >> 16) | 0x40u);
            continue;
        }
        uint32_t r = round_bf16(u);
        out[i] = (uint16_t)r;
        if (mag == 0x7F800000u) continue; /* infinity: exact, counts in neither maximum */
        if ((r & 0x7F80u) == 0x7F80u) {   /* a finite value rounded to infinity */
            (*overflow)++;
            continue;
        }
        float x = bits_float(u);
        float d = fabsf(x - bits_float(r << 16));
        *seen_abs = 1;
        if (d > *max_abs) *max_abs = d;
        if (mag != 0) {
            float q = d / fabsf(x);
            *seen_rel = 1;
            if (q > *max_rel) *max_rel = q;
        }
    }
}

#define BLOCK 4096

static PyObject *cast_f32_bf16(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len % 4 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "cast_f32_bf16: the source is not whole float32s");
        return NULL;
    }
    Py_ssize_t n = view.len / 4;
    PyObject *result = PyBytes_FromStringAndSize(NULL, n * 2);
    if (result == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    /* The new bytes object is ours alone until we return it: filling it without the GIL is
     * safe. The source must stay unchanged meanwhile (slim's pieces do). */
    uint16_t *out = (uint16_t *)PyBytes_AS_STRING(result);
    const uint32_t *in = (const uint32_t *)view.buf;
    float max_abs = 0.0f, max_rel = 0.0f;
    int seen_abs = 0, seen_rel = 0;
    Py_ssize_t overflow = 0;
    uint32_t aligned[BLOCK];
    int misaligned = ((uintptr_t)view.buf % 4) != 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        const uint32_t *src = in + start;
        if (misaligned) {
            memcpy(aligned, (const char *)view.buf + start * 4, (size_t)m * 4);
            src = aligned;
        }
        float a = max_abs, b = max_rel;
        int sa = seen_abs, sr = seen_rel;
        if (cast_block_fast(src, out + start, m, &a, &b, &sa, &sr) == 0) {
            max_abs = a;
            max_rel = b;
            seen_abs = sa;
            seen_rel = sr;
        } else {
            cast_block_careful(src, out + start, m, &max_abs, &max_rel, &seen_abs, &seen_rel,
                               &overflow);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    double nan = Py_NAN;
    double abs_out = n == 0 ? 0.0 : (seen_abs ? (double)max_abs : nan);
    double rel_out = n == 0 ? 0.0 : (seen_rel ? (double)max_rel : nan);
    PyObject *tuple = Py_BuildValue("(Nddn)", result, abs_out, rel_out, overflow);
    return tuple;
}

static PyMethodDef methods[] = {
    {"cast_f32_bf16", cast_f32_bf16, METH_O,
     "float32 bytes -> (bfloat16 bytes, max abs error, max rel error, overflows)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "modelsize._speedups",
    "Optional compiled kernels of modelsize (it works without them).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
