/*
 * pyframes.h: reading a thread's own Python frames without the GIL (shim/pyframes.c), for the
 * allocation sites of shim/sites.c.
 *
 * A thread inside a PyTorch operator has released the GIL, but its Python frames stay where they
 * are: only that thread pushes and pops them, and it is busy in C. So, like a sampling profiler
 * (py-spy, austin) but from inside the thread itself, memshim reads them from CPython's own
 * structures. Those are private and change with every minor version, so the reader knows exactly
 * one layout, CPython 3.11's (mirrored below, checked against the real headers by
 * tests/scenarios/pyframes_layout.c where they are installed), is used only on a 3.11 release
 * build, and only after a probe run with the GIL held found it to agree, frame by frame, with the
 * interpreter's public frame API (code object, instruction, line, file and function name).
 * Everywhere else the reader stays off and sites fall back (docs/reports.md).
 *
 * Nothing here takes a lock, allocates, changes a reference count or calls CPython, except the
 * probe (GIL held). Objects are only read while a frame that holds them executes.
 */
#ifndef MSH_PYFRAMES_H
#define MSH_PYFRAMES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- CPython 3.11 (64-bit, release build), as the headers of Include/cpython and Include/internal/
 * pycore_frame.h declare them; only the members memshim reads are named. */
struct msh_py311_object {
    intptr_t ob_refcnt;
    void *ob_type;
};
struct msh_py311_cframe { /* _PyCFrame */
    uint8_t use_tracing;
    struct msh_py311_iframe *current_frame;
    struct msh_py311_cframe *previous;
};
struct msh_py311_tstate { /* PyThreadState, up to cframe */
    void *prev, *next, *interp;
    int initialized, is_static, recursion_remaining, recursion_limit, recursion_headroom;
    int tracing, tracing_what;
    struct msh_py311_cframe *cframe;
};
struct msh_py311_iframe { /* _PyInterpreterFrame */
    void *f_func, *f_globals, *f_builtins, *f_locals;
    struct msh_py311_code *f_code;
    void *frame_obj;
    struct msh_py311_iframe *previous;
    uint16_t *prev_instr;
    int stacktop;
    bool is_entry;
    char owner; /* 1: FRAME_OWNED_BY_GENERATOR */
};
struct msh_py311_code { /* PyCodeObject (_PyCode_DEF) */
    struct msh_py311_object ob_base;
    intptr_t ob_size;
    void *co_consts, *co_names, *co_exceptiontable;
    int co_flags;
    short co_warmup, co_linearray_entry_size;
    int co_argcount, co_posonlyargcount, co_kwonlyargcount, co_stacksize, co_firstlineno;
    int co_nlocalsplus, co_nlocals, co_nplaincellvars, co_ncellvars, co_nfreevars;
    void *co_localsplusnames, *co_localspluskinds;
    void *co_filename, *co_name, *co_qualname, *co_linetable; /* str, str, str, bytes */
    void *co_weakreflist, *co_code;
    char *co_linearray;
    int co_firsttraceable;
    void *co_extra;
    uint16_t co_code_adaptive[1];
};
struct msh_py311_frameobj { /* PyFrameObject (struct _frame), up to f_frame */
    struct msh_py311_object ob_base;
    void *f_back;
    struct msh_py311_iframe *f_frame;
};
struct msh_py311_ascii { /* PyASCIIObject */
    struct msh_py311_object ob_base;
    intptr_t length, hash;
    uint32_t state; /* interned:2 kind:3 compact:1 ascii:1 ready:1 (low bits first) */
    void *wstr;
};
struct msh_py311_compact { /* PyCompactUnicodeObject */
    struct msh_py311_ascii base;
    intptr_t utf8_length;
    char *utf8;
    intptr_t wstr_length;
};
struct msh_py311_bytes { /* PyBytesObject */
    struct msh_py311_object ob_base;
    intptr_t ob_size, ob_shash;
    char ob_sval[1];
};

/* One frame as read: its code object and instruction (PyFrame_GetLasti's byte offset, -1 before
 * the first instruction), and the code object's identity (what a later code object at the same
 * address would have to repeat to be taken for it). */
struct msh_rawframe {
    const void *code;
    int32_t pos;
    const void *filename, *qualname;
    int firstlineno;
};

/* Resolve what the reader needs (CPython 3.11 release build only); idempotent. False: no reader. */
bool msh_pyframes_available(void);
/* The probe passed: the reader may run on threads without the GIL. */
bool msh_pyframes_ok(void);
/* With the GIL held: read this thread's frames both ways and compare; enable the reader when they
 * agree. 0, or why not (ENOSYS: not CPython 3.11; EPROTO: they disagree; ENOENT: no frame). */
int msh_pyframes_probe(void);
/* Up to `max` frames of `tstate` (PyGILState_GetThisThreadState() of the calling thread), the
 * innermost first, skipping frames not started yet (as PyFrame_GetBack does). Returns the count
 * (0: the thread has no Python frame: autograd's device threads), or -1 when something does not
 * look like a frame (the caller gives up on this stack). */
int msh_pyframes_walk(const void *tstate, struct msh_rawframe *out, int max);
/* The line `pos` of `code` executes (PyCode_Addr2Line's answer), from its location table. */
int msh_pyframes_line(const void *code, int32_t pos);
/* A str object as UTF-8 into buf (NUL-terminated, cut at len-1 bytes); returns the length, or -1
 * for an object this reader cannot decode (a legacy string). */
int msh_pyframes_str(const void *str, char *buf, size_t len);
/* Does the live code object at `code` still have this identity? */
bool msh_pyframes_same_code(const void *code, const void *filename, const void *qualname, int firstlineno);

#endif
