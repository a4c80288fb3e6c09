/* modelsize._pickleops: the frequent opcodes of modelsize's pickle parser, compiled (optional).
 *
 * setup(Global, Call, PersistentId, plain_calls, safe_calls, max_depth, max_hash_cost, call)
 *     Once, at import of modelsize.formats._pickle: the placeholder classes, the judgement's
 *     sets of callables, and ``Call(None, ())``: a Call made here is that one with its func and
 *     args replaced (its slots filled in directly: running Call.__init__, a Python function,
 *     was a fifth of this loop's time on a checkpoint, which makes two calls a tensor).
 *
 * run(data, size, pos, limit, stack, metastack, memo, far, depths, texts, persistent_load
 *     [, keep[, shared]]) -> (pos, stack, ran, found, texts, exc)
 *
 *   Runs at most ``limit`` opcodes of the pickle in ``data[:size]`` from ``pos`` on the state of
 *   a modelsize.formats._pickle._Machine (its stack, MARK stack, memo, depth records, last two
 *   strings, which memo entries to keep, its short tuples of ints), exactly as that machine's
 *   inline loop runs them, and stops *before* the first opcode it does not take on, leaving it
 *   to the Python loop:
 *
 *   - it takes on only the opcodes the Python loop runs inline (memo, small ints, MARK, tuples,
 *     strings, BINPERSID, REDUCE, dicts, lists), and of those only the plain case: an opcode
 *     that would fail (data too short, stack underflow, no MARK, an undecodable string, a
 *     tuple nested too deep), that needs the safety judgement (REDUCE of anything but a known
 *     rebuild function), a memo index out of order, a key that is not a str or int, or a target
 *     that is not a plain dict or list, is left untouched for the Python loop, which then runs
 *     it (and raises its own error, naming the opcode). So every error, every judgement and
 *     every rare opcode stay in one place, in Python; this file only repeats the success path;
 *   - it reads nothing past ``size`` (every length is checked before it is used), pushes at
 *     most one item and stores at most one memo entry an opcode (the caller checks the ceilings
 *     between blocks of ``limit``), makes strings only from bytes that are in the data, and
 *     never recurses, hashes only str and int keys, and imports or calls nothing but the
 *     ``persistent_load`` it was given and the ``Call`` class (a plain record);
 *   - an exception from ``persistent_load`` (or a failed allocation) is returned as ``exc``
 *     with ``pos`` at the opcode that raised, for the caller to raise there.
 *
 *   ``ran`` is the number of opcodes run, ``found`` the number of persistent ids met. The
 *   tests run every pickle they have both ways (this file, and the Python loop alone) and
 *   compare everything: values, memo, globals, judgement, errors and offsets. After changing
 *   this file, also run scripts/check_parsers.py: the same comparison on 200,000 mutated
 *   pickles with this file built under AddressSanitizer and UBSan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"
#include <stdint.h>
#include <string.h>

static PyObject *GlobalType, *CallType, *PersistentIdType, *plain_calls, *safe_calls;
static PyObject *str_qualname, *str_builtins_bytes;
static Py_ssize_t max_depth, max_hash_cost;

/* Call's slots: their offsets, which hold func and args, and the Call the others come from. */
#define MAX_CALL_SLOTS 16
static Py_ssize_t call_slots[MAX_CALL_SLOTS], n_call_slots, call_func_at, call_args_at;
static PyObject *call_proto;

