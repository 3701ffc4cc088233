/* rlrec.producer._hotpath: `EpisodeRecorder.log_step` for a step in the middle of a batch, in C.

   Most calls of `log_step` only append the step to its episode's buffered batch.  In Python that
   is ~0.45 us of checks, a lock, a dict lookup and counting per step - what a bare produce()
   costs.  Here it is the same work without the bytecode.

   The contract is narrow on purpose, as for `_stack`: the C method takes a call only when the
   Python method (`EpisodeRecorder._log_step_py`) would do exactly this and nothing else -

     - the recorder is usable and `validate_spaces` is False;
     - `episode_id` is a str, `reward` a finite float, `terminated`/`truncated` False or None,
       `info` None or an empty dict;
     - the observation is an ndarray of the space's shape (no `prepare`), the action a Python
       int for a scalar space, or an ndarray / numpy scalar of the space's shape;
     - the episode is open, past its first step (whose checks stay in Python), not dropping,
       its batch not empty (Python stamps the batch's start time) and not full after this step
       (Python sends it), and the buffer has room (else Python applies `on_overflow`);

   then, holding the recorder's lock, it appends the tuple (action, reward, observation, "",
   extra_model_outputs) that Python would append and counts the record.  Any other call -
   including every call that raises, odd argument forms and unknown keywords - goes to
   `_log_step_py` with the arguments as given, before anything is changed.  It runs no Python
   code while it holds the lock: the id it looks up is an exact str, and so is every key of
   `_episodes` (`begin_episode` stores exact str); values are only stored, never converted.
   As Python does, it keeps one lock for the whole call (`_lock` may be replaced meanwhile),
   reads `_episodes` after acquiring it, and raises what the lookup raises.

   `RecorderCore` and `EpisodeState` hold the fields the fast path reads as C members; the
   Python classes (`EpisodeRecorder`, `_Episode`) derive from them and use them as attributes.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>

/* -- EpisodeState: an episode's fields read on the hot path ------------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_ssize_t t;       /* steps logged so far */
    PyObject *steps;    /* the buffered steps: a list of tuples */
    PyObject *dropping; /* truthy: nothing more of the episode is sent */
} EpisodeState;

static int
episode_traverse(EpisodeState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->steps);
    Py_VISIT(self->dropping);
    return 0;
}

static int
episode_clear(EpisodeState *self)
{
    Py_CLEAR(self->steps);
    Py_CLEAR(self->dropping);
    return 0;
}

static void
episode_dealloc(EpisodeState *self)
{
    PyObject_GC_UnTrack(self);
    episode_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef episode_members[] = {
    {"t", T_PYSSIZET, offsetof(EpisodeState, t), 0, "steps logged so far"},
    {"steps", T_OBJECT_EX, offsetof(EpisodeState, steps), 0, "the buffered steps"},
    {"dropping", T_OBJECT_EX, offsetof(EpisodeState, dropping), 0, "nothing more of it is sent"},
    {NULL},
};

static PyTypeObject EpisodeStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rlrec.producer._hotpath.EpisodeState",
    .tp_doc = "The fields of a recorder's open episode that log_step's fast path reads.",
    .tp_basicsize = sizeof(EpisodeState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)episode_traverse,
    .tp_clear = (inquiry)episode_clear,
    .tp_dealloc = (destructor)episode_dealloc,
    .tp_members = episode_members,
};

/* -- RecorderCore: the recorder's fields read on the hot path ---------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t buffered;     /* records produced, not yet delivered or failed */
    Py_ssize_t max_buffered; /* max_buffered_steps (the Python property clamps it) */
    Py_ssize_t batch_limit;  /* a batch this long is sent */
    PyObject *unusable;      /* truthy: closed or forked */
    PyObject *validate;      /* validate_spaces */
    PyObject *episodes;      /* open episodes by id */
    PyObject *obs_shape;     /* the observation's shape: a tuple (else always prepared) */
    PyObject *act_shape;     /* the action's shape: a tuple (else always prepared) */
    PyObject *act_scalar;    /* True: a Python int action needs no preparing */
    PyObject *lock;          /* the recorder's threading.Lock */
    PyObject *acquire;       /* its bound acquire and release */
    PyObject *release;
} RecorderCore;

