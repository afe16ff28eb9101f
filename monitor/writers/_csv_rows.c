/* CSV rows of statistics: the text of ``head + step + tail + values``, each value as C's and
 * Python's ``%.{digits}g`` writes it, without a Python object per value.
 *
 * Built by setup.py as the optional extension monitor.writers._csv_rows; monitor/writers/csv.py
 * keeps Python's %-formatting where it is missing. Python's and glibc's %g round correctly (to
 * the nearest, ties to even, on the exact binary value), which costs 0.3 us a value. Here a
 * value is scaled by an exact power of ten (10^0 .. 10^22) into [10^(d-1), 10^d) with one
 * rounding (at most 2^-53 relative); where the scaled value is within a few of those of a tie,
 * or the power is not exact, or d > 15, snprintf decides. The output is
 * therefore the same text as snprintf's, byte for byte (tests compare millions of values). The
 * GIL is released while rows are written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

/* the most a value can take: sign, 17 digits, point, "e-308", with room to spare */
#define VALUE_ROOM 32
#define EXACT_POWERS 23

static const double POWERS[EXACT_POWERS] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                            1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                            1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* %g of a finite nonzero |x| from its rounded digits: ``mantissa`` has exactly ``digits``
 * digits and the value is mantissa * 10^(exponent - digits + 1). */
static int layout(char *out, int negative, uint64_t mantissa, int digits, int exponent) {
    char text[24];
    for (int i = digits - 1; i >= 0; i--) {
        text[i] = (char)('0' + mantissa % 10);
        mantissa /= 10;
    }
    int used = digits;
    while (used > 1 && text[used - 1] == '0') used--; /* %g drops trailing zeros */
    char *p = out;
    if (negative) *p++ = '-';
    if (exponent >= -4 && exponent < digits) {
        if (exponent >= 0) {
            for (int i = 0; i <= exponent; i++) *p++ = i < used ? text[i] : '0';
            if (used > exponent + 1) {
                *p++ = '.';
                for (int i = exponent + 1; i < used; i++) *p++ = text[i];
            }
        } else {
            *p++ = '0';
            *p++ = '.';
            for (int i = 0; i < -exponent - 1; i++) *p++ = '0';
            for (int i = 0; i < used; i++) *p++ = text[i];
        }
    } else {
        *p++ = text[0];
        if (used > 1) {
            *p++ = '.';
            for (int i = 1; i < used; i++) *p++ = text[i];
        }
        *p++ = 'e';
        *p++ = exponent < 0 ? '-' : '+';
        int magnitude = exponent < 0 ? -exponent : exponent;
        if (magnitude >= 100) *p++ = (char)('0' + magnitude / 100);
        *p++ = (char)('0' + magnitude / 10 % 10);
        *p++ = (char)('0' + magnitude % 10);
    }
    return (int)(p - out);
}

/* the digits of |x| rounded to ``digits`` significant ones, where one scaling decides them
 * for certain; 0 where snprintf must */
static int quick(char *out, double x, int digits) {
    if (digits > 15) return 0;
    int negative = signbit(x) != 0;
    double magnitude = fabs(x);
    int exponent = (int)floor(log10(magnitude));
    for (int attempt = 0; attempt < 2; attempt++) {
        int shift = digits - 1 - exponent;
        if (shift >= EXACT_POWERS || shift <= -EXACT_POWERS) return 0;
        double scaled = shift >= 0 ? magnitude * POWERS[shift] : magnitude / POWERS[-shift];
        double low = POWERS[digits - 1], high = POWERS[digits];
        if (scaled < low) { /* log10 was one too high */
            exponent--;
            continue;
        }
        if (scaled >= high) {
            exponent++;
            continue;
        }
        double whole = floor(scaled), fraction = scaled - whole;
        /* the scaling's one rounding moved ``scaled`` by at most half a unit in its last place
         * (2^-53 relative): within a few of those from a tie, only exact arithmetic can tell */
        if (fabs(fraction - 0.5) <= 1e-15 * high) return 0;
        uint64_t mantissa = (uint64_t)whole + (fraction > 0.5);
        if ((double)mantissa >= high) { /* rounded up to the next power of ten */
            mantissa /= 10;
            exponent++;
        }
        return layout(out, negative, mantissa, digits, exponent);
    }
    return 0;
}

/* ``%.{digits}g`` of x, as Python writes it ("nan" whatever NaN's sign) */
static int format_value(char *out, double x, int digits) {
    if (isnan(x)) {
        memcpy(out, "nan", 3);
        return 3;
    }
    if (isinf(x)) {
        if (x < 0) {
            memcpy(out, "-inf", 4);
            return 4;
        }
        memcpy(out, "inf", 3);
        return 3;
    }
    if (x == 0) {
        if (signbit(x)) {
            memcpy(out, "-0", 2);
            return 2;
        }
        out[0] = '0';
        return 1;
    }
    int written = quick(out, x, digits);
    return written ? written : snprintf(out, VALUE_ROOM, "%.*g", digits, x);
}

