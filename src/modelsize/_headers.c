/* modelsize._headers: the common entries of a safetensors header and the records and local
 * headers of a zip archive, read in C (optional: the package works without it, and
 * modelsize.formats.safetensors and modelsize.formats._zip read them themselves). Each function
 * takes only what passes every check of the Python loop it stands in for, and stops before
 * anything else: that loop takes it, and says what is wrong.
 *
 * scan_safetensors(raw, pos, data_size, known, shapes, names, dtypes, shape_col)
 *     -> (pos, closed, begins, ends)
 *
 *   Scans the tensor entries of a header written the way the safetensors library writes it,
 *   starting at ``pos`` (the start of an entry: just past the opening brace or a comma), and
 *   appends each to the columns exactly as formats/safetensors.py's _scan_compact does:
 *   the name (str) to ``names``, the canonical dtype (str) to ``dtypes``, the shape (tuple,
 *   shared through ``shapes``: shape text bytes -> (tuple, element count or None)) to
 *   ``shape_col``; ``begins`` and ``ends`` come back as native int64 bytes for
 *   array("q").frombytes.
 *
 *   It takes only entries in compact form whose every check passes:
 *
 *       "NAME":{"dtype":"DT","shape":[D,...],"data_offsets":[B,E]}   then  ,  or  }
 *
 *   with no whitespace, a NAME with no backslash or control byte that is valid UTF-8 and not
 *   ``__metadata__``, numbers as JSON writes them (no leading zero) of at most 18 digits, at
 *   most 64 dimensions, a DT found in ``known`` (dtype text bytes -> (canonical name,
 *   bytes per element), dtypes of one element per block only), 0 <= B <= E <= data_size and
 *   E - B the shape's bytes. It stops before any other entry (and returns ``closed`` false,
 *   ``pos`` that entry's start): the Python scanner takes that entry (with its whitespace,
 *   escapes, metadata, error messages) and calls it again. ``closed`` is true when an entry
 *   ended with the closing brace (``pos`` is then just past it).
 *
 *   It reads nothing outside ``raw``, never recurses, and calls nothing but the dict and list
 *   functions of the objects it is given.
 *
 * setup_zip, central_records, check_records, local_headers: the loops of _zip._directory,
 *   _zip._check_directory and _zip.members (see each below). They read only the bytes they are
 *   given (and, for local headers far apart, 256 bytes at a header with pread), keep every
 *   value below 2**62, and make the same Entry and Member tuples.
 *
 * tests/formats/test_safetensors_compiled.py and test_zip_compiled.py read every input both
 * ways and compare; after changing this file, also run scripts/check_parsers.py: mutated headers
 * and archives both ways with this file built under AddressSanitizer and UBSan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifndef _WIN32
#include <unistd.h>
#else
#define pread(fd, buf, n, at) (-1) /* no positioned read: the window's headers only */
#endif

#define MAX_DIMS 64
#define MAX_DIGITS 18
#define MAX_SHAPES (1 << 16)
/* Data areas up to 2**56 bytes: data_size * 32 + 1 and count * (64 bytes or less) fit int64. */
#define MAX_DATA ((long long)1 << 56)

/* A growable column of int64. */
typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Col;

static int col_push(Col *c, int64_t x) {
    if (c->n == c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 256;
        int64_t *v = PyMem_Realloc(c->v, (size_t)cap * sizeof(int64_t));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->v = v;
        c->cap = cap;
    }
    c->v[c->n++] = x;
    return 0;
}

/* ``lit`` at ``*p`` (and advance past it), or 0. */
static inline int take(const char *s, Py_ssize_t n, Py_ssize_t *p, const char *lit,
                       Py_ssize_t len) {
    if (n - *p < len || memcmp(s + *p, lit, (size_t)len) != 0)
        return 0;
    *p += len;
    return 1;
}
#define TAKE(lit) take(s, n, &p, lit, (Py_ssize_t)(sizeof(lit) - 1))

