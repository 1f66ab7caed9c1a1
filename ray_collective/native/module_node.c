/* The Node type of ray_collective.native._core: one rank's shared memory and executor on a
 * node (the API is documented in ray_collective/native/__init__.py). Arguments are checked here,
 * with the GIL held; a call itself runs in executor.c with the GIL released, on the buffers the
 * Node holds from start() until the call is done, has failed or is abandoned. */
#include "module.h"

#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "node.h"

typedef struct {
    PyObject_HEAD
    rc_node node;
    int opened, busy;
    PyObject *program; /* the running call's Program */
    Py_buffer *views;  /* the slots of the running call */
    int n_views;
    int64_t views_capacity;
    /* The rank's words on its group's state page (bind_state), which run() keeps as the
     * transport's NodeState.arrive and complete would; page.buf is NULL when unbound. */
    Py_buffer page;
    int64_t *started_word, *beat_word, *call_word;
    int64_t code_span;
} NodeObject;

static void release_page(NodeObject *self)
{
    if (self->page.buf != NULL) {
        PyBuffer_Release(&self->page);
        self->page.buf = NULL;
    }
}

/* Lets go of the running call's slots and program. */
static void release_views(NodeObject *self)
{
    for (int i = 0; i < self->n_views; i++)
        PyBuffer_Release(&self->views[i]);
    self->n_views = 0;
    Py_CLEAR(self->program);
}

static PyObject *node_error(NodeObject *self, int kind)
{
    if (kind == RC_INVALID) {
        PyErr_SetString(PyExc_ValueError, self->node.error);
    } else {
        PyObject *args = Py_BuildValue("(is)", errno, self->node.error);
        if (args != NULL) {
            PyErr_SetObject(PyExc_OSError, args); /* picks the subclass, PermissionError... */
            Py_DECREF(args);
        }
    }
    return NULL;
}

static int Node_init(NodeObject *self, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"directory", "rank", "world_size", "ring_bytes", "part_bytes",
                               "spin_ns", "remote_min_bytes", NULL};
    PyObject *path = NULL;
    int rank, world;
    unsigned long long ring_bytes, part_bytes;
    long long spin_ns, remote_min = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&iiKKL|L", keywords, PyUnicode_FSConverter,
                                     &path, &rank, &world, &ring_bytes, &part_bytes, &spin_ns,
                                     &remote_min))
        return -1;
    if (remote_min < 0) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_ValueError, "remote_min_bytes must be at least 0");
        return -1;
    }
    if (self->opened) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_RuntimeError, "this Node is open already");
        return -1;
    }
    int fd = open(PyBytes_AS_STRING(path), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        if (fd >= 0)
            close(fd);
        Py_DECREF(path);
        return -1;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
        PyErr_Format(PyExc_PermissionError, "%s: refused, the directory of a node must belong "
                     "to this user with mode 0700", PyBytes_AS_STRING(path));
        close(fd);
        Py_DECREF(path);
        return -1;
    }
    Py_DECREF(path);
    int opened = rc_node_open(&self->node, fd, rank, world, ring_bytes, part_bytes, spin_ns,
                              (uint64_t)remote_min);
    if (opened != RC_OK) {
        node_error(self, opened);
        rc_node_close(&self->node);
        return -1;
    }
    self->opened = 1;
    return 0;
}

static int check_usable(NodeObject *self)
{
    if (!self->opened) {
        PyErr_SetString(PyExc_ValueError, "the Node is closed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in this Node's progress()");
        return -1;
    }
    return 0;
}


