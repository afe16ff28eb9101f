/* One pass over a float32/float64/bfloat16 buffer: min, max, sum, sum of squares, count of |x| < eps,
 * and (only when the sum of squares is not finite) the NaN count, with the sums taken again in
 * double where finite values overflowed the buffer's precision, or tiny ones underflowed it.
 *
 * Built by setup.py as the optional extension monitor.stats._fused_stats; monitor/stats/fused_stats.py
 * falls back to library calls when it is missing. Plain C, no fast-math: the loops keep LANES
 * independent accumulators so the compiler vectorises them without reassociating anything
 * itself. Min and max run on order-preserving integer keys of the bit patterns (integer
 * min/max vectorise; IEEE min/max with NaN rules do not), which also makes them exact for
 * signed zeros and infinities. Sums accumulate in the buffer's precision within blocks of
 * BLOCK elements and in double across blocks. The GIL is released while the loop runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 32
#define BLOCK 16384
/* Software prefetch distance in bytes. The kernel is compute-bound at about 30 GB/s on cached
 * data, and on data that must come from memory (an activation just written by a matmul, moments
 * after the optimizer's step) the core's own miss handling and the arithmetic did not overlap:
 * 8-10 GB/s without prefetching, 14 GB/s (what torch.sum reaches) with it; 8 KiB ahead and more
 * all gave the same. */
#define AHEAD 8192
#define LINE 64

/* ask for the cache lines of bytes [at, at + span) of a buffer of ``size`` bytes; past its end,
 * for its last byte again (clamped, not branched on: GCC drops a prefetch under a condition
 * when it vectorises the loop) */
