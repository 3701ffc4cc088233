/* rlrec.producer._stack: the recorder's column stacking in one C pass (issue 15).

   `EpisodeRecorder` buffers a batch as a list of per-step tuples and stacks each field into
   one contiguous column when the batch is sent.  In Python that is several passes per column
   (zip, join, a dtype check per value); here it is one loop that reads each value once.

   The contract is narrow on purpose: `stack` returns the column's bytes only when every value
   is *exactly* representable in the column's dtype without numpy's help - an ndarray or numpy
   scalar of that very dtype (and, for arrays, the expected shape, C-contiguous), a Python int in
   range of an integer dtype (of a space's column; extra outputs, whose dtype numpy infers, take
   one only as int64), a Python float for float64.  For anything else it returns None and
   the caller stacks the batch in Python as before (numpy decides casts and raises its errors).
   So wherever this module returns bytes they are the bytes the Python path would write, and
   it never raises for a value it does not like.  It reads objects only: no attribute lookups,
   no __index__, no conversions; the one Python code it can run is a dict key's __eq__ on a hash
   collision in the extra-outputs lookup, and it holds a reference to the step meanwhile.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>

/* One value into `dst` (`nbytes` bytes); 1 on success, 0 when the value is not exact for the
   column (the caller then gives up on the whole column).  `inferred`: the column's dtype is the
   one numpy would infer from the values (no space casts them), see below for Python ints. */
static int
put_value(PyObject *v, PyArray_Descr *dtype, npy_intp ndim, const npy_intp *dims, npy_intp nbytes,
          int inferred, char *dst)
{
    if (PyArray_CheckExact(v)) {
        PyArrayObject *a = (PyArrayObject *)v;
        PyArray_Descr *d = PyArray_DESCR(a);
        if (d != dtype && !PyArray_EquivTypes(d, dtype)) {
            return 0;
        }
        if (PyArray_NDIM(a) != ndim || !PyArray_IS_C_CONTIGUOUS(a)) {
            return 0;
        }
        const npy_intp *ad = PyArray_DIMS(a);
        for (npy_intp i = 0; i < ndim; i++) {
            if (ad[i] != dims[i]) {
                return 0;
            }
        }
        if (PyArray_NBYTES(a) != nbytes) {
            return 0;
        }
        memcpy(dst, PyArray_DATA(a), (size_t)nbytes);
        return 1;
    }
    if (ndim != 0) {
        return 0;
    }
    if (PyArray_IsScalar(v, Generic)) {
        PyArray_Descr *d = PyArray_DescrFromScalar(v);
        if (d == NULL) {
            PyErr_Clear();
            return 0;
        }
        int same = (d == dtype || PyArray_EquivTypes(d, dtype)) && PyDataType_ELSIZE(d) == nbytes;
        Py_DECREF(d);
        if (!same) {
            return 0;
        }
        PyArray_ScalarAsCtype(v, dst);
        return 1;
    }
    int type_num = dtype->type_num;
    if (PyFloat_CheckExact(v)) {
        if (type_num != NPY_FLOAT64 || nbytes != 8) {
            return 0;
        }
        double x = PyFloat_AS_DOUBLE(v);
        memcpy(dst, &x, 8);
        return 1;
    }
    if (PyLong_CheckExact(v)) {
        /* a column whose dtype numpy infers (extra model outputs): a Python int among numpy
           values makes it numpy's default integer, so only such a column takes one as is */
        if (inferred && !PyArray_EquivTypenums(type_num, NPY_INTP)) {
            return 0;
        }
        int overflow = 0;
        if (PyTypeNum_ISSIGNED(type_num)) {
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow || (x == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return 0;
            }
            switch (nbytes) {
            case 1: { if (x < INT8_MIN || x > INT8_MAX) return 0; int8_t y = (int8_t)x; memcpy(dst, &y, 1); return 1; }
            case 2: { if (x < INT16_MIN || x > INT16_MAX) return 0; int16_t y = (int16_t)x; memcpy(dst, &y, 2); return 1; }
            case 4: { if (x < INT32_MIN || x > INT32_MAX) return 0; int32_t y = (int32_t)x; memcpy(dst, &y, 4); return 1; }
            case 8: { int64_t y = (int64_t)x; memcpy(dst, &y, 8); return 1; }
            default: return 0;
            }
        }
        if (PyTypeNum_ISUNSIGNED(type_num)) {
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            switch (nbytes) {
            case 1: { if (x > UINT8_MAX) return 0; uint8_t y = (uint8_t)x; memcpy(dst, &y, 1); return 1; }
            case 2: { if (x > UINT16_MAX) return 0; uint16_t y = (uint16_t)x; memcpy(dst, &y, 2); return 1; }
            case 4: { if (x > UINT32_MAX) return 0; uint32_t y = (uint32_t)x; memcpy(dst, &y, 4); return 1; }
            case 8: { uint64_t y = (uint64_t)x; memcpy(dst, &y, 8); return 1; }
            default: return 0;
            }
        }
        return 0;
    }
    return 0;
}