static int grow(void **array, size_t item, int64_t *capacity, int64_t wanted)
{
    if (wanted <= *capacity)
        return 0;
    void *bigger = realloc(*array, item * (size_t)wanted);
    if (bigger == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = bigger;
    *capacity = wanted;
    return 0;
}

static int take_slots(NodeObject *self, PyObject *slots)
{
    rc_call *call = &self->node.call;
    PyObject *items = PySequence_Fast(slots, "slots must be a sequence of arrays");
    if (items == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    if (n > INT32_MAX || grow((void **)&call->slots, sizeof(rc_slot), &call->slot_capacity, n)
            || grow((void **)&self->views, sizeof(Py_buffer), &self->views_capacity, n)) {
        Py_DECREF(items);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *view = &self->views[i];
        int writable, got = rc_py_get_slot(PySequence_Fast_GET_ITEM(items, i), i, call->itemsize,
                                     view, &writable);
        self->n_views += got != 0;
        if (got != 1)
            break;
        call->slots[i].writable = writable; /* the plan check refuses writes into it */
        call->slots[i].base = view->buf;
        call->slots[i].count = view->len / view->itemsize;
    }
    Py_DECREF(items);
    if (self->n_views != n) {
        release_views(self);
        return -1;
    }
    call->n_slots = (int)n;
    return 0;
}

static int take_header(rc_call *call, const Py_buffer *header)
{
    if (header->len > UINT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "the call header is too long");
        return -1;
    }
    if (grow((void **)&call->header, 1, &call->header_capacity, header->len ? header->len : 1))
        return -1;
    memcpy(call->header, header->buf, (size_t)header->len);
    call->header_len = (uint32_t)header->len;
    return 0;
}

/* Take a call of `program` (a Program, checked when it was built) on its slots and header (its
 * sequence number written in when seq is not negative), and start it; 0, or -1 with the
 * Python error set. */
static int begin_call(NodeObject *self, PyObject *program, PyObject *slots,
                      const Py_buffer *header, long long seq, long long tag)
{
    rc_call *call = &self->node.call;
    int failed = check_usable(self);
    if (!failed && call->active) {
        PyErr_SetString(PyExc_RuntimeError, "a call is running on this Node: progress() it to "
                        "the end or abandon() it first");
        failed = -1;
    }
    if (!failed && !PyObject_TypeCheck(program, &rc_program_type)) {
        PyErr_Format(PyExc_TypeError, "program must be a Program, not %s",
                     Py_TYPE(program)->tp_name);
        failed = -1;
    }
    if (!failed && seq >= 0 && header->len < RC_HEADER_SEQ_OFFSET + 8) {
        PyErr_SetString(PyExc_ValueError, "the call header is too short to hold its number");
        failed = -1;
    }
    if (!failed) {
        const rc_program *checked = &((ProgramObject *)program)->program;
        call->program = checked;
        call->code = checked->code;
        call->itemsize = checked->itemsize;
        call->kernel = checked->kernel;
        call->tag = tag;
        self->program = Py_NewRef(program);
        failed = take_header(call, header) || take_slots(self, slots);
        if (failed)
            Py_CLEAR(self->program);
    }
    if (failed)
        return -1;
    if (seq >= 0) {
        /* Little-endian, as wire.CallHeader packs it. */
        for (int i = 0; i < 8; i++)
            call->header[RC_HEADER_SEQ_OFFSET + i] = (unsigned char)((uint64_t)seq >> (8 * i));
    }
    free(self->node.mismatch.header);
    memset(&self->node.mismatch, 0, sizeof self->node.mismatch);
    int started = rc_call_start(&self->node);
    if (started != RC_OK) {
        release_views(self);
        node_error(self, started);
        return -1;
    }
    return 0;
}

static PyObject *Node_start(NodeObject *self, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"program", "slots", "header", "tag", NULL};
    PyObject *program, *slots;
    Py_buffer header;
    long long tag = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOy*|L", keywords, &program, &slots, &header,
                                     &tag))
        return NULL;
    int failed = begin_call(self, program, slots, &header, -1, tag);
    PyBuffer_Release(&header);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* Run the started call for at most slice_ns with the GIL released: its status, or -1 with the
 * Python error set (the call is then over). `just_started`: its first passes, until it must
 * wait, run with the GIL held: a call whose peers' messages are there already (the later
 * rank of a small call) then never hands the GIL to another thread, which a thread that
 * holds on to it makes this one wait for. */
static int progress_call(NodeObject *self, int64_t slice_ns, int just_started)
{
    int status = RC_PENDING;
    self->busy = 1;
    if (just_started)
        status = rc_progress_started(&self->node);
    if (status == RC_PENDING) {
        Py_BEGIN_ALLOW_THREADS
        status = rc_progress(&self->node, slice_ns);
        Py_END_ALLOW_THREADS
    }
    self->busy = 0;
    if (status != RC_PENDING)
        release_views(self);
    if (status == RC_FAILED) {
        PyErr_SetString(PyExc_MemoryError, self->node.error);
        return -1;
    }
    return status;
}

static PyObject *Node_progress(NodeObject *self, PyObject *args)
{
    double slice_s;
    if (!PyArg_ParseTuple(args, "d", &slice_s) || check_usable(self) != 0)
        return NULL;
    if (!self->node.call.active) {
        PyErr_SetString(PyExc_RuntimeError, "no call is running on this Node (start() one)");
        return NULL;
    }
    if (!(slice_s >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "slice_s must be at least 0");
        return NULL;
    }
    int status = progress_call(self, rc_py_slice_ns(slice_s), 0);
    return status < 0 ? NULL : PyLong_FromLong(status);
}