/* A JSON integer as the compact regex takes it (0, or no leading zero), at most MAX_DIGITS
 * digits; 0 where there is none or it is longer. */
static inline int number(const char *s, Py_ssize_t n, Py_ssize_t *p, int64_t *out) {
    Py_ssize_t q = *p;
    if (q >= n || s[q] < '0' || s[q] > '9')
        return 0;
    if (s[q] == '0') {
        if (q + 1 < n && s[q + 1] >= '0' && s[q + 1] <= '9')
            return 0;
        *out = 0;
        *p = q + 1;
        return 1;
    }
    int64_t v = 0;
    Py_ssize_t start = q;
    while (q < n && s[q] >= '0' && s[q] <= '9') {
        if (q - start >= MAX_DIGITS)
            return 0;
        v = v * 10 + (s[q] - '0');
        q++;
    }
    *out = v;
    *p = q;
    return 1;
}

static PyObject *col_bytes(Col *c) {
    return PyBytes_FromStringAndSize((const char *)c->v, c->n * (Py_ssize_t)sizeof(int64_t));
}

static PyObject *scan_safetensors(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t pos;
    long long data_size;
    PyObject *known, *shapes, *names, *dtypes, *shape_col;
    if (!PyArg_ParseTuple(args, "y*nLO!O!O!O!O!", &buf, &pos, &data_size, &PyDict_Type, &known,
                          &PyDict_Type, &shapes, &PyList_Type, &names, &PyList_Type, &dtypes,
                          &PyList_Type, &shape_col))
        return NULL;
    const char *s = (const char *)buf.buf;
    Py_ssize_t n = buf.len;
    Col begins = {NULL, 0, 0}, ends = {NULL, 0, 0};
    PyObject *result = NULL;
    int closed = 0;
    /* The last dtype and shape met, with what they resolved to (most entries repeat them). */
    const char *last_dt = NULL;
    Py_ssize_t last_dt_len = 0;
    PyObject *canon = NULL; /* borrowed from known's value */
    int64_t itemsize = 0;
    const char *last_shape = NULL;
    Py_ssize_t last_shape_len = 0;
    PyObject *shape = NULL; /* borrowed from shapes' value */
    int64_t count = 0;
    int64_t dims[MAX_DIMS];
    if (pos < 0 || pos > n || data_size < 0) {
        PyErr_SetString(PyExc_ValueError, "position or data size out of range");
        goto done;
    }

    for (;;) {
        Py_ssize_t p = pos;
        if (data_size > MAX_DATA)
            break; /* (the bounds below would overflow: the Python scanner takes them all) */
        /* "NAME" */
        if (p >= n || s[p] != '"')
            break;
        Py_ssize_t name_at = ++p;
        while (p < n && s[p] != '"') {
            unsigned char c = (unsigned char)s[p];
            if (c == '\\' || c < 0x20)
                goto stop;
            p++;
        }
        if (p >= n)
            break;
        Py_ssize_t name_len = p - name_at;
        p++;
        if (name_len == 12 && memcmp(s + name_at, "__metadata__", 12) == 0)
            break;
        if (!TAKE(":{\"dtype\":\""))
            break;
        Py_ssize_t dt_at = p;
        while (p < n && p - dt_at <= 40 &&
               ((s[p] >= 'A' && s[p] <= 'Z') || (s[p] >= 'a' && s[p] <= 'z') ||
                (s[p] >= '0' && s[p] <= '9') || s[p] == '_'))
            p++;
        Py_ssize_t dt_len = p - dt_at;
        if (dt_len < 1 || dt_len > 40)
            break;
        if (!TAKE("\",\"shape\":["))
            break;
        Py_ssize_t shape_at = p;
        int ndim = 0;
        if (p < n && s[p] == ']') {
            p++;
        } else {
            for (;;) {
                if (ndim == MAX_DIMS || !number(s, n, &p, &dims[ndim]))
                    goto stop;
                ndim++;
                if (p < n && s[p] == ',') {
                    p++;
                    continue;
                }
                if (p < n && s[p] == ']') {
                    p++;
                    break;
                }
                goto stop;
            }
        }
        Py_ssize_t shape_len = p - 1 - shape_at;
        int64_t begin, end;
        if (!TAKE(",\"data_offsets\":[") || !number(s, n, &p, &begin) || !TAKE(",") ||
            !number(s, n, &p, &end) || !TAKE("]}"))
            break;
        if (p >= n || (s[p] != ',' && s[p] != '}'))
            break;
        char close = s[p++];

        /* the dtype */
        if (last_dt == NULL || dt_len != last_dt_len || memcmp(s + dt_at, last_dt, (size_t)dt_len)) {
            PyObject *key = PyBytes_FromStringAndSize(s + dt_at, dt_len);
            if (key == NULL)
                goto done;
            PyObject *found = PyDict_GetItemWithError(known, key);
            Py_DECREF(key);
            if (found == NULL) {
                if (PyErr_Occurred())
                    goto done;
                break;
            }
            if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 2 ||
                !PyUnicode_Check(PyTuple_GET_ITEM(found, 0)) ||
                !PyLong_Check(PyTuple_GET_ITEM(found, 1))) {
                PyErr_SetString(PyExc_TypeError, "known: expected (str, int) values");
                goto done;
            }
            long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(found, 1));
            if (size == -1 && PyErr_Occurred())
                goto done;
            if (size < 1 || size > 64) {
                PyErr_SetString(PyExc_ValueError, "known: bytes per element out of range");
                goto done;
            }
            last_dt = s + dt_at;
            last_dt_len = dt_len;
            canon = PyTuple_GET_ITEM(found, 0);
            itemsize = size;
        }
        /* the shape */
        if (last_shape == NULL || shape_len != last_shape_len ||
            memcmp(s + shape_at, last_shape, (size_t)shape_len)) {
            PyObject *key = PyBytes_FromStringAndSize(s + shape_at, shape_len);
            if (key == NULL)
                goto done;
            PyObject *seen = PyDict_GetItemWithError(shapes, key);
            if (seen == NULL && PyErr_Occurred()) {
                Py_DECREF(key);
                goto done;
            }
            if (seen == NULL) {
                /* Python's _bounded_numel(shape, data_size * 32 + 1): None past the limit. */
                int64_t limit = data_size * 32 + 1, c = 1;
                int over = 0, zero = 0;
                for (int i = 0; i < ndim; i++)
                    if (dims[i] == 0)
                        zero = 1;
                if (zero) {
                    c = 0;
                } else {
                    for (int i = 0; i < ndim; i++) {
                        /* c <= limit < 2**63 / 2**60 and dims[i] < 10**18: checked before */
                        if (dims[i] > limit / c) {
                            over = 1;
                            break;
                        }
                        c *= dims[i];
                    }
                }
                PyObject *tuple = PyTuple_New(ndim);
                if (tuple == NULL) {
                    Py_DECREF(key);
                    goto done;
                }
                for (int i = 0; i < ndim; i++) {
                    PyObject *d = PyLong_FromLongLong(dims[i]);
                    if (d == NULL) {
                        Py_DECREF(tuple);
                        Py_DECREF(key);
                        goto done;
                    }
                    PyTuple_SET_ITEM(tuple, i, d);
                }
                PyObject *cnt = over ? Py_NewRef(Py_None) : PyLong_FromLongLong(c);
                PyObject *pair = cnt == NULL ? NULL : PyTuple_Pack(2, tuple, cnt);
                Py_DECREF(tuple);
                Py_XDECREF(cnt);
                if (pair == NULL) {
                    Py_DECREF(key);
                    goto done;
                }
                if (PyDict_GET_SIZE(shapes) < MAX_SHAPES) {
                    if (PyDict_SetItem(shapes, key, pair) < 0) {
                        Py_DECREF(pair);
                        Py_DECREF(key);
                        goto done;
                    }
                    Py_DECREF(pair);
                    seen = PyDict_GetItemWithError(shapes, key);
                    if (seen == NULL) {
                        if (!PyErr_Occurred())
                            PyErr_SetString(PyExc_RuntimeError, "shapes changed");
                        Py_DECREF(key);
                        goto done;
                    }
                } else {
                    /* Not remembered: too many shapes. Leave it to the Python scanner. */
                    Py_DECREF(pair);
                    Py_DECREF(key);
                    break;
                }
            }
            Py_DECREF(key);
            if (!PyTuple_Check(seen) || PyTuple_GET_SIZE(seen) != 2 ||
                !PyTuple_Check(PyTuple_GET_ITEM(seen, 0))) {
                PyErr_SetString(PyExc_TypeError, "shapes: expected (tuple, count) values");
                goto done;
            }
            PyObject *cnt = PyTuple_GET_ITEM(seen, 1);
            if (cnt == Py_None)
                break; /* more elements than the data holds: the Python scanner says so */
            count = PyLong_AsLongLong(cnt);
            if (count == -1 && PyErr_Occurred())
                goto done;
            last_shape = s + shape_at;
            last_shape_len = shape_len;
            shape = PyTuple_GET_ITEM(seen, 0);
        }
        /* the checks of the Python scanner's common case */
        if (!(begin <= end && end <= data_size && count <= data_size &&
              end - begin == count * itemsize))
            break;
        PyObject *name = PyUnicode_DecodeUTF8(s + name_at, name_len, "strict");
        if (name == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                goto done;
            PyErr_Clear();
            break;
        }
        int failed = PyList_Append(names, name) < 0;
        Py_DECREF(name);
        if (failed || PyList_Append(dtypes, canon) < 0 || PyList_Append(shape_col, shape) < 0 ||
            col_push(&begins, begin) < 0 || col_push(&ends, end) < 0)
            goto done;
        pos = p;
        if (close == '}') {
            closed = 1;
            break;
        }
        continue;
    stop:
        break;
    }
    {
        PyObject *b = col_bytes(&begins), *e = b == NULL ? NULL : col_bytes(&ends);
        if (e != NULL)
            result = Py_BuildValue("(nOOO)", pos, closed ? Py_True : Py_False, b, e);
        Py_XDECREF(b);
        Py_XDECREF(e);
    }
