/* modelsize._speedups: optional compiled kernels (the package works without them).
 *
 * cast_f32_bf16(src) -> (bytes, max_abs, max_rel, overflow)
 * cast_f32_f16(src)  -> (bytes, max_abs, max_rel, overflow)
 *
 *   float32 elements (little-endian) rounded to bfloat16 or float16 in one pass over the
 *   data (blocks of 4,096 elements, each in cache), with the error the cast made, exactly as
 *   modelsize.slimming.cast computes them with NumPy in a dozen passes:
 *
 *   - bfloat16: rounding to nearest, ties to even (the top 16 bits of the float32 after
 *     adding 0x7FFF and the lowest kept bit); a NaN keeps its top bits with the quiet bit set;
 *   - float16: NumPy's own conversion, bit for bit (npy_floatbits_to_halfbits: nearest, ties
 *     to even, subnormals, overflow to infinity; a NaN keeps the top 10 bits of its
 *     significand, or becomes 0x7C01 where those are all zero);
 *   - max_abs: the largest |x - cast(x)| (exact in float32), over the values whose cast is
 *     finite; max_rel: the largest |x - cast(x)| / |x| in float32 arithmetic, 0/0 skipped;
 *   - overflow: how many finite values rounded to infinity (they count in neither maximum);
 *   - NaN and infinities in the source count in neither maximum. Where no value counts, a
 *     maximum is NaN (0.0 for an empty source), as NumPy's fmax.reduce gives.
 *
 *   The GIL is released while it runs: slim casts pieces on every core. float16 runs on the
 *   CPU's F16C conversion where it has one (x86-64 with AVX2 and F16C, found when the module
 *   loads; MODELSIZE_NO_F16C=1 turns it off), twice as fast as the portable loops, and gives
 *   their bytes and errors for every one of the 2**32 inputs.
 *
 * Built by setup.py as an optional extension (-O3 -fno-trapping-math: the loops vectorize;
 * never -ffast-math, which would break NaN, subnormals and the order of rounding);
 * modelsize.slimming.cast falls back to NumPy where it is missing. The tests compare both on
 * the values that matter (ties, subnormals, signed zeros, NaN, infinities, overflow);
 * scripts/check_casts_exhaustive.py compares all 2**32 float32 bit patterns (the same bytes and
 * the same errors, block by block: run it after changing this file).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* -- the two conversions ---------------------------------------------------------------- */