static PyObject *Node_bind_state(NodeObject *self, PyObject *args)
{
    PyObject *page;
    Py_ssize_t started, beat, called;
    long long code_span;
    if (!PyArg_ParseTuple(args, "OnnnL", &page, &started, &beat, &called, &code_span)
            || check_usable(self) != 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(page, &view, PyBUF_WRITABLE) != 0)
        return NULL;
    Py_ssize_t words = view.len / 8;
    if ((uintptr_t)view.buf % 8 != 0 || started < 0 || beat < 0 || called < 0
            || started >= words || beat >= words || called >= words || code_span < 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the state words must lie inside an aligned page, "
                        "and code_span must be positive");
        return NULL;
    }
    release_page(self);
    self->page = view;
    self->started_word = (int64_t *)view.buf + started;
    self->beat_word = (int64_t *)view.buf + beat;
    self->call_word = (int64_t *)view.buf + called;
    self->code_span = code_span;
    Py_RETURN_NONE;
}

/* A call whose slots hold at most this many bytes: its first passes copy so little that they
 * may run with the GIL held (progress_call). */
#define GIL_HELD_MAX_BYTES (64 << 10)

static int small_call(const rc_call *call)
{
    int64_t bytes = 0;
    for (int i = 0; i < call->n_slots; i++)
        bytes += call->slots[i].count * call->itemsize;
    return bytes <= GIL_HELD_MAX_BYTES;
}

static PyObject *Node_run(NodeObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames)
{
    static const char *const names[] = {"program", "slots", "header", "seq", "tag", "call_code",
                                        "slice_s"};
    PyObject *given[7];
    if (rc_py_arguments("run", names, 7, 7, args, nargs, kwnames, given) != 0)
        return NULL;
    long long seq = PyLong_AsLongLong(given[3]), tag = PyLong_AsLongLong(given[4]);
    long long call_code = PyLong_AsLongLong(given[5]);
    double slice_s = PyFloat_AsDouble(given[6]);
    if (PyErr_Occurred())
        return NULL;
    if (seq < 0 || !(slice_s >= 0.0)) {
        PyErr_SetString(PyExc_ValueError, "seq and slice_s must be at least 0");
        return NULL;
    }
    Py_buffer header;
    if (PyObject_GetBuffer(given[2], &header, PyBUF_SIMPLE) != 0)
        return NULL;
    int failed = begin_call(self, given[0], given[1], &header, seq, tag);
    PyBuffer_Release(&header);
    if (failed)
        return NULL;
    /* Only collectives are numbered alike on every rank: a point-to-point call (tag >= 0)
     * leaves the words alone, as the transport's own path does. */
    int records = self->page.buf != NULL && tag < 0;
    if (records) {
        /* What NodeState.arrive records: the call started, its rank alive in it since now. */
        int64_t now = rc_py_now_ms();
        if (*self->started_word < seq + 1)
            *self->started_word = seq + 1;
        *self->beat_word = now;
        *self->call_word = now * self->code_span + call_code;
    }
    int status = progress_call(self, rc_py_slice_ns(slice_s), small_call(&self->node.call));
    if (status < 0)
        return NULL;
    if ((status == RC_DONE || status == RC_REROUTED) && records)
        *self->beat_word = 0; /* NodeState.complete: out of the call */
    return PyLong_FromLong(status);
}

static PyObject *Node_scan_incoming(NodeObject *self, PyObject *unused)
{
    if (check_usable(self) != 0)
        return NULL;
    if (!self->node.call.active) {
        PyErr_SetString(PyExc_RuntimeError, "no call is running on this Node (start() one)");
        return NULL;
    }
    int opened = rc_scan_incoming(&self->node);
    if (opened != RC_OK)
        return node_error(self, opened);
    if (rc_early_mismatch(&self->node) == RC_MISMATCH) {
        rc_call_end(&self->node);
        release_views(self);
        return PyLong_FromLong(RC_MISMATCH);
    }
    return PyLong_FromLong(RC_PENDING);
}