static int
core_traverse(RecorderCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->unusable);
    Py_VISIT(self->validate);
    Py_VISIT(self->episodes);
    Py_VISIT(self->obs_shape);
    Py_VISIT(self->act_shape);
    Py_VISIT(self->act_scalar);
    Py_VISIT(self->lock);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    return 0;
}

static int
core_clear(RecorderCore *self)
{
    Py_CLEAR(self->unusable);
    Py_CLEAR(self->validate);
    Py_CLEAR(self->episodes);
    Py_CLEAR(self->obs_shape);
    Py_CLEAR(self->act_shape);
    Py_CLEAR(self->act_scalar);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    return 0;
}

static void
core_dealloc(RecorderCore *self)
{
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
core_get_lock(RecorderCore *self, void *closure)
{
    if (self->lock == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_lock");
        return NULL;
    }
    return Py_NewRef(self->lock);
}

/* `_lock` may be set, never deleted; its acquire and release are looked up once here */
static int
core_set_lock(RecorderCore *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_lock cannot be deleted");
        return -1;
    }
    PyObject *acquire = PyObject_GetAttrString(value, "acquire");
    if (acquire == NULL) {
        return -1;
    }
    PyObject *release = PyObject_GetAttrString(value, "release");
    if (release == NULL) {
        Py_DECREF(acquire);
        return -1;
    }
    Py_XSETREF(self->acquire, acquire);
    Py_XSETREF(self->release, release);
    Py_XSETREF(self->lock, Py_NewRef(value));
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"_lock", (getter)core_get_lock, (setter)core_set_lock, "the recorder's lock", NULL},
    {NULL},
};

static PyMemberDef core_members[] = {
    {"_buffered", T_PYSSIZET, offsetof(RecorderCore, buffered), 0, NULL},
    {"_max_buffered_steps", T_PYSSIZET, offsetof(RecorderCore, max_buffered), 0, NULL},
    {"_batch_limit", T_PYSSIZET, offsetof(RecorderCore, batch_limit), 0, NULL},
    {"_unusable", T_OBJECT_EX, offsetof(RecorderCore, unusable), 0, NULL},
    {"validate_spaces", T_OBJECT_EX, offsetof(RecorderCore, validate), 0,
     "check every value with Space.contains"},
    {"_episodes", T_OBJECT_EX, offsetof(RecorderCore, episodes), 0, NULL},
    {"_obs_shape", T_OBJECT_EX, offsetof(RecorderCore, obs_shape), 0, NULL},
    {"_act_shape", T_OBJECT_EX, offsetof(RecorderCore, act_shape), 0, NULL},
    {"_act_scalar", T_OBJECT_EX, offsetof(RecorderCore, act_scalar), 0, NULL},
    {NULL},
};

/* interned names */
static PyObject *str_slow;     /* "_log_step_py" */
static PyObject *kw_names[8];  /* log_step's parameters, in order */
static PyObject *empty_str;    /* "" */

/* 1 when the array's shape is the tuple `shape` of exact ints, else 0 (not an error) */
static int
same_shape(PyArrayObject *a, PyObject *shape)
{
    if (shape == NULL || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != PyArray_NDIM(a)) {
        return 0;
    }
    const npy_intp *dims = PyArray_DIMS(a);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        PyObject *d = PyTuple_GET_ITEM(shape, i);
        if (!PyLong_CheckExact(d)) {
            return 0;
        }
        Py_ssize_t n = PyLong_AsSsize_t(d);
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (n != dims[i]) {
            return 0;
        }
    }
    return 1;
}