/* The slots of Call (a class with __slots__ only, each an object slot) from its members. */
static int read_call_slots(PyTypeObject *t) {
    n_call_slots = 0;
    call_func_at = call_args_at = -1;
    if (t->tp_dictoffset != 0 || t->tp_members == NULL) return -1;
    for (PyMemberDef *m = t->tp_members; m->name != NULL; m++) {
        if (m->type != T_OBJECT_EX || (m->flags & READONLY) || n_call_slots == MAX_CALL_SLOTS)
            return -1;
        call_slots[n_call_slots++] = m->offset;
        if (strcmp(m->name, "func") == 0) call_func_at = m->offset;
        if (strcmp(m->name, "args") == 0) call_args_at = m->offset;
    }
    return call_func_at < 0 || call_args_at < 0 ? -1 : 0;
}

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *g, *c, *p, *plain, *safe, *proto;
    Py_ssize_t depth, cost;
    if (!PyArg_ParseTuple(args, "OOOOOnnO", &g, &c, &p, &plain, &safe, &depth, &cost, &proto))
        return NULL;
    if (!PyType_Check(g) || !PyType_Check(c) || !PyType_Check(p) ||
        !PyFrozenSet_CheckExact(plain) || !PyFrozenSet_CheckExact(safe) ||
        Py_TYPE(proto) != (PyTypeObject *)c) {
        PyErr_SetString(PyExc_TypeError,
                        "setup(Global, Call, PersistentId, frozenset, frozenset, int, int, Call)");
        return NULL;
    }
    if (read_call_slots((PyTypeObject *)c) < 0) {
        PyErr_SetString(PyExc_TypeError, "setup(): Call must have object slots only, func and args among them");
        return NULL;
    }
    Py_XSETREF(GlobalType, Py_NewRef(g));
    Py_XSETREF(CallType, Py_NewRef(c));
    Py_XSETREF(PersistentIdType, Py_NewRef(p));
    Py_XSETREF(plain_calls, Py_NewRef(plain));
    Py_XSETREF(safe_calls, Py_NewRef(safe));
    Py_XSETREF(call_proto, Py_NewRef(proto));
    max_depth = depth;
    max_hash_cost = cost;
    Py_RETURN_NONE;
}

/* Call(func, args): the prototype with func and args in their place (new reference). */
static PyObject *new_call(PyObject *func, PyObject *args) {
    PyTypeObject *t = (PyTypeObject *)CallType;
    PyObject *call = t->tp_alloc(t, 0);
    if (call == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n_call_slots; i++) {
        Py_ssize_t at = call_slots[i];
        PyObject *v = at == call_func_at ? func : at == call_args_at ? args
                      : *(PyObject **)((char *)call_proto + at);
        *(PyObject **)((char *)call + at) = Py_XNewRef(v);
    }
    return call;
}

static inline uint32_t u32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* An opcode's 0-, 1- or 4-byte argument (its bytes are in the data). */
static inline Py_ssize_t argument(const unsigned char *p, Py_ssize_t width) {
    return width == 4 ? (Py_ssize_t)u32(p) : width == 1 ? p[0] : 0;
}

/* Back to the stack below the last MARK (the metastack is not empty): *stack becomes it. */
static int end_mark(PyObject **stack, PyObject *metastack) {
    Py_ssize_t m = PyList_GET_SIZE(metastack);
    PyObject *outer = Py_NewRef(PyList_GET_ITEM(metastack, m - 1));
    if (PyList_SetSlice(metastack, m - 1, m, NULL) < 0) {
        Py_DECREF(outer);
        return -1;
    }
    Py_SETREF(*stack, outer);
    return 0;
}

/* Append a new reference (stolen); -1 on failure (also when obj is NULL). */
static inline int push(PyObject *stack, PyObject *obj) {
    if (obj == NULL) return -1;
    int r = PyList_Append(stack, obj);
    Py_DECREF(obj);
    return r;
}

/* Drop the last k items of a list (they exist). */
static inline int drop(PyObject *list, Py_ssize_t k) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n - k, n, NULL);
}

static inline int hashed_nested(PyObject *o) {
    PyTypeObject *t = Py_TYPE(o);
    return t == &PyTuple_Type || t == &PyFrozenSet_Type || t == (PyTypeObject *)PersistentIdType;
}

/* Items of an unrecorded tuple that may hold tuples (_pickle._SHALLOW). */
#define SHALLOW 8

/* _pickle._unrecorded: depth and hashing cost of a non-empty tuple that has no depth record:
 * flat (1, length + 1), or a short tuple of flat tuples (2, ...). */
static void unrecorded(PyObject *t, Py_ssize_t *depth, Py_ssize_t *cost) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    *depth = 1;
    *cost = n + 1;
    if (n > SHALLOW) return;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        if (Py_TYPE(x) == &PyTuple_Type && PyTuple_GET_SIZE(x) > 0) {
            *depth = 2;
            *cost += PyTuple_GET_SIZE(x) + 1;
        }
    }
}

