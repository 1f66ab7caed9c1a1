/* What the Python faces of the native core share: the Node type (module_node.c), a round over
 * the streams between nodes (module_streams.c) and the module itself (module.c, which also holds
 * the argument helpers below, with the GIL held). */
#ifndef RC_MODULE_H
#define RC_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

extern PyTypeObject rc_node_type;

/* stream_round(fds, table, slots, header, dtype_code, op_code, tag, part_bytes,
 * max_frame_bytes, timeout_s, slice_s, on_event, watched)
 * (see ray_collective.engine.stream_rounds). */
PyObject *rc_py_stream_round(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* The events a round hands to its on_event callback (the module's STREAM_* constants). */
enum { EVENT_SLICE = 1, EVENT_FOREIGN, EVENT_CLOSED, EVENT_PROTOCOL, EVENT_MISMATCH,
       EVENT_WATCHED };

/* Whether the buffer holds native int64 elements. */
int rc_py_is_int64(const Py_buffer *view);

/* Gets slot `i`'s buffer into `view`, writable where it can be (`*writable`); see module.c. */
int rc_py_get_slot(PyObject *item, Py_ssize_t i, int itemsize, Py_buffer *view, int *writable);

/* A slice in seconds as nanoseconds, a year and more as "no end". */
int64_t rc_py_slice_ns(double slice_s);

/* CLOCK_MONOTONIC in milliseconds, never 0 (0 means "not in a call" on a state page). */
int64_t rc_py_now_ms(void);

#endif