/* 1 when `log_step` needs no `prepare` for this action (see the module's comment) */
static int
action_as_is(RecorderCore *self, PyObject *action)
{
    if (PyLong_CheckExact(action)) {
        return self->act_scalar == Py_True;
    }
    if (PyArray_CheckExact(action)) {
        return same_shape((PyArrayObject *)action, self->act_shape);
    }
    /* a numpy scalar of a numpy type (not a subclass, whose `shape` could be anything): shape () */
    if (PyArray_IsScalar(action, Generic) && !(Py_TYPE(action)->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        return self->act_shape != NULL && PyTuple_CheckExact(self->act_shape) &&
               PyTuple_GET_SIZE(self->act_shape) == 0;
    }
    return 0;
}

static PyObject *
slow_path(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[12];
    PyObject **all = small;
    if (nargs + nkw + 1 > 12) {
        all = PyMem_Malloc((size_t)(nargs + nkw + 1) * sizeof(PyObject *));
        if (all == NULL) {
            return PyErr_NoMemory();
        }
    }
    all[0] = self;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++) {
        all[i + 1] = args[i];
    }
    PyObject *r = PyObject_VectorcallMethod(str_slow, all, (size_t)(nargs + 1), kwnames);
    if (all != small) {
        PyMem_Free(all);
    }
    return r;
}

/* the lock's acquire/release; -1 with an exception (e.g. KeyboardInterrupt while waiting) */
static int
call_lock(PyObject *method)
{
    PyObject *r = PyObject_CallNoArgs(method);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

PyDoc_STRVAR(log_step_doc,
"log_step($self, episode_id, action, reward, observation, terminated=False, truncated=False,\n"
"         info=None, extra_model_outputs=None)\n"
"--\n"
"\n"
"Record one step: `action` taken, `reward` received, `observation` after it.\n"
"\n"
"Values are stacked when the batch is sent (within `max_batch_delay_s`): don't mutate an\n"
"array after passing it in. (A step in the middle of a batch is taken in C; every other\n"
"call by `_log_step_py`, with the same effect.)");

static PyObject *
core_log_step(RecorderCore *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *a[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (nargs > 8) {
        goto slow;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        a[i] = args[i];
    }
    if (kwnames != NULL) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k);
            int found = 0;
            for (int j = 0; j < 8; j++) {
                /* keyword names are interned str when written in source; others go to Python */
                if (name == kw_names[j]) {
                    if (a[j] != NULL) {
                        goto slow; /* given twice: Python raises */
                    }
                    a[j] = args[nargs + k];
                    found = 1;
                    break;
                }
            }
            if (!found) {
                goto slow;
            }
        }
    }
    PyObject *episode_id = a[0], *action = a[1], *reward = a[2], *observation = a[3];
    PyObject *terminated = a[4], *truncated = a[5], *info = a[6];
    PyObject *extra = a[7] ? a[7] : Py_None;
    if (episode_id == NULL || action == NULL || reward == NULL || observation == NULL) {
        goto slow;
    }
    if (self->unusable != Py_False || self->validate != Py_False) {
        goto slow;
    }
    if (!PyUnicode_CheckExact(episode_id) || !PyFloat_CheckExact(reward) ||
        !isfinite(PyFloat_AS_DOUBLE(reward))) {
        goto slow;
    }
    if ((terminated != NULL && terminated != Py_False && terminated != Py_None) ||
        (truncated != NULL && truncated != Py_False && truncated != Py_None)) {
        goto slow;
    }
    if (info != NULL && info != Py_None && !(PyDict_CheckExact(info) && PyDict_GET_SIZE(info) == 0)) {
        goto slow;
    }
    if (!PyArray_CheckExact(observation) || !same_shape((PyArrayObject *)observation, self->obs_shape)) {
        goto slow;
    }
    if (!action_as_is(self, action)) {
        goto slow;
    }
    if (self->acquire == NULL) {
        goto slow;
    }
    /* allocated before the lock: a collection it may start runs no code of ours under the lock */
    PyObject *step = PyTuple_Pack(5, action, reward, observation, empty_str, extra);
    if (step == NULL) {
        return NULL;
    }
    /* one lock for the whole call, as Python's `lock = self._lock`: `_lock` may be replaced
       (and the old one freed) while acquire() waits */
    PyObject *acquire = Py_NewRef(self->acquire), *release = Py_NewRef(self->release);
    if (call_lock(acquire) < 0) {
        Py_DECREF(step);
        Py_DECREF(acquire);
        Py_DECREF(release);
        return NULL;
    }
    /* read after acquire(), as Python does: anything may have run while it waited */
    PyObject *episodes = self->episodes;
    int taken = 0, failed = 0;
    PyObject *held = NULL;
    if (episodes != NULL && PyDict_CheckExact(episodes)) {
        held = Py_NewRef(episodes); /* a key's __eq__ may replace self->episodes during the lookup */
        PyObject *ep = PyDict_GetItemWithError(episodes, episode_id); /* borrowed */
        if (ep != NULL && PyObject_TypeCheck(ep, &EpisodeStateType)) {
            EpisodeState *es = (EpisodeState *)ep;
            PyObject *steps = es->steps;
            if (es->t > 0 && es->dropping == Py_False && self->buffered < self->max_buffered &&
                steps != NULL && PyList_CheckExact(steps) && PyList_GET_SIZE(steps) > 0 &&
                PyList_GET_SIZE(steps) + 1 < self->batch_limit) {
                if (PyList_Append(steps, step) < 0) {
                    failed = 1;
                }
                else {
                    self->buffered += 1;
                    es->t += 1;
                    taken = 1;
                }
            }
        }
        else if (ep == NULL && PyErr_Occurred()) {
            failed = 1; /* raised in the lookup (a key's __eq__): as Python's lookup would */
        }
    }
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    int rel = call_lock(release);
    /* after the release: a last reference may run __del__s */
    Py_DECREF(step);
    Py_DECREF(acquire);
    Py_DECREF(release);
    Py_XDECREF(held);
    if (failed) {
        if (rel < 0) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (rel < 0) {
        return NULL;
    }
    if (taken) {
        Py_RETURN_NONE;
    }
slow:
    return slow_path((PyObject *)self, args, nargsf, kwnames);
}

