/* stream_round of ray_collective.native._core: one round of messages over the TCP streams
 * between nodes (ray_collective/engine/stream_rounds.py). The round runs in streams.c with the GIL
 * released, taken back only for its events. */
#include "module.h"

#include "node.h"
#include "streams.h"

#define TABLE_WORDS 6 /* stream, flags, step, slot, start, stop */

/* Takes the round's table and slots into `r` (views[] holds the slots' buffers); 0, or -1 with
 * the Python error set. */
static int take_round(rc_stream_round *r, PyObject *table_object, PyObject *items,
                      Py_buffer *views, Py_ssize_t *n_views)
{
    Py_buffer table;
    if (PyObject_GetBuffer(table_object, &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
        return -1;
    int failed = !rc_py_is_int64(&table) || table.len % (8 * TABLE_WORDS) != 0;
    if (failed)
        PyErr_SetString(PyExc_TypeError, "the round's table must be a contiguous int64 array "
                        "of rows (stream, flags, step, slot, start, stop)");
    Py_ssize_t n_slots = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; !failed && i < n_slots; i++) {
        /* A read-only slot may be sent from; a receive into it is refused below. */
        int writable, got = rc_py_get_slot(PySequence_Fast_GET_ITEM(items, i), i, r->itemsize,
                                     &views[i], &writable);
        *n_views += got != 0;
        failed = got != 1;
    }
    const int64_t *rows = table.buf;
    r->n_messages = failed ? 0 : table.len / (8 * TABLE_WORDS);
    if (!failed && r->n_messages > 0
            && (r->messages = calloc((size_t)r->n_messages, sizeof *r->messages)) == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    for (int64_t m = 0; !failed && m < r->n_messages; m++) {
        const int64_t *row = rows + m * TABLE_WORDS;
        int64_t stream = row[0], flags = row[1], slot = row[3], start = row[4], stop = row[5];
        int send = (flags & RC_MESSAGE_SEND) != 0, reduce = (flags & RC_MESSAGE_REDUCE) != 0;
        const char *wrong = NULL;
        if (stream < 0 || stream >= r->n_streams)
            wrong = "names a stream the round does not have";
        else if (flags != 0 && flags != RC_MESSAGE_SEND && flags != RC_MESSAGE_REDUCE)
            wrong = "has unknown flags";
        else if (slot < 0 || slot >= n_slots)
            wrong = "names a slot the call does not have";
        else if (start < 0 || start > stop || stop > views[slot].len / r->itemsize)
            wrong = "reaches outside its slot";
        else if (!send && views[slot].readonly && stop > start)
            wrong = "is received into a read-only slot";
        else if (reduce && r->kernel == NULL)
            wrong = "reduces in a call without a reduce op";
        if (wrong != NULL) {
            PyErr_Format(PyExc_ValueError, "message %lld of the round %s", (long long)m, wrong);
            failed = 1;
            break;
        }
        r->messages[m] = (rc_stream_message){
            (int)stream, send, reduce, row[2], stop - start,
            (unsigned char *)views[slot].buf + start * r->itemsize,
            (stop - start) * r->itemsize, 0, 0};
    }
    PyBuffer_Release(&table);
    return failed ? -1 : 0;
}

/* Hands the event `status` to on_event; 0 to go on, or -1 with the Python error set (those
 * that end the round must raise). */
static int hand_over(rc_stream_round *r, int status, PyObject *on_event)
{
    PyObject *detail = NULL;
    int kind, must_raise = 1;
    if (status == RC_PENDING || status == RC_STREAM_WATCHED) {
        kind = status == RC_PENDING ? EVENT_SLICE : EVENT_WATCHED, must_raise = 0;
        detail = Py_NewRef(Py_None);
    } else if (status == RC_STREAM_FOREIGN) {
        kind = EVENT_FOREIGN, must_raise = 0;
        detail = PyBytes_FromStringAndSize((const char *)r->foreign, r->foreign_len);
        free(r->foreign);
        r->foreign = NULL;
    } else if (status == RC_STREAM_CLOSED) {
        kind = EVENT_CLOSED;
        detail = Py_NewRef(Py_None);
    } else if (status == RC_STREAM_PROTOCOL) {
        kind = EVENT_PROTOCOL;
        detail = PyUnicode_FromString(r->error);
    } else if (status == RC_STREAM_MISMATCH) {
        const rc_stream *s = &r->streams[r->event_stream];
        kind = EVENT_MISMATCH;
        detail = Py_BuildValue("(LLy#LLLLL)", (long long)r->event_message,
                               (long long)r->messages[r->event_message].done, s->body,
                               (Py_ssize_t)s->in_header_len, (long long)s->in_step,
                               (long long)s->in_count, (long long)s->in_nbytes,
                               (long long)s->in_part_offset, (long long)s->in_part_bytes);
    } else {
        PyErr_SetString(PyExc_MemoryError, r->error);
        return -1;
    }
    if (detail == NULL)
        return -1;
    PyObject *result = PyObject_CallFunction(on_event, "iiN", kind, r->event_stream, detail);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    if (must_raise) {
        PyErr_Format(PyExc_RuntimeError, "on_event returned from event %d of stream %d, which "
                     "ends the round: it must raise", kind, r->event_stream);
        return -1;
    }
    return 0;
}

static const char *const ROUND_ARGUMENTS[] = {
    "fds", "table", "slots", "header", "dtype_code", "op_code", "tag", "part_bytes",
    "max_frame_bytes", "timeout_s", "slice_s", "on_event", "watched", "spin_s"};
enum { A_FDS, A_TABLE, A_SLOTS, A_HEADER, A_DTYPE, A_OP, A_TAG, A_PART, A_FRAME, A_TIMEOUT,
       A_SLICE, A_ON_EVENT, A_WATCHED, A_SPIN, ROUND_ARGUMENT_COUNT };

/* Takes the round's numbers and its kernel into `r`, its timeout and slice into the others; 0,
 * or -1 with the Python error set. */
static int take_settings(rc_stream_round *r, PyObject *const *a, double *timeout_s,
                         double *slice_s)
{
    long dtype = PyLong_AsLong(a[A_DTYPE]), op = PyLong_AsLong(a[A_OP]);
    long long tag = PyLong_AsLongLong(a[A_TAG]), part_max = PyLong_AsLongLong(a[A_PART]);
    long long max_frame = PyLong_AsLongLong(a[A_FRAME]);
    double spin_s = PyFloat_AsDouble(a[A_SPIN]);
    *timeout_s = PyFloat_AsDouble(a[A_TIMEOUT]);
    *slice_s = PyFloat_AsDouble(a[A_SLICE]);
    if (PyErr_Occurred())
        return -1;
    rc_kernel kernel = op == RC_OP_NONE ? NULL : rc_kernel_for((int)dtype, (int)op);
    if (dtype < 0 || dtype >= RC_DTYPES || (op != RC_OP_NONE && kernel == NULL)) {
        PyErr_Format(PyExc_ValueError, "no reduction for dtype code %ld and op code %ld", dtype,
                     op);
        return -1;
    }
    if (part_max < 1 || max_frame < RC_DATA_FRAME_BYTES || !(*slice_s > 0.0)
            || !(*timeout_s >= 0.0) || !(spin_s >= 0.0 && spin_s < 1.0)
            || !PyCallable_Check(a[A_ON_EVENT])) {
        PyErr_SetString(PyExc_ValueError, "part_bytes, max_frame_bytes and slice_s must be "
                        "positive, timeout_s at least 0, spin_s in [0, 1), on_event "
                        "callable");
        return -1;
    }
    r->tag = tag;
    r->part_max = part_max;
    r->max_frame = max_frame;
    r->kernel = kernel;
    r->spin_ns = (int64_t)(spin_s * 1e9);
    r->itemsize = rc_itemsize((int)dtype);
    return 0;
}

/* Takes the round's streams `fds` and its `watched` sockets into `r`; 0, or -1 with the Python
 * error set. */
static int take_sockets(rc_stream_round *r, PyObject *fds, PyObject *watch)
{
    r->n_streams = (int)PySequence_Fast_GET_SIZE(fds);
    r->n_watched = (int)PySequence_Fast_GET_SIZE(watch);
    r->streams = calloc((size_t)r->n_streams + 1, sizeof *r->streams);
    r->watched = calloc((size_t)r->n_watched + 1, sizeof *r->watched);
    r->polls = calloc((size_t)(r->n_streams + r->n_watched) + 1, sizeof *r->polls);
    if (r->streams == NULL || r->watched == NULL || r->polls == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < r->n_streams + r->n_watched; s++) {
        PyObject *item = s < r->n_streams ? PySequence_Fast_GET_ITEM(fds, s)
                                          : PySequence_Fast_GET_ITEM(watch, s - r->n_streams);
        long fd = PyLong_AsLong(item);
        if (fd == -1 && PyErr_Occurred())
            return -1;
        if (fd < 0 || fd > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%ld is not a file descriptor", fd);
            return -1;
        }
        if (s < r->n_streams)
            r->streams[s].fd = (int)fd;
        else
            r->watched[s - r->n_streams] = (int)fd;
    }
    return 0;
}

/* The indices of the round's messages not yet complete, as a list (NULL: an error is set). */
static PyObject *pending_messages(const rc_stream_round *r)
{
    PyObject *result = PyList_New(0);
    for (int64_t m = 0; result != NULL && m < r->n_messages; m++) {
        PyObject *index;
        if (r->messages[m].complete)
            continue;
        if ((index = PyLong_FromLongLong(m)) == NULL || PyList_Append(result, index) != 0)
            Py_CLEAR(result);
        Py_XDECREF(index);
    }
    return result;
}

/* Runs the taken round, slice by slice with the GIL released, handing its events over: what
 * stream_round returns, or NULL with the Python error set. */
static PyObject *run_round(rc_stream_round *r, double timeout_s, double slice_s,
                           PyObject *on_event)
{
    rc_stream_round_begin(r);
    int64_t deadline = rc_py_now_ms() + (int64_t)(timeout_s * 1e3);
    for (;;) {
        int64_t left_ms = deadline - rc_py_now_ms(), slice_ns = rc_py_slice_ns(slice_s);
        if (left_ms < 0)
            left_ms = 0;
        if (slice_ns > left_ms * 1000000)
            slice_ns = left_ms * 1000000;
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = rc_stream_round_run(r, slice_ns);
        Py_END_ALLOW_THREADS
        if (status == RC_DONE)
            return PyList_New(0);
        if (status == RC_PENDING && rc_py_now_ms() >= deadline)
            return pending_messages(r);
        if (hand_over(r, status, on_event) != 0)
            return NULL;
    }
}

PyObject *rc_py_stream_round(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    PyObject *a[ROUND_ARGUMENT_COUNT];
    rc_stream_round r = {0};
    double timeout_s, slice_s;
    Py_buffer header;
    if (rc_py_arguments("stream_round", ROUND_ARGUMENTS, ROUND_ARGUMENT_COUNT,
                        ROUND_ARGUMENT_COUNT, args, nargs, kwnames, a) != 0
            || take_settings(&r, a, &timeout_s, &slice_s) != 0
            || PyObject_GetBuffer(a[A_HEADER], &header, PyBUF_SIMPLE) != 0)
        return NULL;
    PyObject *fds = PySequence_Fast(a[A_FDS], "fds must be a sequence of ints");
    PyObject *watch = fds ? PySequence_Fast(a[A_WATCHED], "watched must be a sequence of ints")
                          : NULL;
    PyObject *items = watch ? PySequence_Fast(a[A_SLOTS], "slots must be a sequence of arrays")
                            : NULL;
    Py_buffer *views = NULL;
    Py_ssize_t n_views = 0;
    PyObject *result = NULL;
    int failed = items == NULL;
    if (!failed && header.len > RC_STREAM_MAX_HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the call header is too long");
        failed = 1;
    }
    if (!failed && (views = calloc((size_t)PySequence_Fast_GET_SIZE(items) + 1,
                                   sizeof *views)) == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    if (!failed) {
        r.header = header.buf;
        r.header_len = (uint32_t)header.len;
        failed = take_sockets(&r, fds, watch) != 0
                 || take_round(&r, a[A_TABLE], items, views, &n_views) != 0;
    }
    if (!failed)
        result = run_round(&r, timeout_s, slice_s, a[A_ON_EVENT]);
    rc_stream_round_end(&r);
    for (Py_ssize_t i = 0; i < n_views; i++)
        PyBuffer_Release(&views[i]);
    free(views);
    free(r.messages);
    free(r.streams);
    free(r.watched);
    free(r.polls);
    Py_XDECREF(items);
    Py_XDECREF(watch);
    Py_XDECREF(fds);
    PyBuffer_Release(&header);
    return result;
}