static PyObject *format_one(PyObject *self, PyObject *args) {
    double x;
    int digits;
    if (!PyArg_ParseTuple(args, "di", &x, &digits)) return NULL;
    if (digits < 1 || digits > 17) {
        PyErr_Format(PyExc_ValueError, "format_value: digits must be 1 to 17, got %d", digits);
        return NULL;
    }
    char out[VALUE_ROOM];
    int n = format_value(out, x, digits);
    return PyUnicode_FromStringAndSize(out, n);
}

/* UTF-8 text of each str of a list of n (borrowed: the list keeps them alive) */
static int texts(PyObject *list, Py_ssize_t n, const char **text, Py_ssize_t *size, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "format_rows: %s must be a list of %zd str", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        text[i] = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(list, i), &size[i]);
        if (text[i] == NULL) return -1;
    }
    return 0;
}

static PyObject *format_rows(PyObject *self, PyObject *args) {
    PyObject *heads, *tails, *values_source, *digits_source;
    const char *step;
    Py_ssize_t step_size;
    if (!PyArg_ParseTuple(args, "Os#OOO", &heads, &step, &step_size, &tails, &values_source, &digits_source))
        return NULL;
    Py_buffer values, digits;
    if (PyObject_GetBuffer(values_source, &values, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0)
        return NULL;
    if (PyObject_GetBuffer(digits_source, &digits, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    PyObject *result = NULL;
    const char **text = NULL;
    Py_ssize_t *size = NULL;
    char *buffer = NULL;
    const char *vformat = values.format ? values.format : "B", *dformat = digits.format ? digits.format : "B";
    if (*vformat == '<' || *vformat == '=' || *vformat == '@') vformat++;
    if (*dformat == '<' || *dformat == '=' || *dformat == '@') dformat++;
    if (values.ndim != 2 || values.itemsize != 8 || strcmp(vformat, "d") != 0 || digits.itemsize != 4 ||
        strcmp(dformat, "i") != 0 || digits.len / 4 != values.shape[1]) {
        PyErr_SetString(PyExc_ValueError,
                        "format_rows: expected a C-contiguous float64 (rows, columns) array and int32 "
                        "digits per column");
        goto done;
    }
    Py_ssize_t rows = values.shape[0], columns = values.shape[1];
    const int *column_digits = (const int *)digits.buf;
    for (Py_ssize_t j = 0; j < columns; j++) {
        if (column_digits[j] < 1 || column_digits[j] > 17) {
            PyErr_Format(PyExc_ValueError, "format_rows: digits must be 1 to 17, got %d", column_digits[j]);
            goto done;
        }
    }
    text = PyMem_Malloc(sizeof(char *) * 2 * (rows ? rows : 1));
    size = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (rows ? rows : 1));
    if (text == NULL || size == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (texts(heads, rows, text, size, "heads") < 0 || texts(tails, rows, text + rows, size + rows, "tails") < 0)
        goto done;
    Py_ssize_t room = rows * (step_size + 1 + columns * (VALUE_ROOM + 1));
    for (Py_ssize_t i = 0; i < 2 * rows; i++) room += size[i];
    buffer = PyMem_RawMalloc(room ? room : 1);
    if (buffer == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char *p = buffer;
    const double *x = (const double *)values.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++) {
        memcpy(p, text[i], size[i]);
        p += size[i];
        memcpy(p, step, step_size);
        p += step_size;
        memcpy(p, text[rows + i], size[rows + i]);
        p += size[rows + i];
        for (Py_ssize_t j = 0; j < columns; j++) {
            if (j) *p++ = ',';
            p += format_value(p, x[i * columns + j], column_digits[j]);
        }
        *p++ = '\n';
    }
    Py_END_ALLOW_THREADS
    result = PyUnicode_DecodeUTF8(buffer, p - buffer, "strict");
done:
    PyMem_RawFree(buffer);
    PyMem_Free(text);
    PyMem_Free(size);
    PyBuffer_Release(&values);
    PyBuffer_Release(&digits);
    return result;
}

static PyMethodDef methods[] = {
    {"format_value", format_one, METH_VARARGS,
     "format_value(x, digits) -> str: '%.{digits}g' % x, as Python writes it (digits 1 to 17)"},
    {"format_rows", format_rows, METH_VARARGS,
     "format_rows(heads, step, tails, values, digits) -> str: per row i, heads[i] + step + tails[i] + "
     "the row's values joined by ',' (column j as '%.{digits[j]}g') + newline; values a float64 "
     "(rows, columns) array, digits an int32 array of one entry per column"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_csv_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__csv_rows(void) { return PyModule_Create(&module); }
