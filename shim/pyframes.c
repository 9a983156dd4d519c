/*
 * pyframes.c: a thread's own Python frames, read without the GIL (CPython 3.11; pyframes.h says
 * why this is sound and where it stops).
 *
 * Only the calling thread's frames are read, while it is inside C code (an operator called from
 * Python): the chain tstate->cframe->current_frame -> previous cannot change under it, and every
 * object read (code objects, their file and function names, their location tables) is held by a
 * frame that is executing. Reading is all this file does off the GIL: no CPython call, no
 * reference count, no lock, no allocation. The layout is trusted only after msh_pyframes_probe()
 * (GIL held) found it to agree with the public frame API on this very interpreter, each pointer
 * it follows first compared with the API's own before it is dereferenced.
 *
 * Must never be used on another thread's state, never write to CPython's memory, and never be
 * enabled on a version or build whose layout it does not know.
 */
#include "pyframes.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

typedef struct _object pyobj;
static struct {
    const unsigned long *version;     /* Py_Version (3.11+) */
    const void *code_type, *unicode_type, *bytes_type;
    int (*gil_check)(void);
    void *(*this_tstate)(void);
    void *(*tstate_interp)(void *);    /* PyThreadState_GetInterpreter */
    void *(*interp_get)(void);         /* PyInterpreterState_Get */
    pyobj *(*get_frame)(void);         /* borrowed */
    pyobj *(*frame_back)(pyobj *);     /* new reference */
    pyobj *(*frame_code)(pyobj *);     /* new reference */
    int (*frame_lasti)(pyobj *);
    int (*frame_line)(pyobj *);
    pyobj *(*getattr)(pyobj *, const char *);
    const char *(*as_utf8)(pyobj *);
    void (*decref)(pyobj *);
    void (*err_fetch)(pyobj **, pyobj **, pyobj **);
    void (*err_restore)(pyobj *, pyobj *, pyobj *);
    void (*err_clear)(void);
} api;
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static bool available;
static _Atomic bool probed_ok;

static void resolve(void)
{
#define SYM(f, n) (*(void **)&api.f = dlsym(RTLD_DEFAULT, n))
    SYM(version, "Py_Version");
    if (!api.version || sizeof(void *) != 8) return;
    unsigned long v = *api.version;
    if ((v >> 24) != 3 || ((v >> 16) & 0xff) != 11) return; /* the one layout known here */
    /* Debug and trace-refs builds change object headers: not this layout. */
    if (dlsym(RTLD_DEFAULT, "_Py_RefTotal") || dlsym(RTLD_DEFAULT, "_Py_PrintReferences")) return;
    api.code_type = dlsym(RTLD_DEFAULT, "PyCode_Type");
    api.unicode_type = dlsym(RTLD_DEFAULT, "PyUnicode_Type");
    api.bytes_type = dlsym(RTLD_DEFAULT, "PyBytes_Type");
    SYM(gil_check, "PyGILState_Check");
    SYM(this_tstate, "PyGILState_GetThisThreadState");
    SYM(tstate_interp, "PyThreadState_GetInterpreter");
    SYM(interp_get, "PyInterpreterState_Get");
    SYM(get_frame, "PyEval_GetFrame");
    SYM(frame_back, "PyFrame_GetBack");
    SYM(frame_code, "PyFrame_GetCode");
    SYM(frame_lasti, "PyFrame_GetLasti");
    SYM(frame_line, "PyFrame_GetLineNumber");
    SYM(getattr, "PyObject_GetAttrString");
    SYM(as_utf8, "PyUnicode_AsUTF8");
    SYM(decref, "Py_DecRef");
    SYM(err_fetch, "PyErr_Fetch");
    SYM(err_restore, "PyErr_Restore");
    SYM(err_clear, "PyErr_Clear");
#undef SYM
    available = api.code_type && api.unicode_type && api.bytes_type && api.gil_check && api.this_tstate &&
                api.tstate_interp && api.interp_get && api.get_frame && api.frame_back && api.frame_code &&
                api.frame_lasti && api.frame_line && api.getattr && api.as_utf8 && api.decref && api.err_fetch &&
                api.err_restore && api.err_clear;
}

bool msh_pyframes_available(void)
{
    pthread_once(&resolve_once, resolve);
    return available;
}

bool msh_pyframes_ok(void)
{
    return atomic_load_explicit(&probed_ok, memory_order_acquire);
}

/* ---- reading ----------------------------------------------------------------------------------- */

static bool incomplete(const struct msh_py311_iframe *f)
{
    /* _PyFrame_IsIncomplete: a frame being set up has not reached its first traceable
     * instruction; PyFrame_GetBack skips those, and so does memshim. */
    const struct msh_py311_code *co = f->f_code;
    return f->owner != 1 && f->prev_instr < co->co_code_adaptive + co->co_firsttraceable;
}