done:
    PyMem_Free(begins.v);
    PyMem_Free(ends.v);
    PyBuffer_Release(&buf);
    return result;
}


/* -- zip archives: central directory records and local headers -------------------------- */

static PyTypeObject *entry_type = NULL, *member_type = NULL;
static long max_extract_version = 63;

static PyObject *setup_zip(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *entry, *member;
    long version;
    if (!PyArg_ParseTuple(args, "O!O!l", &PyType_Type, &entry, &PyType_Type, &member, &version))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)entry, &PyTuple_Type) ||
        !PyType_IsSubtype((PyTypeObject *)member, &PyTuple_Type) ||
        ((PyTypeObject *)entry)->tp_basicsize != PyTuple_Type.tp_basicsize ||
        ((PyTypeObject *)member)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "setup_zip: expected two named tuple classes");
        return NULL;
    }
    Py_XSETREF(entry_type, (PyTypeObject *)Py_NewRef(entry));
    Py_XSETREF(member_type, (PyTypeObject *)Py_NewRef(member));
    max_extract_version = version;
    Py_RETURN_NONE;
}

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t le64(const unsigned char *p) {
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

/* A tuple of ``type`` (a named tuple class) holding ``n`` new references (stolen, even on
 * failure). */
static PyObject *make_tuple(PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            for (Py_ssize_t j = 0; j < n; j++)
                Py_XDECREF(items[j]);
            return NULL;
        }
    }
    PyObject *t = type->tp_alloc(type, n);
    if (t == NULL) {
        for (Py_ssize_t j = 0; j < n; j++)
            Py_DECREF(items[j]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* make_tuple's tuple appended to ``out``: 0, or -1 with an exception set. */
static int append_tuple(PyObject *out, PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    PyObject *t = make_tuple(type, items, n);
    if (t == NULL)
        return -1;
    int failed = PyList_Append(out, t) < 0;
    Py_DECREF(t);
    return failed ? -1 : 0;
}

/* The ZIP64 extra field as _zip._zip64_extra reads it; 0 where that would raise. */
static int zip64_extra(const unsigned char *e, Py_ssize_t len, uint64_t *file_size,
                       uint64_t *compress_size, uint64_t *header_offset) {
    while (len >= 4) {
        uint16_t tp = le16(e), ln = le16(e + 2);
        if ((Py_ssize_t)ln + 4 > len)
            return 0;
        if (tp == 1) {
            const unsigned char *d = e + 4;
            Py_ssize_t left = ln;
            if (*file_size == 0xFFFFFFFFFFFFFFFFull || *file_size == 0xFFFFFFFFull) {
                if (left < 8)
                    return 0;
                *file_size = le64(d);
                d += 8;
                left -= 8;
            }
            if (*compress_size == 0xFFFFFFFFull) {
                if (left < 8)
                    return 0;
                *compress_size = le64(d);
                d += 8;
                left -= 8;
            }
            if (*header_offset == 0xFFFFFFFFull) {
                if (left < 8)
                    return 0;
                *header_offset = le64(d);
            }
        }
        e += ln + 4;
        len -= ln + 4;
    }
    return 1;
}

/* Values kept below 2**62: sums of two never overflow int64. */
#define ZIP_MAX ((uint64_t)1 << 62)

/* central_records(data, q, limit, room, concat, out) -> (q, consumed)
 *
 * The central directory records of data[q:limit], as _zip._directory reads them, appended to
 * ``out`` as Entry tuples, while fewer than ``room`` bytes were consumed. It stops before a
 * record that does not lie wholly before ``limit``, that would raise (magic, version, name
 * encoding, the ZIP64 field), whose name holds a NUL or is not ASCII in cp437, or whose sizes
 * reach 2**62. */
static PyObject *central_records(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t q, limit;
    long long room, concat;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*nnLLO!", &buf, &q, &limit, &room, &concat, &PyList_Type, &out))
        return NULL;
    PyObject *result = NULL;
    if (entry_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup_zip was not called");
        goto done;
    }
    if (limit > buf.len)
        limit = buf.len;
    if (q < 0 || concat < -(long long)ZIP_MAX || concat > (long long)ZIP_MAX) {
        PyErr_SetString(PyExc_ValueError, "central_records: arguments out of range");
        goto done;
    }
    const unsigned char *s = (const unsigned char *)buf.buf;
    long long consumed = 0;
    while (consumed < room && q <= limit - 46) {
        const unsigned char *r = s + q;
        if (memcmp(r, "PK\x01\x02", 4) != 0 || r[6] > max_extract_version)
            break;
        uint16_t flags = le16(r + 8), method = le16(r + 10);
        uint32_t crc = le32(r + 16);
        uint64_t compress_size = le32(r + 20), file_size = le32(r + 24);
        uint16_t n = le16(r + 28), x = le16(r + 30), c = le16(r + 32), volume = le16(r + 34);
        uint64_t header_offset = le32(r + 42);
        Py_ssize_t len = 46 + (Py_ssize_t)n + x + c;
        if (len > limit - q)
            break;
        const unsigned char *name = r + 46;
        if (memchr(name, 0, n) != NULL)
            break;
        if (x && !zip64_extra(name + n, x, &file_size, &compress_size, &header_offset))
            break;
        if (file_size >= ZIP_MAX || compress_size >= ZIP_MAX || header_offset >= ZIP_MAX)
            break;
        PyObject *text;
        if (flags & 0x800) {
            text = PyUnicode_DecodeUTF8((const char *)name, n, "strict");
            if (text == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                    goto done;
                PyErr_Clear();
                break;
            }
        } else {
            int ascii = 1;
            for (uint16_t i = 0; i < n; i++)
                if (name[i] >= 0x80) {
                    ascii = 0;
                    break;
                }
            if (!ascii)
                break;
            text = PyUnicode_DecodeASCII((const char *)name, n, "strict");
            if (text == NULL)
                goto done;
        }
        PyObject *items[9] = {
            text, Py_NewRef(text),
            PyLong_FromLongLong((long long)header_offset + concat),
            PyLong_FromUnsignedLongLong(compress_size),
            PyLong_FromUnsignedLongLong(file_size),
            PyLong_FromLong(method), PyLong_FromUnsignedLong(crc), PyLong_FromLong(flags),
            PyLong_FromLong(volume),
        };
        if (append_tuple(out, entry_type, items, 9) < 0)
            goto done;
        q += len;
        consumed += len;
    }
    result = Py_BuildValue("(nL)", q, consumed);
done:
    PyBuffer_Release(&buf);
    return result;
}

/* check_records(raw, q, count) -> (q, done)
 *
 * Of the ``count`` records _zip._check_directory still has to walk, the ones lying wholly in
 * raw[q:], each starting with its magic where the one before ends: (where they end, how many). */
static PyObject *check_records(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t q, count;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &q, &count))
        return NULL;
    const unsigned char *s = (const unsigned char *)buf.buf;
    Py_ssize_t n = buf.len, i = 0;
    if (q < 0)
        q = n;
    while (i < count && q <= n - 46 && memcmp(s + q, "PK\x01\x02", 4) == 0) {
        Py_ssize_t len = 46 + (Py_ssize_t)le16(s + q + 28) + le16(s + q + 30) + le16(s + q + 32);
        if (len > n - q)
            break;
        q += len;
        i++;
    }
    PyBuffer_Release(&buf);
    return Py_BuildValue("(nn)", q, i);
}