static inline void prefetch_lines(const void *buffer, Py_ssize_t at, Py_ssize_t span, Py_ssize_t size) {
    for (Py_ssize_t offset = 0; offset < span; offset += LINE) {
        Py_ssize_t byte = at + offset < size ? at + offset : size - 1;
        __builtin_prefetch((const char *)buffer + byte, 0, 2);
    }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* a baseline build plus AVX-512 and AVX2 clones, picked when the module loads: never an
 * instruction the machine lacks (environments are often built on one node, run on another) */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
/* An operation whose input or result is subnormal (below about 1.2e-38 in float32) is some
 * hundred cycles slower on x86: squaring Adam's exp_avg_sq where gradients are tiny (values near
 * 1e-20, squares near 1e-40) made the kernel 3x slower over a whole moment. The main loop runs
 * with flush-to-zero and denormals-are-zero set, and the caller's mode is put back after it;
 * a float32 tensor whose squares underflowed (all values tiny, TINY_SQUARES) has both sums taken
 * again in double, subnormal values included; min and max (integer keys) and the zero count
 * read them exactly. */
#define SUBNORMALS_AS_ZERO unsigned int saved_csr = _mm_getcsr(); _mm_setcsr(saved_csr | 0x8040);
#define RESTORE_FLOAT_MODE _mm_setcsr(saved_csr);
#else
#define SUBNORMALS_AS_ZERO
#define RESTORE_FLOAT_MODE
#endif

/* a sum of squares below this per element may have lost squares under FLOAT's normal range (of
 * values below about 1e-19 in float32, flushed to zero or kept with few digits): it is taken again
 * in double, which such tensors (all their values tiny, zeros aside) alone pay for */
#define TINY_SQUARES 1e-30

typedef struct {
    double low, high, total, squares;
    long long small, nans;
} Result;

#define DEFINE_KERNEL(NAME, STORED, FLOAT, INT, SIGN_SHIFT, MAGNITUDE, LOAD)                   \
    static inline INT NAME##_key(FLOAT v) {                                                   \
        INT bits;                                                                             \
        memcpy(&bits, &v, sizeof bits);                                                       \
        return bits ^ ((bits >> SIGN_SHIFT) & MAGNITUDE);                                     \
    }                                                                                         \
    static inline FLOAT NAME##_value(INT key) {                                               \
        INT bits = key ^ ((key >> SIGN_SHIFT) & MAGNITUDE);                                   \
        FLOAT v;                                                                              \
        memcpy(&v, &bits, sizeof v);                                                          \
        return v;                                                                             \
    }                                                                                         \
    CLONES static void NAME(const STORED *restrict a, Py_ssize_t n, FLOAT eps, Result *out) { \
        SUBNORMALS_AS_ZERO                                                                    \
        INT low[LANES], high[LANES];                                                          \
        long long small = 0;                                                                  \
        double total = 0.0, squares = 0.0;                                                    \
        const Py_ssize_t bytes = sizeof(STORED);                                              \
        INT first = NAME##_key(LOAD(a[0]));                                                   \
        for (int j = 0; j < LANES; j++) {                                                     \
            low[j] = first;                                                                   \
            high[j] = first;                                                                  \
        }                                                                                     \
        for (Py_ssize_t start = 0; start < n; start += BLOCK) {                               \
            Py_ssize_t stop = start + BLOCK < n ? start + BLOCK : n;                          \
            Py_ssize_t full = start + (stop - start) / LANES * LANES;                         \
            FLOAT s[LANES] = {0}, q[LANES] = {0};                                             \
            INT z[LANES] = {0};                                                               \
            for (Py_ssize_t i = start; i < full; i += LANES) {                                \
                prefetch_lines(a, (i + LANES) * bytes + AHEAD, LANES * bytes, n * bytes);     \
                for (int j = 0; j < LANES; j++) {                                             \
                    FLOAT v = LOAD(a[i + j]);                                                 \
                    INT key = NAME##_key(v);                                                  \
                    low[j] = key < low[j] ? key : low[j];                                     \
                    high[j] = key > high[j] ? key : high[j];                                  \
                    s[j] += v;                                                                \
                    q[j] += v * v;                                                            \
                    z[j] += (v < eps) & (v > -eps);                                           \
                }                                                                             \
            }                                                                                 \
            for (Py_ssize_t i = full; i < stop; i++) {                                        \
                FLOAT v = LOAD(a[i]);                                                         \
                INT key = NAME##_key(v);                                                      \
                low[0] = key < low[0] ? key : low[0];                                         \
                high[0] = key > high[0] ? key : high[0];                                      \
                s[0] += v;                                                                    \
                q[0] += v * v;                                                                \
                z[0] += (v < eps) & (v > -eps);                                               \
            }                                                                                 \
            for (int j = 0; j < LANES; j++) {                                                 \
                total += (double)s[j];                                                        \
                squares += (double)q[j];                                                      \
                small += z[j];                                                                \
            }                                                                                 \
        }                                                                                     \
        RESTORE_FLOAT_MODE /* before min and max become doubles: DAZ would flush subnormals */  \
        INT lowest = low[0], highest = high[0];                                               \
        for (int j = 1; j < LANES; j++) {                                                     \
            lowest = low[j] < lowest ? low[j] : lowest;                                       \
            highest = high[j] > highest ? high[j] : highest;                                  \
        }                                                                                     \
        out->low = NAME##_value(lowest);                                                      \
        out->high = NAME##_value(highest);                                                    \
        out->total = total;                                                                   \
        out->squares = squares;                                                               \
        out->small = small;                                                                   \
        out->nans = 0;                                                                        \
        if (!isfinite(squares)) { /* only then can the buffer hold a NaN or an Inf, or finite \
                                     values whose squares overflowed FLOAT: summed again in   \
                                     double, as the reference sums them */                    \
            long long nans = 0;                                                               \
            int infinite = 0;                                                                 \
            double wide_total = 0.0, wide_squares = 0.0;                                      \
            for (Py_ssize_t i = 0; i < n; i++) {                                              \
                double v = (double)LOAD(a[i]);                                                \
                nans += isnan(v);                                                             \
                infinite |= isinf(v);                                                         \
                wide_total += v;                                                              \
                wide_squares += v * v;                                                        \
            }                                                                                 \
            out->nans = nans;                                                                 \
            if (nans) out->low = out->high = NAN;                                             \
            if (!nans && !infinite) {                                                         \
                out->total = wide_total;                                                      \
                out->squares = wide_squares;                                                  \
            }                                                                                 \
        } else if (sizeof(FLOAT) == 4 && squares < (double)n * TINY_SQUARES &&                \
                   (out->low != 0 || out->high != 0)) {                                       \
            double wide_total = 0.0, wide_squares = 0.0; /* in the caller's mode: exact */    \
            for (Py_ssize_t i = 0; i < n; i++) {                                              \
                double v = (double)LOAD(a[i]);                                                \
                wide_total += v;                                                              \
                wide_squares += v * v;                                                        \
            }                                                                                 \
            out->total = wide_total;                                                          \
            out->squares = wide_squares;                                                      \
        }                                                                                     \
    }

#define AS_IS(x) (x)

/* bfloat16 is the upper half of a float32: widening is a shift, done in registers, so a bf16
 * buffer is read at 2 bytes an element with no upcast copy */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

DEFINE_KERNEL(stats_f32, float, float, int32_t, 31, INT32_C(0x7FFFFFFF), AS_IS)
DEFINE_KERNEL(stats_f64, double, double, int64_t, 63, INT64_C(0x7FFFFFFFFFFFFFFF), AS_IS)
DEFINE_KERNEL(stats_bf16, uint16_t, float, int32_t, 31, INT32_C(0x7FFFFFFF), bf16_to_f32)