static void put(struct msh_rawframe *o, const struct msh_py311_iframe *f)
{
    const struct msh_py311_code *co = f->f_code;
    ptrdiff_t lasti = f->prev_instr - co->co_code_adaptive; /* code units */
    o->code = co;
    o->pos = lasti < 0 ? -1 : (int32_t)(lasti * 2); /* PyFrame_GetLasti: bytes */
    o->filename = co->co_filename;
    o->qualname = co->co_qualname;
    o->firstlineno = co->co_firstlineno;
}

int msh_pyframes_walk(const void *tstate, struct msh_rawframe *out, int max)
{
    const struct msh_py311_tstate *ts = tstate;
    const struct msh_py311_cframe *cf = ts ? ts->cframe : NULL;
    const struct msh_py311_iframe *f = cf ? cf->current_frame : NULL;
    int n = 0;
    for (int guard = 0; f && n < max && guard < 100000; guard++, f = f->previous) {
        const struct msh_py311_code *co = f->f_code;
        if (!co || co->ob_base.ob_type != api.code_type) return -1;
        if (!incomplete(f)) put(&out[n++], f);
    }
    return n;
}

bool msh_pyframes_same_code(const void *code, const void *filename, const void *qualname, int firstlineno)
{
    const struct msh_py311_code *co = code;
    return co && co->ob_base.ob_type == api.code_type && co->co_filename == filename &&
           co->co_qualname == qualname && co->co_firstlineno == firstlineno;
}

/* Location tables (CPython 3.11 Objects/locations.md): one entry per run of code units; its
 * first byte has bit 7 set, bits 3-6 a kind and bits 0-2 the run's length - 1. Kinds 13 and 14
 * start with the line delta as a signed varint, 10-12 mean a delta of kind - 10, 15 "no line",
 * the others the same line. Varints: 6 bits a byte, bit 6 says another byte follows. */
static unsigned varint(const uint8_t *p, const uint8_t *end)
{
    unsigned v = 0, shift = 0;
    while (p < end && shift < 32) {
        uint8_t b = *p++;
        v |= (unsigned)(b & 63) << shift;
        if (!(b & 64)) break;
        shift += 6;
    }
    return v;
}

int msh_pyframes_line(const void *code, int32_t pos)
{
    const struct msh_py311_code *co = code;
    if (pos < 0) return co->co_firstlineno; /* PyCode_Addr2Line of a frame not started */
    const struct msh_py311_bytes *lt = co->co_linetable;
    if (!lt || lt->ob_base.ob_type != api.bytes_type) return co->co_firstlineno;
    const uint8_t *p = (const uint8_t *)lt->ob_sval, *end = p + lt->ob_size;
    int line = co->co_firstlineno;
    int32_t at = 0; /* bytes */
    while (p < end) {
        uint8_t first = *p;
        int kind = (first >> 3) & 15;
        if (kind == 13 || kind == 14) {
            unsigned u = varint(p + 1, end);
            line += u & 1 ? -(int)(u >> 1) : (int)(u >> 1);
        } else if (kind >= 10 && kind <= 12) {
            line += kind - 10;
        }
        int32_t next = at + ((first & 7) + 1) * 2;
        if (pos >= at && pos < next) return kind == 15 ? -1 : line;
        at = next;
        do p++;
        while (p < end && !(*p & 128));
    }
    return -1;
}

static size_t utf8_put(char *buf, size_t o, size_t len, uint32_t c)
{
    char tmp[4];
    size_t n;
    if (c < 0x80) tmp[0] = (char)c, n = 1;
    else if (c < 0x800) tmp[0] = (char)(0xc0 | c >> 6), tmp[1] = (char)(0x80 | (c & 63)), n = 2;
    else if (c < 0x10000)
        tmp[0] = (char)(0xe0 | c >> 12), tmp[1] = (char)(0x80 | ((c >> 6) & 63)), tmp[2] = (char)(0x80 | (c & 63)), n = 3;
    else
        tmp[0] = (char)(0xf0 | c >> 18), tmp[1] = (char)(0x80 | ((c >> 12) & 63)),
        tmp[2] = (char)(0x80 | ((c >> 6) & 63)), tmp[3] = (char)(0x80 | (c & 63)), n = 4;
    if (o + n >= len) return (size_t)-1;
    memcpy(buf + o, tmp, n);
    return o + n;
}