static PyMethodDef core_methods[] = {
    {"log_step", (PyCFunction)(void (*)(void))core_log_step, METH_FASTCALL | METH_KEYWORDS, log_step_doc},
    {NULL},
};

static PyTypeObject RecorderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rlrec.producer._hotpath.RecorderCore",
    .tp_doc = "The fields of an EpisodeRecorder that log_step's fast path reads, and that path.",
    .tp_basicsize = sizeof(RecorderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_members = core_members,
    .tp_getset = core_getset,
    .tp_methods = core_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rlrec.producer._hotpath",
    "EpisodeRecorder.log_step's fast path in C (see producer/_hotpath.c).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    import_array();
    static const char *names[8] = {"episode_id", "action", "reward", "observation",
                                   "terminated", "truncated", "info", "extra_model_outputs"};
    for (int j = 0; j < 8; j++) {
        kw_names[j] = PyUnicode_InternFromString(names[j]);
        if (kw_names[j] == NULL) {
            return NULL;
        }
    }
    str_slow = PyUnicode_InternFromString("_log_step_py");
    empty_str = PyUnicode_FromString("");
    if (str_slow == NULL || empty_str == NULL) {
        return NULL;
    }
    if (PyType_Ready(&EpisodeStateType) < 0 || PyType_Ready(&RecorderCoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "EpisodeState", (PyObject *)&EpisodeStateType) < 0 ||
        PyModule_AddObjectRef(m, "RecorderCore", (PyObject *)&RecorderCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