/* bfloat16, nearest-even; right for every value but NaN (a negative NaN wraps to zero). */
static inline uint32_t to_bf16(uint32_t u) {
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* The magnitude of a bfloat16, as a float32 (exact). */
static inline float bf16_mag(uint32_t h) {
    return bits_float((h & 0x7FFFu) << 16);
}

/* float16 as NumPy rounds it, for finite values below 65520 (no overflow), branch-free. */
static inline uint32_t to_f16(uint32_t f) {
    uint32_t sgn = (f >> 16) & 0x8000u;
    uint32_t f_exp = f & 0x7F800000u;
    uint32_t f_sig = f & 0x007FFFFFu;
    /* normal: rebias the exponent, round the significand (a carry spills into the exponent) */
    uint32_t sig_n = f_sig + (((f_sig & 0x3FFFu) != 0x1000u) ? 0x1000u : 0u);
    uint32_t normal = ((f_exp - 0x38000000u) >> 13) + (sig_n >> 13);
    /* subnormal: shift the significand with its hidden bit right by 1 to 11 */
    uint32_t e = f_exp >> 23;
    uint32_t shift = 113u - e;
    shift = shift > 24u ? 24u : shift; /* only used where 1 <= shift <= 11 */
    uint32_t sig_s = (0x00800000u + f_sig) >> shift;
    sig_s += (((sig_s & 0x3FFFu) != 0x1000u) | ((f & 0x7FFu) != 0)) ? 0x1000u : 0u;
    uint32_t sub = sig_s >> 13;
    uint32_t h = f_exp <= 0x38000000u ? (f_exp < 0x33000000u ? 0u : sub) : normal;
    return sgn | h;
}

/* float16 as NumPy rounds it, every value (NaN, infinities, overflow). */
static inline uint32_t to_f16_careful(uint32_t f) {
    uint32_t sgn = (f >> 16) & 0x8000u;
    uint32_t f_exp = f & 0x7F800000u;
    if (f_exp >= 0x47800000u) {
        uint32_t f_sig = f & 0x007FFFFFu;
        if (f_exp == 0x7F800000u && f_sig != 0) { /* NaN: the top of its significand */
            uint32_t ret = 0x7C00u + (f_sig >> 13);
            return sgn | (ret == 0x7C00u ? 0x7C01u : ret);
        }
        return sgn | 0x7C00u; /* infinity, or a finite value past float16's range */
    }
    return to_f16(f);
}

/* The magnitude of a finite float16, as a float32 (exact: an integer below 1024 times a power
 * of two for the subnormals). */
static inline float f16_mag(uint32_t h) {
    uint32_t mag = h & 0x7FFFu;
    float sub = (float)(int32_t)(mag & 0x3FFu) * 0x1p-24f;
    float normal = bits_float((mag << 13) + 0x38000000u);
    return (mag & 0x7C00u) ? normal : sub;
}

/* -- one block ---------------------------------------------------------------------------- */

enum { BF16 = 0, F16 = 1 };

/* The maxima of one block, folded into the running ones (ma, mr: the largest error bits,
 * -1 where none; nonzero: how many |x| > 0). */
static inline void fold(int32_t ma, int32_t mr, int32_t nonzero, Py_ssize_t n, float *max_abs,
                        float *max_rel, int *seen_abs, int *seen_rel) {
    if (n == 0) return;
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

/* One element's error, folded into the running maxima (on the bits: non-negative finite floats
 * order as their bits do); a zero's relative error, 0/0, is left out by dividing by 1 instead
 * (the caller does not count it). x and its cast have one sign: |x - cast(x)| = ||x| - back|. */
static inline void track(uint32_t mag, float back, int32_t *ma, int32_t *mr) {
    float ax = bits_float(mag);
    float d = fabsf(ax - back);
    float q = d / (mag != 0 ? ax : 1.0f);
    int32_t db, qb;
    memcpy(&db, &d, 4);
    memcpy(&qb, &q, 4);
    *ma = db > *ma ? db : *ma;
    *mr = qb > *mr ? qb : *mr;
}

/* The common case: no NaN, infinity or overflow in [0, n). Each returns how many elements
 * were special (an all-ones exponent, or past float16's range, before or after the cast): 0
 * means the output and the maxima are right; otherwise the caller redoes the block with
 * block_careful (a negative NaN's bfloat16 rounding wraps around to zero). Branch-free, for
 * the vectorizer (see track). */
static inline Py_ssize_t block_fast_bf16_body(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                                              float *max_abs, float *max_rel, int *seen_abs,
                                              int *seen_rel) {
    int32_t ma = -1, mr = -1;
    int32_t hits = 0, nonzero = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = in[i];
        uint32_t r = to_bf16(u);
        hits += ((u & 0x7F800000u) == 0x7F800000u) | ((r & 0x7F80u) == 0x7F80u);
        out[i] = (uint16_t)r;
        uint32_t mag = u & 0x7FFFFFFFu;
        nonzero += mag != 0;
        track(mag, bf16_mag(r), &ma, &mr);
    }
    if (hits) return hits;
    fold(ma, mr, nonzero, n, max_abs, max_rel, seen_abs, seen_rel);
    return 0;
}

#define BLOCK 4096

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* 256-bit vectors where the CPU has them (picked once, at load), 128-bit SSE2 elsewhere. */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

CLONES static Py_ssize_t block_fast_bf16(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                                         float *a, float *b, int *sa, int *sr) {
    return block_fast_bf16_body(in, out, n, a, b, sa, sr);
}

/* float16 in three loops, each a function of its own, which the vectorizer takes (in one
 * loop, or one function, it narrows the 16-bit results and gives up): the conversion into
 * 32-bit lanes (the input's top half kept in them, so that nothing is narrowed), the packing
 * to 16 bits, the errors. */
CLONES static int32_t f16_convert(const uint32_t *in, uint32_t *wide, Py_ssize_t n) {
    int32_t hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = in[i];
        uint32_t r = to_f16(u) | (u & 0xFFFF0000u);
        hits += ((u & 0x7F800000u) >= 0x47800000u) | ((r & 0x7C00u) == 0x7C00u);
        wide[i] = r;
    }
    return hits;
}

CLONES static void f16_pack(const uint32_t *wide, uint16_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint16_t)wide[i];
}

CLONES static void f16_errors(const uint32_t *in, const uint32_t *wide, Py_ssize_t n,
                              int32_t *pma, int32_t *pmr, int32_t *pnonzero) {
    int32_t ma = -1, mr = -1, nonzero = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t mag = in[i] & 0x7FFFFFFFu;
        nonzero += mag != 0;
        track(mag, f16_mag(wide[i]), &ma, &mr);
    }
    *pma = ma;
    *pmr = mr;
    *pnonzero = nonzero;
}

