/* What the Python faces of the native core share: the Node type (module_node.c), a round over
 * the streams between nodes (module_streams.c) and the module itself (module.c, which also holds
 * the argument helpers below, with the GIL held). */
#ifndef RC_MODULE_H
#define RC_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "node.h"

extern PyTypeObject rc_node_type;

/* A Program (module_program.c): a plan code checked once, with the dtype and op of its calls. */
typedef struct {
    PyObject_HEAD
    rc_program program;
    int dtype_code, op_code;
} ProgramObject;

extern PyTypeObject rc_program_type;

/* stream_round(fds, table, slots, header, dtype_code, op_code, tag, part_bytes,
 * max_frame_bytes, timeout_s, slice_s, on_event, watched, spin_s), by position or name
 * (see ray_collective.engine.stream_rounds). */
PyObject *rc_py_stream_round(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);

/* The events a round hands to its on_event callback (the module's STREAM_* constants). */
enum { EVENT_SLICE = 1, EVENT_FOREIGN, EVENT_CLOSED, EVENT_PROTOCOL, EVENT_MISMATCH,
       EVENT_WATCHED };

/* Fills out[0..n) from the arguments of a METH_FASTCALL | METH_KEYWORDS call of `function`,
 * by position, then by the keywords `names`; out[i] is NULL for one not given. 0, or -1 with a
 * TypeError set (too many, an unknown or repeated keyword, one of the first `required`
 * missing). */
int rc_py_arguments(const char *function, const char *const *names, int n, int required,
                    PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out);

/* Whether the buffer holds native int64 elements. */
int rc_py_is_int64(const Py_buffer *view);

/* Gets slot `i`'s buffer into `view`, writable where it can be (`*writable`); see module.c. */
int rc_py_get_slot(PyObject *item, Py_ssize_t i, int itemsize, Py_buffer *view, int *writable);

/* A slice in seconds as nanoseconds, a year and more as "no end". */
int64_t rc_py_slice_ns(double slice_s);

/* CLOCK_MONOTONIC in milliseconds, never 0 (0 means "not in a call" on a state page). */
int64_t rc_py_now_ms(void);

#endif