PyDoc_STRVAR(stack_doc,
"stack(steps, index, key, nkeys, dtype, shape, inferred) -> bytes | None\n\n"
"The column of field `index` of every tuple in the list `steps` (with `key` not None: the value\n"
"under `key` of that field, which must be a dict of exactly `nkeys` items), stacked as `dtype`\n"
"values of per-step `shape`; None unless every value is exact for that dtype and shape (see the\n"
"module's docstring).  `inferred`: the dtype is what numpy infers from the values (no space\n"
"casts them), so a Python int is taken only for numpy's default integer.");

static PyObject *
stack(PyObject *self, PyObject *args)
{
    PyObject *steps, *key, *shape;
    Py_ssize_t index, nkeys;
    PyArray_Descr *dtype;
    int inferred;
    if (!PyArg_ParseTuple(args, "O!nOnO!O!p:stack", &PyList_Type, &steps, &index, &key, &nkeys,
                          &PyArrayDescr_Type, &dtype, &PyTuple_Type, &shape, &inferred)) {
        return NULL;
    }
    int t = dtype->type_num;
    if (!(PyTypeNum_ISBOOL(t) || PyTypeNum_ISINTEGER(t) || PyTypeNum_ISFLOAT(t)) ||
        !PyArray_ISNBO(dtype->byteorder)) {
        Py_RETURN_NONE; /* wire dtypes only: bool, integers, floats, in native byte order */
    }
    if (key == Py_None) {
        key = NULL;
    }
    else if (!PyUnicode_CheckExact(key)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > NPY_MAXDIMS) {
        Py_RETURN_NONE;
    }
    npy_intp dims[NPY_MAXDIMS];
    npy_intp nbytes = PyDataType_ELSIZE(dtype);
    for (Py_ssize_t i = 0; i < ndim; i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (d < 0) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
        dims[i] = d;
        if (d != 0 && nbytes > PY_SSIZE_T_MAX / d) {
            Py_RETURN_NONE;
        }
        nbytes *= d;
    }
    Py_ssize_t n = PyList_GET_SIZE(steps);
    if (n == 0 || nbytes <= 0 || nbytes > PY_SSIZE_T_MAX / n) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * nbytes);
    if (out == NULL) {
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t j = 0; j < n; j++, dst += nbytes) {
        if (j >= PyList_GET_SIZE(steps)) {
            goto give_up; /* shrunk by Python code run from a key's __eq__ */
        }
        PyObject *step = PyList_GET_ITEM(steps, j);
        if (!PyTuple_CheckExact(step) || index < 0 || index >= PyTuple_GET_SIZE(step)) {
            goto give_up;
        }
        Py_INCREF(step); /* a key's __eq__ (hash collision) may run Python code below */
        PyObject *v = PyTuple_GET_ITEM(step, index);
        if (key != NULL) {
            if (!PyDict_CheckExact(v) || PyDict_GET_SIZE(v) != nkeys) {
                Py_DECREF(step);
                goto give_up;
            }
            v = PyDict_GetItemWithError(v, key);
            if (v == NULL) {
                PyErr_Clear();
                Py_DECREF(step);
                goto give_up;
            }
        }
        Py_INCREF(v); /* and its value, which such code could take out of the dict */
        int ok = put_value(v, dtype, ndim, dims, nbytes, inferred, dst);
        Py_DECREF(v);
        Py_DECREF(step);
        if (!ok) {
            goto give_up;
        }
    }
    return out;
give_up:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(any_set_doc,
"any_set(steps, index) -> bool\n\n"
"True when field `index` of some tuple in the list `steps` is neither None nor an empty str\n"
"or dict (the batch carries infos or extra model outputs); None when a field is anything else\n"
"(a Mapping, a list: Python decides) or `steps` holds anything else than such tuples.");

static PyObject *
any_set(PyObject *self, PyObject *args)
{
    PyObject *steps;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "O!n:any_set", &PyList_Type, &steps, &index)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(steps);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *step = PyList_GET_ITEM(steps, j);
        if (!PyTuple_CheckExact(step) || index < 0 || index >= PyTuple_GET_SIZE(step)) {
            Py_RETURN_NONE;
        }
        PyObject *v = PyTuple_GET_ITEM(step, index);
        if (v == Py_None) {
            continue;
        }
        if (PyUnicode_CheckExact(v)) {
            if (PyUnicode_GET_LENGTH(v)) Py_RETURN_TRUE;
        }
        else if (PyDict_CheckExact(v)) {
            if (PyDict_GET_SIZE(v)) Py_RETURN_TRUE;
        }
        else {
            Py_RETURN_NONE; /* a Mapping or anything else: let Python decide */
        }
    }
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"stack", stack, METH_VARARGS, stack_doc},
    {"any_set", any_set, METH_VARARGS, any_set_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rlrec.producer._stack",
    "The recorder's column stacking in C (see producer/_stack.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__stack(void)
{
    import_array();
    return PyModule_Create(&module);
}