/* _Machine.nested, its first half: depth and hashing cost of a tuple of ``items``, and whether
 * it may go unrecorded at depth 2 (*shallow: short, its nested items all flat tuples).
 * 0 on success, -1 on error (exception set). */
static int measure(PyObject *depths, PyObject *const *items, Py_ssize_t k,
                   Py_ssize_t *depth_out, Py_ssize_t *cost_out, int *shallow_out) {
    Py_ssize_t depth = 1, cost = 1;
    int shallow = k <= SHALLOW;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *c = items[i];
        cost += 1;
        if (!hashed_nested(c)) continue;
        PyObject *key = PyLong_FromVoidPtr(c);
        if (key == NULL) return -1;
        PyObject *entry = PyDict_GetItemWithError(depths, key);  /* borrowed */
        Py_DECREF(key);
        if (entry == NULL && PyErr_Occurred()) return -1;
        if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 3 &&
            PyTuple_GET_ITEM(entry, 2) == c) {
            Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
            Py_ssize_t co = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
            if ((d == -1 || co == -1) && PyErr_Occurred()) return -1;
            if (d >= depth) depth = d + 1;
            cost += co;
            shallow = 0;
        } else if (Py_TYPE(c) == &PyTuple_Type && PyTuple_GET_SIZE(c) > 0) {
            Py_ssize_t d, co;
            unrecorded(c, &d, &co);
            if (d >= depth) depth = d + 1;
            cost += co;
            if (d > 1) shallow = 0;
        }
    }
    *depth_out = depth;
    *cost_out = cost;
    *shallow_out = shallow;
    return 0;
}

/* _Machine.nested, its second half: record the tuple ``t`` if it must be (not flat, not
 * shallow). */
static int record(PyObject *depths, PyObject *t, Py_ssize_t depth, Py_ssize_t cost,
                  int shallow) {
    if (PyTuple_GET_SIZE(t) > 0 && (depth <= 1 || (depth == 2 && shallow))) return 0;
    if (cost > max_hash_cost) cost = max_hash_cost + 1;
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL) return -1;
    PyObject *value = Py_BuildValue("(nnO)", depth, cost, t);
    if (value == NULL) {
        Py_DECREF(key);
        return -1;
    }
    int r = PyDict_SetItem(depths, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
    return r;
}

/* _pickle._SHARED_LEN, _MAX_SHARED: the short tuples of ints made once (see share). */
#define SHARED_LEN 8
#define MAX_SHARED 4096

/* _Machine.share: ``t`` (a new reference, stolen), or the equal tuple of ints ``shared`` holds
 * (new reference); NULL on error. */
static PyObject *share(PyObject *shared, PyObject *t) {
    Py_ssize_t k = PyTuple_GET_SIZE(t);
    if (shared == NULL || k == 0 || k > SHARED_LEN) return t;
    for (Py_ssize_t i = 0; i < k; i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(t, i))) return t;
    PyObject *found = PyDict_GetItemWithError(shared, t);  /* borrowed */
    if (found != NULL) {
        Py_DECREF(t);
        return Py_NewRef(found);
    }
    if (PyErr_Occurred() || (PyDict_GET_SIZE(shared) < MAX_SHARED &&
                             PyDict_SetItem(shared, t, t) < 0)) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

/* A tuple of the k items at ``items``, measured, recorded and shared; NULL with *bail set where
 * the Python loop must run the opcode (too deep), NULL without it on error. */
static PyObject *make_tuple(PyObject *depths, PyObject *shared, PyObject *const *items,
                            Py_ssize_t k, int *bail) {
    Py_ssize_t depth, cost;
    int shallow;
    if (measure(depths, items, k, &depth, &cost, &shallow) < 0) return NULL;
    if (depth > max_depth) {
        *bail = 1;
        return NULL;
    }
    PyObject *t = PyTuple_New(k);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < k; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    if (record(depths, t, depth, cost, shallow) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return share(shared, t);
}

static inline int plain_key(PyObject *k) {
    return PyUnicode_CheckExact(k) || PyLong_CheckExact(k);
}

typedef struct {
    PyObject *text;  /* owned, or NULL */
    Py_ssize_t start, end;
} Text;

static int text_from(PyObject *entry, Text *out) {
    out->text = NULL;
    if (entry == Py_None) return 0;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) {
        PyErr_SetString(PyExc_TypeError, "texts entries are (text, start, end) or None");
        return -1;
    }
    out->start = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
    out->end = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
    if (PyErr_Occurred()) return -1;
    out->text = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
    return 0;
}