static Py_ssize_t block_fast_f16_portable(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                                          float *max_abs, float *max_rel, int *seen_abs,
                                          int *seen_rel) {
    uint32_t wide[BLOCK];
    int32_t hits = f16_convert(in, wide, n);
    if (hits) return hits;
    f16_pack(wide, out, n);
    int32_t ma, mr, nonzero;
    f16_errors(in, wide, n, &ma, &mr, &nonzero);
    fold(ma, mr, nonzero, n, max_abs, max_rel, seen_abs, seen_rel);
    return 0;
}

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
/* The same block with the CPU's own conversion (F16C's vcvtps2ph, rounding to nearest, ties to
 * even: on the finite values below float16's overflow that this path keeps, the IEEE rounding
 * NumPy's conversion computes, subnormals included; scripts/check_casts_exhaustive.py compares
 * all 2**32 inputs). Eight elements at a time: the cast, the test for special values, the
 * errors (vcvtph2ps gives the cast back exactly; the same float32 subtraction and division as
 * track, whose maxima on non-negative floats are vmaxps's). The tail of a block that is not a
 * multiple of 8 goes through the portable loops. */
__attribute__((target("avx2,f16c"))) static Py_ssize_t block_fast_f16_f16c(
    const uint32_t *in, uint16_t *out, Py_ssize_t n, float *max_abs, float *max_rel,
    int *seen_abs, int *seen_rel) {
    Py_ssize_t m = n - n % 8;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i overflow_exp = _mm256_set1_epi32(0x47800000 - 1);
    const __m128i inf16 = _mm_set1_epi16(0x7C00);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps();
    __m256i special = _mm256_setzero_si256();
    __m128i special16 = _mm_setzero_si128();
    __m256 ma = zero, mr = zero;
    __m256i nonzero = _mm256_setzero_si256();
    for (Py_ssize_t i = 0; i < m; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(in + i));
        __m256i mag = _mm256_and_si256(u, abs_mask);
        /* |x| >= 65536 (past float16, infinity, NaN): the exponent test of f16_convert */
        special = _mm256_or_si256(special, _mm256_cmpgt_epi32(mag, overflow_exp));
        __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(u),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* rounded to infinity (65520 <= |x| < 65536) */
        special16 = _mm_or_si128(special16, _mm_cmpeq_epi16(_mm_and_si128(h, inf16), inf16));
        _mm_storeu_si128((__m128i *)(out + i), h);
        __m256 ax = _mm256_castsi256_ps(mag);
        __m256 back = _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_castps_si256(_mm256_cvtph_ps(h)), abs_mask));
        __m256 d = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_castps_si256(_mm256_sub_ps(ax, back)), abs_mask));
        __m256i is_zero = _mm256_cmpeq_epi32(mag, _mm256_setzero_si256());
        __m256 den = _mm256_blendv_ps(ax, one, _mm256_castsi256_ps(is_zero));
        __m256 q = _mm256_div_ps(d, den);
        ma = _mm256_max_ps(ma, d);
        mr = _mm256_max_ps(mr, q);
        nonzero = _mm256_sub_epi32(nonzero, _mm256_andnot_si256(is_zero, _mm256_set1_epi32(-1)));
    }
    if (!_mm256_testz_si256(special, special) || !_mm_testz_si128(special16, special16))
        return 1;
    float a = 0.0f, b = 0.0f;
    int32_t count = 0;
    float lanes_a[8], lanes_b[8];
    int32_t lanes_n[8];
    _mm256_storeu_ps(lanes_a, ma);
    _mm256_storeu_ps(lanes_b, mr);
    _mm256_storeu_si256((__m256i *)lanes_n, nonzero);
    for (int k = 0; k < 8; k++) {
        a = lanes_a[k] > a ? lanes_a[k] : a;
        b = lanes_b[k] > b ? lanes_b[k] : b;
        count += lanes_n[k];
    }
    if (m < n) { /* the tail, by the portable loops, into these maxima */
        uint32_t wide[8];
        Py_ssize_t t = n - m;
        if (f16_convert(in + m, wide, t)) return 1;
        f16_pack(wide, out + m, t);
        int32_t ta, tr, tn;
        f16_errors(in + m, wide, t, &ta, &tr, &tn);
        float fa, fb;
        memcpy(&fa, &ta, 4);
        memcpy(&fb, &tr, 4);
        a = fa > a ? fa : a;
        if (tn) b = fb > b ? fb : b;
        count += tn;
    }
    if (n == 0) return 0;
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    fold(ia, ib, count, n, max_abs, max_rel, seen_abs, seen_rel);
    return 0;
}
#endif