int msh_pyframes_str(const void *str, char *buf, size_t len)
{
    const struct msh_py311_ascii *a = str;
    if (!a || !len || a->ob_base.ob_type != api.unicode_type) return -1;
    uint32_t st = a->state;
    unsigned kind = (st >> 2) & 7, compact = (st >> 5) & 1, ascii = (st >> 6) & 1, ready = (st >> 7) & 1;
    if (!compact || !ready || a->length < 0) return -1; /* a legacy string: not read here */
    size_t n = (size_t)a->length, o = 0;
    if (ascii) {
        if (n >= len) n = len - 1;
        memcpy(buf, (const char *)(a + 1), n);
        buf[n] = 0;
        return (int)n;
    }
    /* The canonical characters, never the UTF-8 cache: CPython fills that lazily, pointer first. */
    const struct msh_py311_compact *c = str;
    const void *data = c + 1;
    for (size_t i = 0; i < n; i++) {
        uint32_t ch = kind == 1 ? ((const uint8_t *)data)[i] : kind == 2 ? ((const uint16_t *)data)[i]
                                                                          : ((const uint32_t *)data)[i];
        size_t next = utf8_put(buf, o, len, ch);
        if (next == (size_t)-1) break;
        o = next;
    }
    buf[o] = 0;
    return (int)o;
}

/* ---- the probe (GIL held) ------------------------------------------------------------------------ */

static bool on_own_stack_or_in(const void *p, const void *obj, size_t objlen)
{
    if ((const char *)p >= (const char *)obj && (const char *)p < (const char *)obj + objlen) return true;
    pthread_attr_t attr;
    void *lo = NULL;
    size_t sz = 0;
    if (pthread_getattr_np(pthread_self(), &attr)) return false;
    int rc = pthread_attr_getstack(&attr, &lo, &sz);
    pthread_attr_destroy(&attr);
    return rc == 0 && (const char *)p >= (const char *)lo && (const char *)p < (const char *)lo + sz;
}

static bool same_text(pyobj *code, const char *attr, const void *raw)
{
    char mine[512];
    int n = msh_pyframes_str(raw, mine, sizeof mine);
    pyobj *v = api.getattr(code, attr);
    const char *s = v ? api.as_utf8(v) : NULL;
    /* a name longer than the buffer is compared as far as it was read */
    bool same = s && n >= 0 && ((size_t)n < sizeof mine - 1 ? strcmp(s, mine) == 0 : strncmp(s, mine, (size_t)n) == 0);
    if (!s) api.err_clear();
    if (v) api.decref(v);
    return same;
}

int msh_pyframes_probe(void)
{
    if (!msh_pyframes_available()) return ENOSYS;
    if (!api.gil_check()) return EPERM;
    void *ts = api.this_tstate();
    pyobj *f = api.get_frame(); /* borrowed */
    if (!ts || !f) return ENOENT;
    pyobj *et, *ev, *tb;
    api.err_fetch(&et, &ev, &tb);
    int rc = 0;
    /* Each pointer is compared with the API's before anything behind it is read. */
    const struct msh_py311_tstate *t = ts;
    const struct msh_py311_cframe *cf = t->cframe;
    if (t->interp != api.tstate_interp(ts) || t->interp != api.interp_get() ||
        !on_own_stack_or_in(cf, ts, 512)) {
        rc = EPROTO;
    } else {
        const struct msh_py311_iframe *raw = cf->current_frame;
        pyobj *cur = f, *held = NULL;
        int frames = 0;
        while (cur && frames < 16) {
            const struct msh_py311_frameobj *fo = (const void *)cur;
            pyobj *code = api.frame_code(cur);
            if (raw != fo->f_frame || !code || (const void *)raw->f_code != (const void *)code ||
                raw->f_code->ob_base.ob_type != api.code_type || incomplete(raw)) {
                rc = EPROTO;
            } else {
                struct msh_rawframe r;
                put(&r, raw);
                if (r.pos != api.frame_lasti(cur) || msh_pyframes_line(r.code, r.pos) != api.frame_line(cur) ||
                    !same_text(code, "co_filename", r.filename) || !same_text(code, "co_qualname", r.qualname))
                    rc = EPROTO;
            }
            if (code) api.decref(code);
            if (rc) break;
            frames++;
            pyobj *back = api.frame_back(cur);
            if (held) api.decref(held);
            held = back;
            /* the API's caller frame must be the raw chain's next one (the probe runs where no
             * frame is being set up, so there is nothing to skip) */
            if (back && raw->previous != ((const struct msh_py311_frameobj *)(const void *)back)->f_frame) {
                rc = EPROTO;
                break;
            }
            raw = back ? raw->previous : NULL;
            cur = back;
        }
        if (held) api.decref(held);
        if (!rc && !frames) rc = ENOENT;
    }
    api.err_restore(et, ev, tb);
    if (!rc) atomic_store_explicit(&probed_ok, true, memory_order_release);
    return rc;
}