static PyObject *text_to(Text *t) {
    if (t->text == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(Onn)", t->text, t->start, t->end);
}

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 11 || nargs > 13) {
        PyErr_SetString(PyExc_TypeError, "run() takes 11 to 13 arguments");
        return NULL;
    }
    /* keep[i]: whether memo entry i is ever read (memo_reads); none given: all are kept */
    PyObject *keep = nargs > 11 ? args[11] : Py_None;
    /* the short tuples of ints made so far (_Machine.tuples); none given: none shared */
    PyObject *shared = nargs > 12 && args[12] != Py_None ? args[12] : NULL;
    if ((keep != Py_None && !PyBytes_CheckExact(keep)) ||
        (shared != NULL && !PyDict_CheckExact(shared))) {
        PyErr_SetString(PyExc_TypeError, "run(): keep must be bytes or None, shared a dict or None");
        return NULL;
    }
    const char *kept = keep == Py_None ? NULL : PyBytes_AS_STRING(keep);
    Py_ssize_t n_kept = keep == Py_None ? 0 : PyBytes_GET_SIZE(keep);
    if (GlobalType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "modelsize._pickleops.setup() was not called");
        return NULL;
    }
    PyObject *data = args[0];
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *stack = args[4], *metastack = args[5], *memo = args[6], *far = args[7];
    PyObject *depths = args[8], *texts = args[9], *persistent_load = args[10];
    if (!PyList_CheckExact(stack) || !PyList_CheckExact(metastack) || !PyList_CheckExact(memo) ||
        !PyDict_CheckExact(far) || !PyDict_CheckExact(depths) || !PyTuple_CheckExact(texts) ||
        PyTuple_GET_SIZE(texts) != 2) {
        PyErr_SetString(PyExc_TypeError, "run(): bad machine state");
        return NULL;
    }
    Text older, newer;
    if (text_from(PyTuple_GET_ITEM(texts, 0), &older) < 0) return NULL;
    if (text_from(PyTuple_GET_ITEM(texts, 1), &newer) < 0) {
        Py_XDECREF(older.text);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        Py_XDECREF(older.text);
        Py_XDECREF(newer.text);
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)view.buf;
    if (size > view.len) size = view.len;
    if (pos < 0) limit = 0;  /* the Python loop says what is wrong */
    Py_INCREF(stack);  /* the current stack: owned here, swapped by MARK and its ends */
    Py_ssize_t ran = 0, found = 0;
    int failed = 0;
    /* The last global REDUCE called with arguments ([0]) and without ([1]), held while this
     * runs, and whether it was a plain call: a checkpoint calls the same two a tensor. */
    PyObject *judged[2] = {NULL, NULL};
    int judged_plain[2] = {0, 0};

    while (ran < limit) {
        Py_ssize_t op = pos;
        if (op >= size) break;
        unsigned char c = d[op];
        Py_ssize_t p = op + 1;
        Py_ssize_t n = PyList_GET_SIZE(stack);
        int bail = 0;
        switch (c) {
        case 0x72:   /* LONG_BINPUT */
        case 0x71:   /* BINPUT */
        case 0x94: { /* MEMOIZE */
            Py_ssize_t width = c == 0x72 ? 4 : c == 0x71 ? 1 : 0;
            if (p + width > size || n == 0 || PyDict_GET_SIZE(far) != 0) goto leave;
            /* MEMOIZE's index is the memo's length: always the next one */
            Py_ssize_t idx = PyList_GET_SIZE(memo);
            if (width && argument(d + p, width) != idx) goto leave;
            PyObject *entry = kept == NULL || (idx < n_kept && kept[idx]) ? PyList_GET_ITEM(stack, n - 1)
                                                                           : Py_None;
            if (PyList_Append(memo, entry) < 0) goto error;
            p += width;
            break;
        }
        case 0x68:   /* BINGET */
        case 0x6A: { /* LONG_BINGET */
            Py_ssize_t width = c == 0x6A ? 4 : 1;
            if (p + width > size) goto leave;
            Py_ssize_t idx = argument(d + p, width);
            if (idx >= PyList_GET_SIZE(memo)) goto leave;
            if (PyList_Append(stack, PyList_GET_ITEM(memo, idx)) < 0) goto error;
            p += width;
            break;
        }
        case 0x4B: /* BININT1 */
            if (p + 1 > size) goto leave;
            if (push(stack, PyLong_FromLong(d[p])) < 0) goto error;
            p += 1;
            break;
        case 0x4D: /* BININT2 */
            if (p + 2 > size) goto leave;
            if (push(stack, PyLong_FromLong((long)d[p] | ((long)d[p + 1] << 8))) < 0) goto error;
            p += 2;
            break;
        case 0x4A: /* BININT */
            if (p + 4 > size) goto leave;
            if (push(stack, PyLong_FromLong((long)(int32_t)u32(d + p))) < 0) goto error;
            p += 4;
            break;
        case 0x28: { /* MARK */
            PyObject *fresh = PyList_New(0);
            if (fresh == NULL) goto error;
            if (PyList_Append(metastack, stack) < 0) {
                Py_DECREF(fresh);
                goto error;
            }
            Py_SETREF(stack, fresh);
            break;
        }
        case 0x29: /* EMPTY_TUPLE */
            if (push(stack, PyTuple_New(0)) < 0) goto error;
            break;
        case 0x4E: /* NONE */
            if (PyList_Append(stack, Py_None) < 0) goto error;
            break;
        case 0x88: /* NEWTRUE */
            if (PyList_Append(stack, Py_True) < 0) goto error;
            break;
        case 0x89: /* NEWFALSE */
            if (PyList_Append(stack, Py_False) < 0) goto error;
            break;
        case 0x7D: /* EMPTY_DICT */
            if (push(stack, PyDict_New()) < 0) goto error;
            break;
        case 0x5D: /* EMPTY_LIST */
            if (push(stack, PyList_New(0)) < 0) goto error;
            break;
        case 0x58:   /* BINUNICODE */
        case 0x8C: { /* SHORT_BINUNICODE */
            Py_ssize_t width = c == 0x58 ? 4 : 1;
            if (p + width > size) goto leave;
            Py_ssize_t len = argument(d + p, width);
            p += width;
            /* Long strings are rare: the Python loop makes them (and says if one is short). */
            if (len > size - p || len > (1 << 20)) goto leave;
            PyObject *text = PyUnicode_DecodeUTF8((const char *)d + p, len, "surrogatepass");
            if (text == NULL) {
                PyErr_Clear();  /* the Python loop raises its own error for it */
                goto leave;
            }
            if (PyList_Append(stack, text) < 0) {
                Py_DECREF(text);
                goto error;
            }
            Py_XSETREF(older.text, newer.text);
            older.start = newer.start;
            older.end = newer.end;
            newer.text = text;  /* the reference made above */
            newer.start = p;
            newer.end = p + len;
            p += len;
            break;
        }
        case 0x51: { /* BINPERSID, through the caller's persistent_load */
            if (n == 0 || persistent_load == Py_None) goto leave;
            found += 1;
            PyObject *pid = Py_NewRef(PyList_GET_ITEM(stack, n - 1));
            if (drop(stack, 1) < 0) {
                Py_DECREF(pid);
                goto error;
            }
            PyObject *obj = PyObject_CallOneArg(persistent_load, pid);
            Py_DECREF(pid);
            if (push(stack, obj) < 0) goto error;
            break;
        }
        case 0x52: { /* REDUCE of a known rebuild function: a Call, nothing to judge */
            if (n < 2) goto leave;
            PyObject *func = PyList_GET_ITEM(stack, n - 2);
            PyObject *fargs = PyList_GET_ITEM(stack, n - 1);
            if (Py_TYPE(func) != (PyTypeObject *)GlobalType || !PyTuple_CheckExact(fargs)) goto leave;
            int empty = PyTuple_GET_SIZE(fargs) == 0, plain;
            if (func == judged[empty]) {
                plain = judged_plain[empty];  /* the same global as last time: its answer */
            } else {
                PyObject *name = PyObject_GetAttr(func, str_qualname);
                if (name == NULL) goto error;
                plain = PySet_Contains(plain_calls, name);
                if (plain == 0 && empty) {
                    plain = PySet_Contains(safe_calls, name);
                    if (plain == 1) {
                        int eq = PyObject_RichCompareBool(name, str_builtins_bytes, Py_EQ);
                        plain = eq < 0 ? -1 : !eq;
                    }
                }
                Py_DECREF(name);
                if (plain < 0) goto error;
                Py_XSETREF(judged[empty], Py_NewRef(func));
                judged_plain[empty] = plain;
            }
            if (!plain) goto leave;
            PyObject *call = new_call(func, fargs);
            if (call == NULL) goto error;
            if (PyList_SetItem(stack, n - 2, call) < 0 || drop(stack, 1) < 0) goto error;
            break;
        }
        case 0x74: { /* TUPLE */
            if (PyList_GET_SIZE(metastack) == 0) goto leave;
            PyObject *t = make_tuple(depths, shared, ((PyListObject *)stack)->ob_item, n, &bail);
            if (t == NULL) {
                if (bail) goto leave;
                goto error;
            }
            if (end_mark(&stack, metastack) < 0) {
                Py_DECREF(t);
                goto error;
            }
            if (push(stack, t) < 0) goto error;
            break;
        }
        case 0x85:   /* TUPLE1 */
        case 0x86:   /* TUPLE2 */
        case 0x87: { /* TUPLE3 */
            Py_ssize_t k = c - 0x84;
            if (n < k) goto leave;
            PyObject *t = make_tuple(depths, shared, ((PyListObject *)stack)->ob_item + n - k, k, &bail);
            if (t == NULL) {
                if (bail) goto leave;
                goto error;
            }
            if (PyList_SetItem(stack, n - k, t) < 0) goto error;
            if (k > 1 && drop(stack, k - 1) < 0) goto error;
            break;
        }
        case 0x75: { /* SETITEMS on a dict, str and int keys */
            Py_ssize_t m = PyList_GET_SIZE(metastack);
            if (m == 0 || n % 2) goto leave;
            PyObject *outer = PyList_GET_ITEM(metastack, m - 1);
            Py_ssize_t on = PyList_GET_SIZE(outer);
            if (on == 0) goto leave;
            PyObject *target = PyList_GET_ITEM(outer, on - 1);
            if (!PyDict_CheckExact(target)) goto leave;
            for (Py_ssize_t i = 0; i < n; i += 2)
                if (!plain_key(PyList_GET_ITEM(stack, i))) goto leave;
            Py_INCREF(target);
            for (Py_ssize_t i = 0; i < n; i += 2) {
                if (PyDict_SetItem(target, PyList_GET_ITEM(stack, i), PyList_GET_ITEM(stack, i + 1)) < 0) {
                    Py_DECREF(target);
                    goto error;
                }
            }
            Py_DECREF(target);
            if (end_mark(&stack, metastack) < 0) goto error;
            break;
        }
        case 0x73: { /* SETITEM on a dict, a str or int key */
            if (n < 3) goto leave;
            PyObject *target = PyList_GET_ITEM(stack, n - 3);
            PyObject *key = PyList_GET_ITEM(stack, n - 2);
            if (!PyDict_CheckExact(target) || !plain_key(key)) goto leave;
            if (PyDict_SetItem(target, key, PyList_GET_ITEM(stack, n - 1)) < 0) goto error;
            if (drop(stack, 2) < 0) goto error;
            break;
        }
        case 0x65: { /* APPENDS to a list */
            Py_ssize_t m = PyList_GET_SIZE(metastack);
            if (m == 0) goto leave;
            PyObject *outer = PyList_GET_ITEM(metastack, m - 1);
            Py_ssize_t on = PyList_GET_SIZE(outer);
            if (on == 0 || !PyList_CheckExact(PyList_GET_ITEM(outer, on - 1))) goto leave;
            PyObject *target = Py_NewRef(PyList_GET_ITEM(outer, on - 1));
            Py_ssize_t tn = PyList_GET_SIZE(target);
            int r = PyList_SetSlice(target, tn, tn, stack);
            Py_DECREF(target);
            if (r < 0 || end_mark(&stack, metastack) < 0) goto error;
            break;
        }
        case 0x61: { /* APPEND to a list */
            if (n < 2) goto leave;
            PyObject *target = PyList_GET_ITEM(stack, n - 2);
            if (!PyList_CheckExact(target)) goto leave;
            if (PyList_Append(target, PyList_GET_ITEM(stack, n - 1)) < 0) goto error;
            if (drop(stack, 1) < 0) goto error;
            break;
        }
        default: /* STOP, and everything the Python loop runs by a method */
            goto leave;
        }
        pos = p;
        ran += 1;
        continue;
    error:
        failed = 1;
        pos = op;
        break;
    leave:
        break;
    }
    PyBuffer_Release(&view);
    Py_XDECREF(judged[0]);
    Py_XDECREF(judged[1]);

    PyObject *exc = Py_None;
    if (failed) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        if (value == NULL) {  /* cannot happen: a failure always sets its exception */
            Py_DECREF(stack);
            Py_XDECREF(older.text);
            Py_XDECREF(newer.text);
            PyErr_SetString(PyExc_SystemError, "modelsize._pickleops.run lost an exception");
            return NULL;
        }
        exc = value;
    }
    PyObject *t_older = text_to(&older), *t_newer = text_to(&newer);
    Py_XDECREF(older.text);
    Py_XDECREF(newer.text);
    PyObject *result = NULL;
    if (t_older != NULL && t_newer != NULL) {
        result = Py_BuildValue("(nOnn(OO)O)", pos, stack, ran, found, t_older, t_newer, exc);
    }
    Py_XDECREF(t_older);
    Py_XDECREF(t_newer);
    Py_DECREF(stack);
    if (failed) Py_XDECREF(exc);
    return result;
}