/* Whether this CPU runs block_fast_f16_f16c (set when the module loads). */
static int use_f16c = 0;

static Py_ssize_t block_fast_f16(const uint32_t *in, uint16_t *out, Py_ssize_t n,
                                 float *max_abs, float *max_rel, int *seen_abs, int *seen_rel) {
#ifdef HAVE_F16C_PATH
    if (use_f16c) return block_fast_f16_f16c(in, out, n, max_abs, max_rel, seen_abs, seen_rel);
#endif
    return block_fast_f16_portable(in, out, n, max_abs, max_rel, seen_abs, seen_rel);
}

/* Every case: NaN, infinities, finite values that overflow to infinity. */
static void block_careful(int kind, const uint32_t *in, uint16_t *out, Py_ssize_t n,
                          float *max_abs, float *max_rel, int *seen_abs, int *seen_rel,
                          Py_ssize_t *overflow) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = in[i];
        uint32_t mag = u & 0x7FFFFFFFu;
        uint32_t r;
        int inf_out;
        if (kind == BF16) {
            if (mag > 0x7F800000u) { /* NaN: keep its top bits, set the quiet bit */
                out[i] = (uint16_t)((u >> 16) | 0x40u);
                continue;
            }
            r = to_bf16(u);
            inf_out = (r & 0x7F80u) == 0x7F80u;
        } else {
            r = to_f16_careful(u);
            inf_out = (r & 0x7C00u) == 0x7C00u;
        }
        out[i] = (uint16_t)r;
        if (mag >= 0x7F800000u) continue; /* NaN, infinity: in neither maximum */
        if (inf_out) {                    /* a finite value rounded to infinity */
            (*overflow)++;
            continue;
        }
        float ax = bits_float(mag);
        float d = fabsf(ax - (kind == BF16 ? bf16_mag(r) : f16_mag(r)));
        *seen_abs = 1;
        if (d > *max_abs) *max_abs = d;
        if (mag != 0) {
            float q = d / ax;
            *seen_rel = 1;
            if (q > *max_rel) *max_rel = q;
        }
    }
}

/* -- the module's functions --------------------------------------------------------------- */

static PyObject *cast_f32(PyObject *arg, int kind, const char *name) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len % 4 != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%s: the source is not whole float32s", name);
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
    float max_abs = 0.0f, max_rel = 0.0f;
    int seen_abs = 0, seen_rel = 0;
    Py_ssize_t overflow = 0;
    uint32_t aligned[BLOCK];
    int misaligned = ((uintptr_t)view.buf % 4) != 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        const uint32_t *src = (const uint32_t *)view.buf + start;
        if (misaligned) {
            memcpy(aligned, (const char *)view.buf + start * 4, (size_t)m * 4);
            src = aligned;
        }
        float a = max_abs, b = max_rel;
        int sa = seen_abs, sr = seen_rel;
        Py_ssize_t hits = kind == BF16 ? block_fast_bf16(src, out + start, m, &a, &b, &sa, &sr)
                                       : block_fast_f16(src, out + start, m, &a, &b, &sa, &sr);
        if (hits == 0) {
            max_abs = a;
            max_rel = b;
            seen_abs = sa;
            seen_rel = sr;
        } else {
            block_careful(kind, src, out + start, m, &max_abs, &max_rel, &seen_abs, &seen_rel,
                          &overflow);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    double nan = Py_NAN;
    double abs_out = n == 0 ? 0.0 : (seen_abs ? (double)max_abs : nan);
    double rel_out = n == 0 ? 0.0 : (seen_rel ? (double)max_rel : nan);
    return Py_BuildValue("(Nddn)", result, abs_out, rel_out, overflow);
}

static PyObject *cast_f32_bf16(PyObject *self, PyObject *arg) {
    return cast_f32(arg, BF16, "cast_f32_bf16");
}

static PyObject *cast_f32_f16(PyObject *self, PyObject *arg) {
    return cast_f32(arg, F16, "cast_f32_f16");
}

static PyMethodDef methods[] = {
    {"cast_f32_bf16", cast_f32_bf16, METH_O,
     "float32 bytes -> (bfloat16 bytes, max abs error, max rel error, overflows)."},
    {"cast_f32_f16", cast_f32_f16, METH_O,
     "float32 bytes -> (float16 bytes, max abs error, max rel error, overflows)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "modelsize._speedups",
    "Optional compiled kernels of modelsize (it works without them).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
#ifdef HAVE_F16C_PATH
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
               getenv("MODELSIZE_NO_F16C") == NULL;
#endif
    return PyModule_Create(&module);
}
