/* The Program type of ray_collective.native._core: a plan code checked once and kept, which
 * every call of its shape passes to Node.start or Node.run with its slots (program.c checks
 * it; the API is documented in ray_collective/native/__init__.py). */
#include "module.h"

#include <structmember.h>

static PyObject *Program_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"code", "dtype_code", "op_code", NULL};
    PyObject *code;
    int dtype, op;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oii", keywords, &code, &dtype, &op))
        return NULL;
    rc_kernel kernel = op == RC_OP_NONE ? NULL : rc_kernel_for(dtype, op);
    if (rc_itemsize(dtype) == 0 || (op != RC_OP_NONE && kernel == NULL)) {
        PyErr_Format(PyExc_ValueError, "no reduction for dtype code %d and op code %d", dtype,
                     op);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(code, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
        return NULL;
    if (!rc_py_is_int64(&view)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "the plan code must be a contiguous int64 array");
        return NULL;
    }
    ProgramObject *self = (ProgramObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    self->dtype_code = dtype;
    self->op_code = op;
    int built = rc_program_build(&self->program, view.buf, view.len / 8, rc_itemsize(dtype),
                                 kernel);
    PyBuffer_Release(&view);
    if (built != 0) {
        PyErr_SetString(PyExc_ValueError, self->program.error);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Program_dealloc(ProgramObject *self)
{
    rc_program_free(&self->program);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Program_members[] = {
    {"dtype_code", T_INT, offsetof(ProgramObject, dtype_code), READONLY,
     "the dtype code of its calls"},
    {"op_code", T_INT, offsetof(ProgramObject, op_code), READONLY,
     "the op code of its calls (NO_OP: they reduce nothing)"},
    {"slots", T_INT, offsetof(ProgramObject, program.n_slots), READONLY,
     "how many slots it names: a call passes at least these"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject rc_program_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ray_collective.native._core.Program",
    .tp_basicsize = sizeof(ProgramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Program(code, dtype_code, op_code): a plan code (codes.encode_plan) checked "
              "once, for calls of that dtype and op (see the package docstring)",
    .tp_new = Program_new,
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_members = Program_members,
};