/* memo_reads(data, size, pos) -> bytes | None
 *
 * Which memo entries the pickle at data[pos:size] reads: one byte per memo-storing opcode
 * (PUT, BINPUT, LONG_BINPUT, MEMOIZE) up to the pickle's STOP, byte i 1 where a BINGET or
 * LONG_BINGET reads index i after i could have been stored (the memo holds at most one entry
 * more per storing opcode). The parse stores None for the others: an object only the memo
 * holds (torch.save memoizes every persistent id, and the key string in it) is let go of as
 * soon as the stack does. None where the pickle reads its memo with GET, whose decimal
 * argument only the parse reads: then every entry is kept.
 *
 * The opcodes are stepped over as the parse reads them (an argument of 1, 2, 4 or 8 bytes, a
 * length and its bytes, one or two lines). The walk stops at STOP, at an unknown opcode and at
 * an argument that runs past ``size``: where the parse ends too (or fails), so no read the
 * parse makes is missed; one made past a point the parse fails at only keeps more. */
static PyObject *memo_reads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "memo_reads() takes 3 arguments");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    Py_ssize_t p = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = (const unsigned char *)view.buf;
    if (size > view.len) size = view.len;
    if (p < 0) p = size;
    char *reads = NULL;
    Py_ssize_t stores = 0, room = 0;
    int text_get = 0;
    while (p < size && !text_get) {
        unsigned char c = d[p++];
        Py_ssize_t skip = 0, lines = 0, len_width = 0, idx = -1;
        switch (c) {
        case '.':  /* STOP */
            p = size;
            continue;
        case '(': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case ']':
        case '}': case 0x8f: case ')': case 't': case 0x85: case 0x86: case 0x87: case 'l':
        case 'd': case 0x91: case 'a': case 'e': case 's': case 'u': case 0x90: case 0x93:
        case 'R': case 0x81: case 0x92: case 'o': case 'b': case 'Q': case 0x97: case 0x98:
            break;
        case 0x94:  /* MEMOIZE */
            stores += 1;
            break;
        case 'p':  /* PUT */
            stores += 1;
            lines = 1;
            break;
        case 'g':  /* GET */
            text_get = 1;
            continue;
        case 'I': case 'L': case 'F': case 'S': case 'V': case 'P':
            lines = 1;
            break;
        case 'c': case 'i':  /* GLOBAL, INST */
            lines = 2;
            break;
        case 0x80: case 'K': case 'q': case 'h': case 0x82:  /* PROTO BININT1 BINPUT BINGET EXT1 */
            skip = 1;
            break;
        case 'M': case 0x83:  /* BININT2 EXT2 */
            skip = 2;
            break;
        case 'J': case 'r': case 'j': case 0x84:  /* BININT LONG_BINPUT LONG_BINGET EXT4 */
            skip = 4;
            break;
        case 0x95: case 'G':  /* FRAME BINFLOAT */
            skip = 8;
            break;
        case 0x8a: case 'U': case 0x8c: case 'C':  /* LONG1 SHORT_BINSTRING SHORT_BINUNICODE SHORT_BINBYTES */
            len_width = 1;
            break;
        case 0x8b: case 'T':  /* LONG4 BINSTRING: a signed length */
            len_width = -4;
            break;
        case 'X': case 'B':  /* BINUNICODE BINBYTES */
            len_width = 4;
            break;
        case 0x8d: case 0x8e: case 0x96:  /* BINUNICODE8 BINBYTES8 BYTEARRAY8 */
            len_width = 8;
            break;
        default:  /* no opcode: the parse fails here */
            p = size;
            continue;
        }
        if (c == 'q' || c == 'r') stores += 1;
        if ((c == 'h' || c == 'j') && p + skip <= size) idx = c == 'h' ? d[p] : (Py_ssize_t)u32(d + p);
        if (len_width) {
            Py_ssize_t w = len_width < 0 ? 4 : len_width;
            if (w > size - p) break;
            uint64_t n = 0;
            if (w == 1) n = d[p];
            else if (w == 4) n = len_width < 0 ? (uint64_t)(int64_t)(int32_t)u32(d + p) : u32(d + p);
            else for (int i = 7; i >= 0; i--) n = (n << 8) | d[p + i];
            p += w;
            if (len_width < 0 && (int64_t)n < 0) break;  /* a negative length: the parse fails */
            if (n > (uint64_t)(size - p)) break;
            skip = (Py_ssize_t)n;
        }
        while (lines > 0) {
            const unsigned char *nl = memchr(d + p, '\n', (size_t)(size - p));
            if (nl == NULL) {
                p = size;
                break;
            }
            p = nl - d + 1;
            lines -= 1;
        }
        if (skip > size - p) break;
        p += skip;
        if (idx >= 0 && idx < stores) {
            if (stores > room) {
                Py_ssize_t more = stores > 2 * room ? stores : 2 * room;
                char *grown = PyMem_Realloc(reads, (size_t)more);
                if (grown == NULL) {
                    PyMem_Free(reads);
                    PyBuffer_Release(&view);
                    return PyErr_NoMemory();
                }
                memset(grown + room, 0, (size_t)(more - room));
                reads = grown;
                room = more;
            }
            reads[idx] = 1;
        }
    }
    PyBuffer_Release(&view);
    PyObject *out = NULL;
    if (text_get) {
        out = Py_NewRef(Py_None);
    } else {
        out = PyBytes_FromStringAndSize(NULL, stores);
        if (out != NULL) {
            char *o = PyBytes_AS_STRING(out);
            Py_ssize_t have = room < stores ? room : stores;
            if (have > 0) memcpy(o, reads, (size_t)have);
            if (stores > have) memset(o + have, 0, (size_t)(stores - have));
        }
    }
    PyMem_Free(reads);
    return out;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(Global, Call, PersistentId, plain_calls, safe_calls, max_depth, max_hash_cost, call)"},
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(data, size, pos, limit, stack, metastack, memo, far, depths, texts, persistent_load"
     "[, keep[, shared]]) -> (pos, stack, ran, found, texts, exc)"},
    {"memo_reads", (PyCFunction)(void (*)(void))memo_reads, METH_FASTCALL,
     "memo_reads(data, size, pos) -> bytes | None: which memo entries the pickle reads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "modelsize._pickleops",
    "The frequent opcodes of modelsize's pickle parser, compiled (optional).", -1, methods,
};

PyMODINIT_FUNC PyInit__pickleops(void) {
    str_qualname = PyUnicode_InternFromString("qualname");
    str_builtins_bytes = PyUnicode_InternFromString("builtins.bytes");
    if (str_qualname == NULL || str_builtins_bytes == NULL) return NULL;
    return PyModule_Create(&module);
}
