/* ray_collective.native._core: the native core's Python module (the API is documented in
 * ray_collective/native/__init__.py): the element-wise kernels and the digest as functions, the
 * Node type (module_node.c), the Program type (module_program.c) and stream_round
 * (module_streams.c), and the argument helpers the faces share, all with the GIL held but for
 * the work itself. */
#include "module.h"

#include <string.h>
#include <time.h>

#include "digest.h"
#include "node.h"

int rc_py_arguments(const char *function, const char *const *names, int n, int required,
                    PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", function,
                     n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < keywords; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == n || out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, i == n ? "%s() got an unexpected keyword argument "
                         "'%U'" : "%s() got multiple values for argument '%U'", function, name);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < required; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", function,
                         names[i]);
            return -1;
        }
    }
    return 0;
}

int rc_py_is_int64(const Py_buffer *view)
{
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || *format == '<')
        format++;
    return view->itemsize == 8 && (strcmp(format, "q") == 0 || strcmp(format, "l") == 0);
}

/* Gets slot `i`'s buffer into `view`: writable where it can be (`*writable` 1), else read-only
 * (0: a read-only array may still be sent from; the caller refuses writes into it), its
 * elements of `itemsize` bytes, aligned. 1 once `view` is held and right; -1 when it is held
 * (to release) but its elements are wrong; 0 when nothing is held. The Python error is set
 * unless 1. */
int rc_py_get_slot(PyObject *item, Py_ssize_t i, int itemsize, Py_buffer *view, int *writable)
{
    *writable = 1;
    if (PyObject_GetBuffer(item, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
            != 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError)
                && !PyErr_ExceptionMatches(PyExc_ValueError))
            return 0;
        PyErr_Clear();
        *writable = 0;
        if (PyObject_GetBuffer(item, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
            return 0;
    }
    int alignment = itemsize < 8 ? itemsize : 8;
    if (view->itemsize != itemsize || (uintptr_t)view->buf % alignment != 0) {
        PyErr_Format(PyExc_ValueError, "slot %zd has %zd-byte elements at address %p; the "
                     "call's dtype has %d-byte elements, aligned", i, view->itemsize,
                     view->buf, itemsize);
        return -1;
    }
    return 1;
}

int64_t rc_py_slice_ns(double slice_s)
{
    return slice_s < 1e9 ? (int64_t)(slice_s * 1e9) : (int64_t)1e18;
}

int64_t rc_py_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t ms = (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
    return ms ? ms : 1; /* 0 means "not in a call", as in node_state._now_ms */
}

static PyObject *core_combine(PyObject *module, PyObject *args)
{
    int dtype, op;
    PyObject *acc_object, *incoming_object;
    if (!PyArg_ParseTuple(args, "iiOO", &dtype, &op, &acc_object, &incoming_object))
        return NULL;
    rc_kernel kernel = rc_kernel_for(dtype, op);
    int itemsize = rc_itemsize(dtype), alignment = itemsize < 8 ? itemsize : 8;
    if (kernel == NULL) {
        PyErr_Format(PyExc_ValueError, "no reduction for dtype code %d and op code %d", dtype,
                     op);
        return NULL;
    }
    Py_buffer acc, incoming;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (PyObject_GetBuffer(acc_object, &acc, flags | PyBUF_WRITABLE) != 0)
        return NULL;
    if (PyObject_GetBuffer(incoming_object, &incoming, flags) != 0) {
        PyBuffer_Release(&acc);
        return NULL;
    }
    PyObject *result = NULL;
    if (acc.len != incoming.len || acc.itemsize != itemsize || incoming.itemsize != itemsize)
        PyErr_Format(PyExc_ValueError, "cannot combine %zd bytes of %zd-byte elements with %zd "
                     "bytes of %zd-byte elements as %d-byte elements", acc.len, acc.itemsize,
                     incoming.len, incoming.itemsize, itemsize);
    else if ((uintptr_t)acc.buf % alignment != 0 || (uintptr_t)incoming.buf % alignment != 0)
        PyErr_SetString(PyExc_ValueError, "unaligned elements");
    else {
        Py_BEGIN_ALLOW_THREADS
        kernel(acc.buf, incoming.buf, acc.len / itemsize, 1, 1);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&acc);
    PyBuffer_Release(&incoming);
    return result;
}

static PyObject *core_itemsize(PyObject *module, PyObject *args)
{
    int dtype;
    if (!PyArg_ParseTuple(args, "i", &dtype))
        return NULL;
    return PyLong_FromLong(rc_itemsize(dtype));
}

static PyObject *core_digest(PyObject *module, PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = rc_digest(data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyMethodDef core_methods[] = {
    {"combine", core_combine, METH_VARARGS,
     "combine(dtype_code, op_code, acc, incoming): acc = op(acc, incoming), element-wise"},
    {"digest", core_digest, METH_O,
     "digest(buffer) -> int: weight sync's 64-bit change digest of a C-contiguous buffer "
     "(ray_collective.weight_sync.digest), GIL released"},
    {"itemsize", core_itemsize, METH_VARARGS,
     "itemsize(dtype_code): bytes per element of the dtype code (0: unknown)"},
    {"stream_round", (PyCFunction)(void (*)(void))rc_py_stream_round,
     METH_FASTCALL | METH_KEYWORDS,
     "stream_round(fds, table, slots, header, dtype_code, op_code, tag, part_bytes, "
     "max_frame_bytes, timeout_s, slice_s, on_event, watched, spin_s): one round of messages "
     "over TCP streams "
     "(see ray_collective.engine.stream_rounds); the indices of the messages still pending at "
     "timeout_s, empty once all are done"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "ray_collective.native._core",
    "The native core of ray_collective (see ray_collective.native).", -1, core_methods,
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&rc_node_type) < 0 || PyType_Ready(&rc_program_type) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&core_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Node", (PyObject *)&rc_node_type) < 0
            || PyModule_AddObjectRef(module, "Program", (PyObject *)&rc_program_type) < 0
            || PyModule_AddIntConstant(module, "DONE", RC_DONE) < 0
            || PyModule_AddIntConstant(module, "PENDING", RC_PENDING) < 0
            || PyModule_AddIntConstant(module, "MISMATCH", RC_MISMATCH) < 0
            || PyModule_AddIntConstant(module, "REROUTED", RC_REROUTED) < 0
            || PyModule_AddIntConstant(module, "P2P_MAX_BYTES", RC_P2P_MAX_BYTES) < 0
            || PyModule_AddIntConstant(module, "HEADER_SEQ_OFFSET", RC_HEADER_SEQ_OFFSET) < 0
            || PyModule_AddIntConstant(module, "STREAM_SLICE", EVENT_SLICE) < 0
            || PyModule_AddIntConstant(module, "STREAM_FOREIGN", EVENT_FOREIGN) < 0
            || PyModule_AddIntConstant(module, "STREAM_CLOSED", EVENT_CLOSED) < 0
            || PyModule_AddIntConstant(module, "STREAM_PROTOCOL", EVENT_PROTOCOL) < 0
            || PyModule_AddIntConstant(module, "STREAM_MISMATCH", EVENT_MISMATCH) < 0
            || PyModule_AddIntConstant(module, "STREAM_WATCHED", EVENT_WATCHED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