static PyObject *stats(PyObject *self, PyObject *args) {
    PyObject *source;
    double eps;
    int bfloat16 = 0;
    if (!PyArg_ParseTuple(args, "Od|p", &source, &eps, &bfloat16)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    const char *format = view.format ? view.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    int is_f32 = !bfloat16 && strcmp(format, "f") == 0 && view.itemsize == 4;
    int is_f64 = !bfloat16 && strcmp(format, "d") == 0 && view.itemsize == 8;
    int is_bf16 = bfloat16 && (strcmp(format, "h") == 0 || strcmp(format, "H") == 0) && view.itemsize == 2;
    Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    if (!(is_f32 || is_f64 || is_bf16) || n == 0) {
        PyErr_Format(PyExc_TypeError,
                     "stats: expected a non-empty contiguous float32/float64 buffer, or int16 bits with "
                     "bfloat16=True, got format '%s' with %zd elements (bfloat16=%d)",
                     view.format ? view.format : "B", n, bfloat16);
        PyBuffer_Release(&view);
        return NULL;
    }
    Result out;
    Py_BEGIN_ALLOW_THREADS
    if (is_f32)
        stats_f32((const float *)view.buf, n, (float)eps, &out);
    else if (is_f64)
        stats_f64((const double *)view.buf, n, eps, &out);
    else
        stats_bf16((const uint16_t *)view.buf, n, (float)eps, &out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(ddddLL)", out.low, out.high, out.total, out.squares, out.small, out.nans);
}

/* Element kinds of the address entries (the caller vouches that the memory is alive, contiguous
 * and of that kind: they take addresses of tensors it holds) */
enum { KIND_F32 = 0, KIND_F64 = 1, KIND_BF16 = 2 };

static void run_kernel(int kind, const void *data, Py_ssize_t n, double eps, Result *out) {
    if (kind == KIND_F32)
        stats_f32((const float *)data, n, (float)eps, out);
    else if (kind == KIND_F64)
        stats_f64((const double *)data, n, eps, out);
    else
        stats_bf16((const uint16_t *)data, n, (float)eps, out);
}

static int check_kind(int kind) {
    if (kind == KIND_F32 || kind == KIND_F64 || kind == KIND_BF16) return 0;
    PyErr_Format(PyExc_ValueError, "kind must be 0 (float32), 1 (float64) or 2 (bfloat16), got %d", kind);
    return -1;
}

static Py_ssize_t kind_size(int kind) { return kind == KIND_F64 ? 8 : kind == KIND_F32 ? 4 : 2; }

/* The lower / higher of two results' extremes, -0 below +0 as the kernel orders them */
static double lower(double a, double b) { return (b < a || (b == a && signbit(b))) ? b : a; }
static double higher(double a, double b) { return (b > a || (b == a && !signbit(b))) ? b : a; }

/* ``rows`` runs of ``run`` contiguous elements, ``stride`` elements apart (a strided view such
 * as one of the pieces a split gives): each run read in place, the results merged */
static void run_rows(int kind, const char *data, Py_ssize_t run, Py_ssize_t rows, Py_ssize_t stride,
                     double eps, Result *out) {
    run_kernel(kind, data, run, eps, out);
    if (rows < 2) return; /* one run: the stride means nothing (and may be 0) */
    Py_ssize_t step = stride * kind_size(kind); /* no overflow, and >= run: checked by the caller */
    Py_ssize_t span = run * kind_size(kind), size = (rows - 1) * step + span;
    /* the start of the row AHEAD bytes on: a run's own prefetching stops at its end */
    Py_ssize_t ahead = AHEAD / step + 1, head = span < AHEAD ? span : AHEAD;
    for (Py_ssize_t r = 1; r < rows; r++) {
        Result part;
        prefetch_lines(data, (r + ahead) * step, head, size);
        run_kernel(kind, data + r * step, run, eps, &part);
        out->low = lower(out->low, part.low);
        out->high = higher(out->high, part.high);
        out->total += part.total;
        out->squares += part.squares;
        out->small += part.small;
        out->nans += part.nans;
    }
    if (out->nans) out->low = out->high = NAN;
}

static PyObject *stats_rows(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t run, rows, stride;
    int kind;
    double eps;
    if (!PyArg_ParseTuple(args, "Knnnid", &address, &run, &rows, &stride, &kind, &eps)) return NULL;
    if (check_kind(kind) < 0) return NULL;
    Py_ssize_t size = kind_size(kind);
    if (address == 0 || run <= 0 || rows <= 0 || (rows > 1 && stride < run) ||
        (rows > 1 && stride > PY_SSIZE_T_MAX / size / rows)) {
        PyErr_Format(PyExc_ValueError,
                     "stats_rows: expected a non-null address, run > 0, rows > 0 and run <= stride "
                     "within the address space, got run=%zd rows=%zd stride=%zd", run, rows, stride);
        return NULL;
    }
    Result out;
    Py_BEGIN_ALLOW_THREADS
    run_rows(kind, (const char *)(uintptr_t)address, run, rows, stride, eps, &out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddddLL)", out.low, out.high, out.total, out.squares, out.small, out.nans);
}

static void store_row(double *row, const Result *r) {
    row[0] = r->low;
    row[1] = r->high;
    row[2] = r->total;
    row[3] = r->squares;
    row[4] = (double)r->small;
    row[5] = (double)r->nans;
}

static PyObject *stats_into(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n, row;
    int kind;
    double eps;
    PyObject *out_source;
    if (!PyArg_ParseTuple(args, "KnidOn", &address, &n, &kind, &eps, &out_source, &row)) return NULL;
    if (check_kind(kind) < 0) return NULL;
    if (address == 0 || n <= 0) {
        PyErr_Format(PyExc_ValueError, "stats_into: expected a non-null address and n > 0, got n=%zd", n);
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(out_source, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return NULL;
    const char *format = out.format ? out.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    if (out.itemsize != 8 || strcmp(format, "d") != 0 || out.len % 48 != 0 || row < 0 || row >= out.len / 48) {
        PyErr_Format(PyExc_ValueError, "stats_into: expected a writable float64 (rows, 6) output and 0 <= row < rows, "
                     "got '%s' of %zd bytes and row %zd", out.format ? out.format : "B", out.len, row);
        PyBuffer_Release(&out);
        return NULL;
    }
    Result r;
    Py_BEGIN_ALLOW_THREADS
    run_kernel(kind, (const void *)(uintptr_t)address, n, eps, &r);
    Py_END_ALLOW_THREADS
    store_row((double *)out.buf + 6 * row, &r);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static int int64_buffer(PyObject *source, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(source, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *format = view->format ? view->format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    if (view->itemsize != 8 || strchr("lqLQ", *format) == NULL || format[1] != 0) {
        PyErr_Format(PyExc_TypeError, "stats_many: %s must be a contiguous 64-bit integer buffer, got '%s'",
                     what, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *stats_many(PyObject *self, PyObject *args) {
    PyObject *address_source, *count_source, *out_source;
    int kind;
    double eps;
    if (!PyArg_ParseTuple(args, "OOidO", &address_source, &count_source, &kind, &eps, &out_source)) return NULL;
    if (check_kind(kind) < 0) return NULL;
    Py_buffer addresses, counts, out;
    if (int64_buffer(address_source, &addresses, "addresses") < 0) return NULL;
    if (int64_buffer(count_source, &counts, "counts") < 0) {
        PyBuffer_Release(&addresses);
        return NULL;
    }
    if (PyObject_GetBuffer(out_source, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&addresses);
        PyBuffer_Release(&counts);
        return NULL;
    }
    Py_ssize_t n = addresses.len / 8;
    const char *format = out.format ? out.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    const long long *address = (const long long *)addresses.buf, *count = (const long long *)counts.buf;
    int bad = counts.len / 8 != n || out.itemsize != 8 || strcmp(format, "d") != 0 || out.len / 8 != 6 * n;
    for (Py_ssize_t i = 0; !bad && i < n; i++) bad = address[i] == 0 || count[i] <= 0;
    if (bad) {
        PyErr_Format(PyExc_ValueError,
                     "stats_many: expected n non-null addresses, n counts > 0 and a writable float64 output "
                     "of n x 6, got %zd addresses, %zd counts, output '%s' of %zd bytes",
                     n, counts.len / 8, out.format ? out.format : "B", out.len);
    } else {
        double *rows = (double *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            Result r;
            run_kernel(kind, (const void *)(uintptr_t)address[i], (Py_ssize_t)count[i], eps, &r);
            store_row(rows + 6 * i, &r);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&addresses);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* sum over i of sign(a[i]) * sign(b[i]): how far a gradient and a moment agree in sign
 * (mg_direction), without the two sign tensors and their product. The sign of a NaN is 0, as
 * torch.sign gives it (on CPU and CUDA), so both paths of the adapter agree. */
#define DEFINE_SIGNS(NAME, STORED, FLOAT, LOAD)                                         \
    CLONES static double NAME(const STORED *restrict a, const STORED *restrict b, Py_ssize_t n) { \
        long long sum = 0;                                                              \
        const Py_ssize_t bytes = sizeof(STORED), run = 4 * LINE / sizeof(STORED);         \
        const Py_ssize_t full = n / run * run;                                          \
        for (Py_ssize_t start = 0; start < full; start += run) {                        \
            prefetch_lines(a, start * bytes + AHEAD, 4 * LINE, n * bytes);              \
            prefetch_lines(b, start * bytes + AHEAD, 4 * LINE, n * bytes);              \
            for (Py_ssize_t i = start; i < start + run; i++) {                          \
                FLOAT x = LOAD(a[i]), y = LOAD(b[i]);                                   \
                sum += ((x > 0) - (x < 0)) * ((y > 0) - (y < 0));                       \
            }                                                                           \
        }                                                                               \
        for (Py_ssize_t i = full; i < n; i++) {                                         \
            FLOAT x = LOAD(a[i]), y = LOAD(b[i]);                                       \
            sum += ((x > 0) - (x < 0)) * ((y > 0) - (y < 0));                           \
        }                                                                               \
        return (double)sum;                                                             \
    }

DEFINE_SIGNS(signs_f32, float, float, AS_IS)
DEFINE_SIGNS(signs_f64, double, double, AS_IS)
DEFINE_SIGNS(signs_bf16, uint16_t, float, bf16_to_f32)

static PyObject *sign_sums_many(PyObject *self, PyObject *args) {
    PyObject *first_source, *second_source, *count_source, *out_source;
    int kind;
    if (!PyArg_ParseTuple(args, "OOOiO", &first_source, &second_source, &count_source, &kind, &out_source))
        return NULL;
    if (check_kind(kind) < 0) return NULL;
    Py_buffer first, second, counts, out;
    if (int64_buffer(first_source, &first, "first addresses") < 0) return NULL;
    if (int64_buffer(second_source, &second, "second addresses") < 0) {
        PyBuffer_Release(&first);
        return NULL;
    }
    if (int64_buffer(count_source, &counts, "counts") < 0) {
        PyBuffer_Release(&first);
        PyBuffer_Release(&second);
        return NULL;
    }
    if (PyObject_GetBuffer(out_source, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&first);
        PyBuffer_Release(&second);
        PyBuffer_Release(&counts);
        return NULL;
    }
    Py_ssize_t n = first.len / 8;
    const char *format = out.format ? out.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    const long long *a = (const long long *)first.buf, *b = (const long long *)second.buf;
    const long long *count = (const long long *)counts.buf;
    int bad = second.len / 8 != n || counts.len / 8 != n || out.itemsize != 8 || strcmp(format, "d") != 0 ||
              out.len / 8 != n;
    for (Py_ssize_t i = 0; !bad && i < n; i++) bad = a[i] == 0 || b[i] == 0 || count[i] <= 0;
    if (bad) {
        PyErr_Format(PyExc_ValueError,
                     "sign_sums_many: expected n non-null addresses twice, n counts > 0 and a writable "
                     "float64 output of n, got %zd, %zd, %zd and %zd bytes",
                     n, second.len / 8, counts.len / 8, out.len);
    } else {
        double *sums = (double *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const void *x = (const void *)(uintptr_t)a[i], *y = (const void *)(uintptr_t)b[i];
            Py_ssize_t m = (Py_ssize_t)count[i];
            sums[i] = kind == KIND_F32   ? signs_f32((const float *)x, (const float *)y, m)
                      : kind == KIND_F64 ? signs_f64((const double *)x, (const double *)y, m)
                                         : signs_bf16((const uint16_t *)x, (const uint16_t *)y, m);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&first);
    PyBuffer_Release(&second);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {  /* documented in monitor/stats/fused_stats.py */
    {"sign_sums_many", sign_sums_many, METH_VARARGS, "sign_sums_many(first, second, counts, kind, out)"},
    {"stats", stats, METH_VARARGS, "stats(buffer, eps, bfloat16=False) -> (min, max, sum, squares, small, nans)"},
    {"stats_rows", stats_rows, METH_VARARGS, "stats_rows(address, run, rows, stride, kind, eps) -> the tuple"},
    {"stats_into", stats_into, METH_VARARGS, "stats_into(address, n, kind, eps, out, row)"},
    {"stats_many", stats_many, METH_VARARGS, "stats_many(addresses, counts, kind, eps, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_stats", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused_stats(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0 || PyModule_AddIntConstant(m, "LANES", LANES) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
