/* Per-row peer statistics of a (rows x ranks) block of finite float64 values, the cross-rank
 * analysis' inner loop: for every row its median, its median magnitude (``size``), for every
 * value the median of the other values of its row (``peers``) and the distance to it
 * (``deviation``), and the median of those distances (``mad``).
 *
 * Built by setup.py as the optional extension monitor.anomaly._peer_rows; monitor/anomaly/peers.py
 * keeps its numpy path (three partitions of the block) where it is missing. The caller sorts the
 * rows (numpy's vectorised sort is faster than any selection written here); then everything is
 * linear: the medians are read off the sorted row, and because a value's peers' median is one of
 * two numbers (which one depends only on the value), the distances of the sorted values form two
 * ascending runs (below and above the middle) whose middle is found by merging them halfway. The
 * magnitudes of a sorted row are two ascending runs as well (the negative values reversed, the
 * others). The arithmetic is the numpy path's, operation for operation, so both give the same
 * bits (but for the sign of a zero, and the size of rows holding values beyond half the largest
 * double, where numpy's mean of a value with itself overflows). The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The mean of the order statistics (n - 1) / 2 and n / 2 of the union of the ascending runs
 * a[0..la) and b[0..lb) and, when has_extra, the value extra (n = la + lb + has_extra > 0). */
static double merged_middle(const double *a, Py_ssize_t la, const double *b, Py_ssize_t lb,
                            double extra, int has_extra) {
    Py_ssize_t n = la + lb + has_extra, lower = (n - 1) / 2, upper = n / 2, i = 0, j = 0;
    double low = 0.0, value = 0.0;
    for (Py_ssize_t k = 0; k <= upper; k++) {
        int source = -1;
        if (i < la) {
            value = a[i];
            source = 0;
        }
        if (j < lb && (source < 0 || b[j] < value)) {
            value = b[j];
            source = 1;
        }
        if (has_extra && (source < 0 || extra < value)) {
            value = extra;
            source = 2;
        }
        if (source == 0)
            i++;
        else if (source == 1)
            j++;
        else
            has_extra = 0;
        if (k == lower) low = value;
    }
    return (low + value) / 2.0;
}

typedef struct {
    int odd;
    double low, high;           /* even: the two middle values */
    double centre, p_hi, p_lo, p_mid; /* odd: the middle, and the peers' medians below, above, at it */
} Middle;

/* The median of the other values of a row, for a value x of it. */
static double peer_of(const Middle *m, double x) {
    if (!m->odd) return x <= m->low ? m->high : m->low;
    return x == m->centre ? m->p_mid : x < m->centre ? m->p_hi : m->p_lo;
}

static void one_row(const double *values, const double *sorted, Py_ssize_t n, double *a, double *b,
                    double *median, double *size, double *peers, double *deviation, double *mad) {
    Py_ssize_t half = n / 2;
    Middle m = {(int)(n % 2), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    double extra = 0.0;
    if (m.odd) { /* removing the middle leaves the mean of its neighbours, and so on */
        double below = sorted[half - 1], above = sorted[half + 1];
        m.centre = sorted[half];
        m.p_hi = (m.centre + above) / 2.0;
        m.p_lo = (below + m.centre) / 2.0;
        m.p_mid = (below + above) / 2.0;
        *median = m.centre;
        extra = fabs(m.centre - m.p_mid);
    } else { /* removing a value of the lower half leaves the upper middle, and vice versa */
        m.low = sorted[half - 1];
        m.high = sorted[half];
        *median = (m.low + m.high) / 2.0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        peers[i] = peer_of(&m, values[i]);
        deviation[i] = fabs(values[i] - peers[i]);
    }
    Py_ssize_t upper_start = half + m.odd; /* the sorted values above the middle start here */
    for (Py_ssize_t t = 0; t < half; t++) {
        double x = sorted[half - 1 - t];
        a[t] = fabs(x - peer_of(&m, x));
    }
    for (Py_ssize_t t = 0; t < n - upper_start; t++) {
        double x = sorted[upper_start + t];
        b[t] = fabs(x - peer_of(&m, x));
    }
    *mad = merged_middle(a, half, b, n - upper_start, extra, m.odd);
    if (sorted[0] >= 0) { /* the magnitudes are the values */
        *size = *median;
        return;
    }
    Py_ssize_t zero = 0; /* the first value >= 0 */
    while (zero < n && sorted[zero] < 0) zero++;
    for (Py_ssize_t t = 0; t < zero; t++) a[t] = -sorted[zero - 1 - t];
    *size = merged_middle(a, zero, sorted + zero, n - zero, 0.0, 0);
}

static int get(PyObject *source, Py_buffer *view, Py_ssize_t length, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(source, view, flags) < 0) return -1;
    if (strcmp(view->format, "d") != 0 || view->len != length * (Py_ssize_t)sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd contiguous float64 values", name, length);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *full_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sources[7];
    Py_ssize_t rows, n;
    if (!PyArg_ParseTuple(args, "nnOOOOOOO", &rows, &n, &sources[0], &sources[1], &sources[2],
                          &sources[3], &sources[4], &sources[5], &sources[6]))
        return NULL;
    if (rows < 0 || n < 3) {
        PyErr_SetString(PyExc_ValueError, "full_rows: expected rows >= 0 and ranks >= 3");
        return NULL;
    }
    static const char *names[7] = {"values", "sorted", "median", "size", "peers", "deviation", "mad"};
    const Py_ssize_t lengths[7] = {rows * n, rows * n, rows, rows, rows * n, rows * n, rows};
    Py_buffer views[7];
    for (int v = 0; v < 7; v++) {
        if (get(sources[v], &views[v], lengths[v], v > 1, names[v]) < 0) {
            for (int w = 0; w < v; w++) PyBuffer_Release(&views[w]);
            return NULL;
        }
    }
    double *scratch = malloc(2 * (size_t)n * sizeof(double));
    if (scratch == NULL) {
        for (int v = 0; v < 7; v++) PyBuffer_Release(&views[v]);
        return PyErr_NoMemory();
    }
    const double *values = views[0].buf, *sorted = views[1].buf;
    double *median = views[2].buf, *size = views[3].buf, *peers = views[4].buf;
    double *deviation = views[5].buf, *mad = views[6].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        one_row(values + r * n, sorted + r * n, n, scratch, scratch + n, median + r, size + r,
                peers + r * n, deviation + r * n, mad + r);
    Py_END_ALLOW_THREADS
    free(scratch);
    for (int v = 0; v < 7; v++) PyBuffer_Release(&views[v]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"full_rows", full_rows, METH_VARARGS,
     "full_rows(rows, ranks, values, sorted, median, size, peers, deviation, mad): peer statistics "
     "of (rows x ranks >= 3) finite float64 values, given also with each row sorted, into the "
     "given float64 arrays."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_peer_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__peer_rows(void) { return PyModule_Create(&module); }
