/*
 * pyframes_layout.c: memshim's mirror of CPython 3.11's frame, code, string and thread-state
 * layout (shim/pyframes.h) against the real headers, member by member. Built and run by
 * tests/scenarios/run_scenarios.py where python3 is 3.11 and its headers are installed
 * (python3-config --includes); prints one line per mismatch and "layout: N members, N differ".
 */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <stddef.h>
#include <stdio.h>

#include "pyframes.h"

static int members, differ;

#define SAME(mine, member, theirs, tmember)                                                            \
    do {                                                                                               \
        members++;                                                                                     \
        if (offsetof(mine, member) != offsetof(theirs, tmember)) {                                     \
            differ++;                                                                                  \
            printf("%s.%s at %zu, CPython's %s.%s at %zu\n", #mine, #member, offsetof(mine, member),  \
                   #theirs, #tmember, offsetof(theirs, tmember));                                     \
        }                                                                                              \
    } while (0)

int main(void)
{
    SAME(struct msh_py311_tstate, interp, PyThreadState, interp);
    SAME(struct msh_py311_tstate, cframe, PyThreadState, cframe);
    SAME(struct msh_py311_cframe, current_frame, _PyCFrame, current_frame);
    SAME(struct msh_py311_cframe, previous, _PyCFrame, previous);
    SAME(struct msh_py311_iframe, f_code, _PyInterpreterFrame, f_code);
    SAME(struct msh_py311_iframe, previous, _PyInterpreterFrame, previous);
    SAME(struct msh_py311_iframe, prev_instr, _PyInterpreterFrame, prev_instr);
    SAME(struct msh_py311_iframe, owner, _PyInterpreterFrame, owner);
    SAME(struct msh_py311_code, ob_base.ob_type, PyCodeObject, ob_base.ob_base.ob_type);
    SAME(struct msh_py311_code, co_firstlineno, PyCodeObject, co_firstlineno);
    SAME(struct msh_py311_code, co_filename, PyCodeObject, co_filename);
    SAME(struct msh_py311_code, co_name, PyCodeObject, co_name);
    SAME(struct msh_py311_code, co_qualname, PyCodeObject, co_qualname);
    SAME(struct msh_py311_code, co_linetable, PyCodeObject, co_linetable);
    SAME(struct msh_py311_code, co_firsttraceable, PyCodeObject, _co_firsttraceable);
    SAME(struct msh_py311_code, co_code_adaptive, PyCodeObject, co_code_adaptive);
    SAME(struct msh_py311_frameobj, f_frame, struct _frame, f_frame);
    SAME(struct msh_py311_ascii, length, PyASCIIObject, length);
    SAME(struct msh_py311_ascii, state, PyASCIIObject, state);
    SAME(struct msh_py311_compact, utf8_length, PyCompactUnicodeObject, utf8_length);
    SAME(struct msh_py311_bytes, ob_size, PyBytesObject, ob_base.ob_size);
    SAME(struct msh_py311_bytes, ob_sval, PyBytesObject, ob_sval);
    members += 2;
    if (sizeof(struct msh_py311_ascii) != sizeof(PyASCIIObject)) differ++, puts("sizeof PyASCIIObject differs");
    if (sizeof(struct msh_py311_compact) != sizeof(PyCompactUnicodeObject))
        differ++, puts("sizeof PyCompactUnicodeObject differs");
    /* the state bits: kind, compact, ascii, ready where memshim reads them */
    PyASCIIObject probe = {0};
    probe.state.kind = 4;
    probe.state.compact = 1;
    probe.state.ascii = 1;
    probe.state.ready = 1;
    unsigned bits;
    memcpy(&bits, &probe.state, sizeof bits);
    members++;
    if (((bits >> 2) & 7) != 4 || !((bits >> 5) & 1) || !((bits >> 6) & 1) || !((bits >> 7) & 1))
        differ++, printf("PyASCIIObject.state bits 0x%x\n", bits);
    printf("layout: %d members, %d differ\n", members, differ);
    return differ != 0;
}