static int get_u62(PyObject *t, Py_ssize_t i, uint64_t *out) {
    PyObject *v = PyTuple_GET_ITEM(t, i);
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0 || (uint64_t)x >= ZIP_MAX)
        return 0;
    *out = (uint64_t)x;
    return 1;
}

/* local_headers(window, start, infos, i, size, names, mask, out, fd) -> i
 *
 * The members of infos[i:], as _zip.members makes them, appended to ``out`` as Member tuples:
 * their local headers read from ``window`` (the file's bytes from ``start``) where they lie in
 * it, else 256 bytes at the header from ``fd`` (a file far from the one before). It stops
 * before the first whose header (and, with ``names``, its name) it does not have, or that
 * _zip.members would refuse: unreadable flags, a header outside the file or without its magic,
 * a name unlike the central directory's, data past the end of the file, a stored member whose
 * sizes differ, or one claiming to inflate more than 1100 times. */
static PyObject *local_headers(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    long long start, size;
    PyObject *infos, *out;
    Py_ssize_t i;
    int names, fd;
    long mask;
    unsigned char head[256];
    if (!PyArg_ParseTuple(args, "y*LO!nLplO!i", &buf, &start, &PyList_Type, &infos, &i, &size,
                          &names, &mask, &PyList_Type, &out, &fd))
        return NULL;
    PyObject *result = NULL;
    if (member_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup_zip was not called");
        goto done;
    }
    const unsigned char *s = (const unsigned char *)buf.buf;
    long long wlen = buf.len;
    if (i < 0 || start < 0 || size < 0 || (uint64_t)size >= ZIP_MAX || (uint64_t)start >= ZIP_MAX)
        goto finish;
    for (; i < PyList_GET_SIZE(infos); i++) {
        PyObject *info = PyList_GET_ITEM(infos, i);
        if (Py_TYPE(info) != entry_type || PyTuple_GET_SIZE(info) != 9)
            break;
        uint64_t header, compress_size, file_size, method, crc, flags;
        if (!get_u62(info, 2, &header) || !get_u62(info, 3, &compress_size) ||
            !get_u62(info, 4, &file_size) || !get_u62(info, 5, &method) ||
            !get_u62(info, 6, &crc) || !get_u62(info, 7, &flags))
            break;
        if ((flags & (uint64_t)mask) || (long long)header > size - 30)
            break;
        const unsigned char *h = s;
        long long at = (long long)header - start, hlen = wlen;
        if (at < 0 || at > wlen - 30) {
            /* Not in the window: read this header alone (a member far from the one before). */
            if (fd < 0)
                break;
            Py_ssize_t got = (Py_ssize_t)pread(fd, head, sizeof(head), (off_t)header);
            if (got < 30)
                break; /* (an error or a short read: _zip.members reads it again and says) */
            h = head;
            at = 0;
            hlen = got;
        }
        if (memcmp(h + at, "PK\x03\x04", 4) != 0)
            break;
        uint16_t name_len = le16(h + at + 26), extra_len = le16(h + at + 28);
        long long data_offset = (long long)header + 30 + name_len + extra_len;
        if (names) {
            /* the local name, decoded as the central directory's, must equal it */
            if (at + 30 + name_len > hlen)
                break;
            PyObject *orig = PyTuple_GET_ITEM(info, 1);
            if (!PyUnicode_Check(orig))
                break;
            const unsigned char *local = h + at + 30;
            int same;
            if (flags & 0x800) {
                PyObject *text = PyUnicode_DecodeUTF8((const char *)local, name_len, "strict");
                if (text == NULL) {
                    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                        goto done;
                    PyErr_Clear();
                    break;
                }
                same = PyUnicode_Compare(text, orig) == 0;
                Py_DECREF(text);
                if (PyErr_Occurred())
                    goto done;
            } else {
                Py_ssize_t olen;
                const char *o = PyUnicode_AsUTF8AndSize(orig, &olen);
                if (o == NULL) {
                    PyErr_Clear();
                    break;
                }
                same = olen == name_len && memcmp(o, local, name_len) == 0;
                for (uint16_t k = 0; same && k < name_len; k++)
                    if (local[k] >= 0x80)
                        same = 0; /* cp437 beyond ASCII: _zip.members decides */
            }
            if (!same)
                break;
        }
        if ((uint64_t)data_offset + compress_size > (uint64_t)size)
            break;
        if (method == 0 && file_size != compress_size)
            break;
        uint64_t least = compress_size > 1 ? compress_size : 1;
        if (file_size > 0 && (file_size - 1) / 1100 >= least)
            break; /* file_size > least * 1100, without the product */
        PyObject *items[7] = {
            Py_NewRef(PyTuple_GET_ITEM(info, 0)), PyLong_FromUnsignedLongLong(header),
            PyLong_FromLongLong(data_offset), Py_NewRef(PyTuple_GET_ITEM(info, 3)),
            Py_NewRef(PyTuple_GET_ITEM(info, 4)), Py_NewRef(PyTuple_GET_ITEM(info, 5)),
            Py_NewRef(PyTuple_GET_ITEM(info, 6)),
        };
        if (append_tuple(out, member_type, items, 7) < 0)
            goto done;
    }
finish:
    result = PyLong_FromSsize_t(i);
done:
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"scan_safetensors", scan_safetensors, METH_VARARGS,
     "Scan the compact entries of a safetensors header into columns (see the module)."},
    {"setup_zip", setup_zip, METH_VARARGS, "The Entry and Member classes, and the version."},
    {"central_records", central_records, METH_VARARGS,
     "Central directory records as Entry tuples (see the module)."},
    {"check_records", check_records, METH_VARARGS,
     "Walk central directory records that lie where the one before ends."},
    {"local_headers", local_headers, METH_VARARGS,
     "Members whose local headers lie in a window (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "modelsize._headers",
    "Safetensors headers and zip records, read in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__headers(void) { return PyModule_Create(&module); }