static PyObject *Node_mismatch_details(NodeObject *self, PyObject *unused)
{
    const rc_mismatch *m = &self->node.mismatch;
    if (m->reason == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue(
        "{s:i,s:s,s:y#,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "peer", m->peer, "reason", m->reason,
        "header", m->header ? (const char *)m->header : "", (Py_ssize_t)m->header_len,
        "step", (long long)m->step, "tag", (long long)m->tag, "count", (long long)m->count,
        "nbytes", (long long)m->nbytes, "part_offset", (long long)m->part_offset,
        "part_bytes", (long long)m->part_bytes, "expected_step", (long long)m->expected_step,
        "expected_count", (long long)m->expected_count);
}

static PyObject *Node_abandon(NodeObject *self, PyObject *unused)
{
    if (check_usable(self) != 0)
        return NULL;
    rc_call_end(&self->node);
    release_views(self);
    Py_RETURN_NONE;
}

static PyObject *Node_wake_all(NodeObject *self, PyObject *unused)
{
    if (!self->opened) {
        PyErr_SetString(PyExc_ValueError, "the Node is closed");
        return NULL;
    }
    rc_wake_all(&self->node);
    Py_RETURN_NONE;
}

static PyObject *Node_close(NodeObject *self, PyObject *unused)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is in this Node's progress()");
        return NULL;
    }
    if (self->opened) {
        release_views(self);
        release_page(self);
        rc_node_close(&self->node);
        self->opened = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Node_enter(PyObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *Node_exit(NodeObject *self, PyObject *args)
{
    return Node_close(self, NULL);
}

static PyObject *Node_active(NodeObject *self, void *unused)
{
    return PyBool_FromLong(self->opened && self->node.call.active);
}

static void Node_dealloc(NodeObject *self)
{
    if (self->opened) {
        release_views(self);
        rc_node_close(&self->node);
    }
    release_page(self);
    Py_CLEAR(self->program);
    free(self->views);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Node_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Node_start, METH_VARARGS | METH_KEYWORDS,
     "start(program, slots, header, tag=-1): begin a call of a Program (see the package "
     "docstring)"},
    {"run", (PyCFunction)(void (*)(void))Node_run, METH_FASTCALL | METH_KEYWORDS,
     "run(program, slots, header, seq, tag, call_code, slice_s) -> DONE, REROUTED, PENDING or "
     "MISMATCH: start() with call number seq written into the header, then progress(slice_s); "
     "keeps the state words bind_state() named for a collective (tag < 0)"},
    {"bind_state", (PyCFunction)Node_bind_state, METH_VARARGS,
     "bind_state(page, started_word, beat_word, call_word, code_span): the int64 words of "
     "this rank on its group's state page that run() keeps"},
    {"progress", (PyCFunction)Node_progress, METH_VARARGS,
     "progress(slice_s) -> DONE, REROUTED, PENDING or MISMATCH: run the call for at most slice_s seconds"},
    {"scan_incoming", (PyCFunction)Node_scan_incoming, METH_NOARGS,
     "scan_incoming() -> PENDING or MISMATCH: open the rings peers made towards this rank "
     "and look for a message of this call number with another header (between slices)"},
    {"mismatch_details", (PyCFunction)Node_mismatch_details, METH_NOARGS,
     "what the frame that ended the last call with MISMATCH said, or None"},
    {"abandon", (PyCFunction)Node_abandon, METH_NOARGS, "forget the running call"},
    {"wake_all", (PyCFunction)Node_wake_all, METH_NOARGS,
     "make every rank of the node return PENDING from progress() once, at once"},
    {"close", (PyCFunction)Node_close, METH_NOARGS, "unmap everything and close the directory"},
    {"__enter__", Node_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Node_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Node_members[] = {
    {"rank", T_INT, offsetof(NodeObject, node.rank), READONLY, "this rank"},
    {"world_size", T_INT, offsetof(NodeObject, node.world), READONLY, "ranks on the node"},
    {"ring_bytes", T_ULONGLONG, offsetof(NodeObject, node.ring_bytes), READONLY,
     "data bytes of each ring"},
    {"part_bytes", T_ULONGLONG, offsetof(NodeObject, node.part_bytes), READONLY,
     "the largest part of a message"},
    {"spin_ns", T_LONGLONG, offsetof(NodeObject, node.spin_ns), READONLY,
     "how long a waiting rank polls before it sleeps"},
    {"remote_min_bytes", T_ULONGLONG, offsetof(NodeObject, node.remote_min), READONLY,
     "messages of a reduction-free collective this large are read in place (0: never)"},
    {"p2p_max_bytes", T_ULONGLONG, offsetof(NodeObject, node.p2p_max), READONLY,
     "larger point-to-point messages are only offered to be read in place"},
    {"remote_reads", T_LONGLONG, offsetof(NodeObject, node.remote_reads), READONLY,
     "messages this rank has read in place from its peers' memory"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Node_getset[] = {
    {"active", (getter)Node_active, NULL, "whether a call is running", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject rc_node_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ray_collective.native._core.Node",
    .tp_basicsize = sizeof(NodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Node(directory, rank, world_size, ring_bytes, part_bytes, spin_ns, "
              "remote_min_bytes=0): one rank's "
              "shared memory and executor on a node (see the package docstring)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Node_init,
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_methods = Node_methods,
    .tp_members = Node_members,
    .tp_getset = Node_getset,
};
