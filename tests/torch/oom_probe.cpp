/*
 * oom_probe.cpp: a Python extension for tests/torch/test_torch_cpu.py. Its one function calls
 * memshim's C++ glue (memshim_glue_malloc, the function PyTorch's pluggable allocator calls)
 * inside PyTorch's own HANDLE_TH_ERRORS, so what the glue throws reaches Python through
 * PyTorch's C++ -> Python error translation, as it does from a tensor allocation on a GPU. Test
 * code only: never installed.
 */
#include <Python.h>
#include <sys/types.h>
#include <torch/csrc/Exceptions.h>

typedef void *(*glue_malloc_fn)(ssize_t, int, void *);
typedef void (*glue_free_fn)(void *, ssize_t, int, void *);

/* alloc(glue_malloc_address, size, device) -> pointer as int */
static PyObject *probe_alloc(PyObject *, PyObject *args)
{
    HANDLE_TH_ERRORS
    unsigned long long fn = 0;
    long long size = 0;
    int device = 0;
    if (!PyArg_ParseTuple(args, "KLi", &fn, &size, &device)) return nullptr;
    void *p = reinterpret_cast<glue_malloc_fn>(fn)(static_cast<ssize_t>(size), device, nullptr);
    return PyLong_FromVoidPtr(p);
    END_HANDLE_TH_ERRORS
}

/* free(glue_free_address, ptr, size, device) */
static PyObject *probe_free(PyObject *, PyObject *args)
{
    HANDLE_TH_ERRORS
    unsigned long long fn = 0, ptr = 0;
    long long size = 0;
    int device = 0;
    if (!PyArg_ParseTuple(args, "KKLi", &fn, &ptr, &size, &device)) return nullptr;
    reinterpret_cast<glue_free_fn>(fn)(reinterpret_cast<void *>(ptr), static_cast<ssize_t>(size), device, nullptr);
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
}

static PyMethodDef methods[] = {
    {"alloc", probe_alloc, METH_VARARGS, "call memshim_glue_malloc under HANDLE_TH_ERRORS"},
    {"free", probe_free, METH_VARARGS, "call memshim_glue_free under HANDLE_TH_ERRORS"},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "memshim_oom_probe", nullptr, -1, methods,
                                    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit_memshim_oom_probe(void)
{
    return PyModule_Create(&module);
}
