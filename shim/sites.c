/*
 * sites.c: Python allocation sites for the blocks memshim places in tensor mode (memshim_malloc).
 *
 * PyTorch calls the pluggable allocator from inside its operators, where the Python bindings have
 * released the GIL (checked: another Python thread runs at full speed during a CPU matmul). So,
 * as PyTorch's own memory-history recorder does, the stack is read (1) directly when this thread
 * holds the GIL, (2) after re-taking the GIL when this thread is a Python thread that released it
 * (PyGILState_GetThisThreadState() != NULL), and (3) never on a thread with no Python state
 * (autograd's backward workers, other C++ threads): those allocations are the pseudo site
 * "backward". Re-taking the GIL costs tens of ns when it is free but waits for the holder when
 * another Python thread runs (130 us measured): two acquisitions in a row slower than GIL_SLOW_NS
 * turn case (2) off for GIL_BACKOFF_NS, so a busy GIL costs at most two waits per second. (One
 * slow acquisition is not enough: on a loaded machine a thread preempted while it takes a free
 * GIL looks just as slow, and would turn the sites off for a second.)
 *
 * A stack is a list of interned frames keyed by (code object, instruction offset) on CPython
 * 3.11+ (PyFrame_GetLasti) or (code object, line) before; file, function and line are resolved
 * once per key, with the code object kept alive by one reference so its address is never reused.
 * The site is the first frame outside torch and memshim's own package. Every table lives in
 * mmap'd memory of fixed capacity (no malloc while any lock is held; when a table is full new
 * stacks count as "unattributed").
 *
 * Allocations below MEMSHIM_SITES_SAMPLE bytes are sampled (a Poisson process over bytes, per
 * thread; weight size/P(sampled)), larger ones are always attributed exactly; while the history
 * ring records, every allocation is. Live bytes per (site, device) are kept at the epoch's peak
 * (a copy taken whenever the device's tensor bytes pass the last copy by 1/64) and at each
 * epoch's end (the leak verdict per site).
 *
 * Must never be called with a pool lock held, never call a CUDA hook, never leave a Python
 * exception set, and never take the GIL while holding any memshim lock.
 */
#include "sites.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "hotclock.h"
#include "msh.h"
#include "pool.h" /* msh_pool_block_tags: the marks memshim_malloc left on its blocks */
#include "pyframes.h"

__thread uint32_t msh_sites_last_stack;

/* ---- CPython, resolved at run time ------------------------------------------------------------ */

typedef struct _object pyobj;
static struct {
    int (*is_initialized)(void);
    int (*is_finalizing)(void);
    int (*gil_check)(void);
    void *(*this_thread_state)(void);
    int (*ensure)(void);
    void (*release)(int);
    pyobj *(*get_frame)(void);       /* borrowed */
    pyobj *(*frame_back)(pyobj *);   /* new reference */
    pyobj *(*frame_code)(pyobj *);   /* new reference */
    int (*frame_line)(pyobj *);
    int (*frame_lasti)(pyobj *);     /* 3.11+ */
    void (*incref)(pyobj *);
    void (*decref)(pyobj *);
    pyobj *(*getattr)(pyobj *, const char *);
    const char *(*as_utf8)(pyobj *);
    void (*err_fetch)(pyobj **, pyobj **, pyobj **);
    void (*err_restore)(pyobj *, pyobj *, pyobj *);
    void (*err_clear)(void);
} py;
static bool py_ok;
static const char *py_missing; /* why there are no sites */

static void py_resolve(void)
{
#define PYSYM(f, n) (*(void **)&py.f = dlsym(RTLD_DEFAULT, n))
    PYSYM(is_initialized, "Py_IsInitialized");
    if (!py.is_initialized) {
        py_missing = "no Python interpreter in this process: allocation sites need CPython";
        return;
    }
    if (!PYSYM(is_finalizing, "Py_IsFinalizing")) PYSYM(is_finalizing, "_Py_IsFinalizing");
    PYSYM(gil_check, "PyGILState_Check");
    PYSYM(this_thread_state, "PyGILState_GetThisThreadState");
    PYSYM(ensure, "PyGILState_Ensure");
    PYSYM(release, "PyGILState_Release");
    PYSYM(get_frame, "PyEval_GetFrame");
    PYSYM(frame_back, "PyFrame_GetBack");  /* 3.9+ */
    PYSYM(frame_code, "PyFrame_GetCode");  /* 3.9+ */
    PYSYM(frame_line, "PyFrame_GetLineNumber");
    PYSYM(frame_lasti, "PyFrame_GetLasti"); /* 3.11+: optional */
    PYSYM(incref, "Py_IncRef");
    PYSYM(decref, "Py_DecRef");
    PYSYM(getattr, "PyObject_GetAttrString");
    PYSYM(as_utf8, "PyUnicode_AsUTF8");
    PYSYM(err_fetch, "PyErr_Fetch");
    PYSYM(err_restore, "PyErr_Restore");
    PYSYM(err_clear, "PyErr_Clear");
#undef PYSYM
    py_ok = py.gil_check && py.this_thread_state && py.ensure && py.release && py.get_frame &&
            py.frame_back && py.frame_code && py.frame_line && py.incref && py.decref && py.getattr &&
            py.as_utf8 && py.err_fetch && py.err_restore && py.err_clear;
    if (!py_ok) py_missing = "this Python lacks PyFrame_GetBack/PyFrame_GetCode (CPython 3.9 or newer is needed)";
}

/* ---- settings and state ------------------------------------------------------------------------ */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static _Atomic bool sites_wanted; /* reports or a snapshot history are on */
static bool sites_ready;          /* CPython found and the tables mapped */
_Atomic bool msh_sites_active; /* ready and wanted: capture and account (sites.h) */
#define sites_on atomic_load_explicit(&msh_sites_active, memory_order_relaxed)
static int sites_mode;         /* enum msh_sites_mode */
static uint64_t sample_T;      /* MEMSHIM_SITES_SAMPLE */
static _Atomic int capture_all; /* the history ring records: no sampling */

#define GIL_SLOW_NS 20000ull           /* an acquisition this slow means another thread runs Python */
#define GIL_BACKOFF_NS 1000000000ull   /* then do not re-take the GIL for a second */
static _Atomic uint64_t gil_backoff_until;
static uint64_t gil_slow_ticks = GIL_SLOW_NS; /* GIL_SLOW_NS in msh_ticks() units (do_init) */
static __thread int tl_gil_slow;              /* slow acquisitions in a row on this thread */

/* Anonymous memory, committed only where touched; never from malloc. */
static void *vm(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* ---- interned strings, code objects, frames, sites and stacks (intern_lock) ------------------- */

#define STR_CAP ((size_t)8 << 20)
#define STRIDX_CAP (1u << 16)
#define CODE_CAP (1u << 15)
#define FRAME_CAP (1u << 17)
#define SITE_CAP (1u << 15)
#define STACK_CAP (1u << 17)
#define STKF_CAP ((size_t)STACK_CAP * 8)
#define WALK_MAX 48     /* frames looked at to find the site */
#define SITE_CALLERS 3  /* frames kept above the site while the history records */

/* A code object: its names, and how to know it again. `strong`: memshim holds a reference (taken
 * with the GIL, so the address cannot be reused while interned). Otherwise (read without the GIL,
 * shim/pyframes.c) the object may die and another take its address: it is the same one only when
 * it still has the same file and name objects and first line. */
struct code_ent {
    uint64_t ptr;
    uint32_t file, name;
    uint8_t internal, strong;
    const void *id_file, *id_name;
    int id_line;
};
struct frame_ent { uint64_t codep; int32_t pos, line; uint32_t code, site; uint8_t internal; };
struct site_ent { uint32_t code, file, name; int32_t line; };
struct stack_ent { uint32_t hash, off, site; uint16_t n; };

static pthread_mutex_t intern_lock = PTHREAD_MUTEX_INITIALIZER;
static bool tables_ok;
static char *str_arena;
static size_t str_len;
static uint32_t *str_idx; /* offset + 1 */
static struct code_ent *codes;
static uint32_t *code_idx, ncodes;
static struct frame_ent *frames;
static uint32_t *frame_idx, nframes;
static struct site_ent *sites;
static uint32_t *site_idx, nsites_total; /* sites[0] unused; 1, 2: pseudo sites */
static struct stack_ent *stacks;
static uint32_t *stack_idx, nstacks;
static uint32_t *stkf;
static size_t nstkf;

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static uint32_t str_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

/* Offset of a NUL-terminated copy of s[0..n) in the arena (0 is ""), or 0 when full. */
static uint32_t str_intern(const char *s, size_t n)
{
    if (n > 4096) n = 4096;
    uint32_t mask = STRIDX_CAP * 2 - 1;
    for (uint32_t i = str_hash(s, n) & mask;; i = (i + 1) & mask) {
        uint32_t v = str_idx[i];
        if (!v) {
            if (str_len + n + 1 > STR_CAP) return 0;
            memcpy(str_arena + str_len, s, n);
            str_arena[str_len + n] = 0;
            str_idx[i] = (uint32_t)str_len + 1;
            str_len += n + 1;
            return (uint32_t)(str_len - n - 1);
        }
        const char *t = str_arena + v - 1;
        if (strlen(t) == n && !memcmp(t, s, n)) return v - 1;
    }
}

static bool tables_init(void)
{
    str_arena = vm(STR_CAP);
    str_idx = vm((size_t)STRIDX_CAP * 2 * sizeof *str_idx);
    codes = vm((size_t)CODE_CAP * sizeof *codes);
    code_idx = vm((size_t)CODE_CAP * 2 * sizeof *code_idx);
    frames = vm((size_t)FRAME_CAP * sizeof *frames);
    frame_idx = vm((size_t)FRAME_CAP * 2 * sizeof *frame_idx);
    sites = vm((size_t)SITE_CAP * sizeof *sites);
    site_idx = vm((size_t)SITE_CAP * 2 * sizeof *site_idx);
    stacks = vm((size_t)STACK_CAP * sizeof *stacks);
    stack_idx = vm((size_t)STACK_CAP * 2 * sizeof *stack_idx);
    stkf = vm(STKF_CAP * sizeof *stkf);
    if (!str_arena || !str_idx || !codes || !code_idx || !frames || !frame_idx || !sites || !site_idx ||
        !stacks || !stack_idx || !stkf)
        return false;
    str_len = 1; /* offset 0 is "" */
    /* pseudo sites and their one-frame stacks */
    sites[1] = (struct site_ent){UINT32_MAX, str_intern("<backward>", 10), str_intern("backward", 8), 0};
    sites[2] = (struct site_ent){UINT32_MAX, str_intern("<python>", 8), str_intern("unattributed", 12), 0};
    nsites_total = 3;
    stacks[1] = (struct stack_ent){0, 0, 1, 0};
    stacks[2] = (struct stack_ent){0, 0, 2, 0};
    nstacks = 3;
    return true;
}

/* ---- which frames belong to libraries -------------------------------------------------------- */

#define PREFIX_MAX 8
static char prefixes[PREFIX_MAX][512];
static int nprefixes;
static pthread_mutex_t prefix_lock = PTHREAD_MUTEX_INITIALIZER;
/* Wherever torch is installed (pip, conda, system), its files sit under .../<x>-packages/torch/. */
static const char *const internal_parts[] = {"/site-packages/torch/", "/dist-packages/torch/",
                                             "/hooks/python/memshim/", "/site-packages/memshim/"};

int msh_sites_add_internal_prefix(const char *prefix)
{
    if (!prefix || !*prefix || strlen(prefix) >= sizeof prefixes[0]) return EINVAL;
    pthread_mutex_lock(&prefix_lock);
    int rc = 0;
    bool dup = false;
    for (int i = 0; i < nprefixes; i++) dup |= !strcmp(prefixes[i], prefix);
    if (!dup) {
        if (nprefixes == PREFIX_MAX) rc = ENOSPC;
        else strcpy(prefixes[nprefixes++], prefix);
    }
    pthread_mutex_unlock(&prefix_lock);
    return rc;
}

static bool path_internal(const char *f)
{
    for (size_t i = 0; i < sizeof internal_parts / sizeof *internal_parts; i++)
        if (strstr(f, internal_parts[i])) return true;
    bool hit = false;
    pthread_mutex_lock(&prefix_lock);
    for (int i = 0; i < nprefixes && !hit; i++) hit = !strncmp(f, prefixes[i], strlen(prefixes[i]));
    pthread_mutex_unlock(&prefix_lock);
    return hit;
}

/* ---- interning (intern_lock held, GIL held) ---------------------------------------------------- */

/* A str attribute of `o` as UTF-8, interned; "?" when it cannot be read. The caller saved any
 * pending exception; errors here are cleared. */
static uint32_t attr_str(pyobj *o, const char *attr, const char *fallback)
{
    pyobj *v = py.getattr(o, attr);
    const char *s = v ? py.as_utf8(v) : NULL;
    uint32_t off = s ? str_intern(s, strlen(s)) : str_intern(fallback, strlen(fallback));
    if (!s) py.err_clear();
    if (v) py.decref(v);
    return off;
}

/* Is interned code entry c the live code object the frame runs (see struct code_ent)? */
static bool code_is(const struct code_ent *c, const struct msh_rawframe *id)
{
    if (c->strong || !id) return true;
    return c->id_file == id->filename && c->id_name == id->qualname && c->id_line == id->firstlineno;
}

/* The code entry for `code` (intern_lock held): through the API with the GIL (`id` NULL, or the
 * raw identity when known), else (`raw`) from the object's own memory. */
static uint32_t code_get(pyobj *code, const struct msh_rawframe *id, bool raw)
{
    uint64_t key = (uint64_t)(uintptr_t)code;
    uint32_t mask = CODE_CAP * 2 - 1;
    uint32_t i = (uint32_t)mix64(key) & mask;
    for (;; i = (i + 1) & mask) {
        uint32_t v = code_idx[i];
        if (!v) break;
        if (codes[v - 1].ptr == key && code_is(&codes[v - 1], id)) return v - 1;
    }
    if (ncodes + 1 >= CODE_CAP) return UINT32_MAX;
    struct code_ent *c = &codes[ncodes];
    memset(c, 0, sizeof *c);
    c->ptr = key;
    if (id) {
        c->id_file = id->filename;
        c->id_name = id->qualname;
        c->id_line = id->firstlineno;
    }
    if (raw) {
        char buf[4096];
        int n = msh_pyframes_str(id->filename, buf, sizeof buf);
        c->file = n > 0 ? str_intern(buf, (size_t)n) : str_intern("?", 1); /* compile(src, "", ...) too */
        n = msh_pyframes_str(id->qualname, buf, sizeof buf);
        c->name = n > 0 ? str_intern(buf, (size_t)n) : str_intern("?", 1);
    } else {
        pyobj *et, *ev, *tb;
        py.err_fetch(&et, &ev, &tb);
        c->file = attr_str(code, "co_filename", "?");
        if (!str_arena[c->file]) c->file = str_intern("?", 1); /* a site's file is never empty (the schema) */
        c->name = attr_str(code, "co_qualname", "");
        if (!str_arena[c->name]) c->name = attr_str(code, "co_name", "?");
        py.err_restore(et, ev, tb);
        py.incref(code); /* keeps the address from being reused by another code object */
        c->strong = 1;
    }
    c->internal = path_internal(str_arena + c->file);
    code_idx[i] = ++ncodes;
    return ncodes - 1;
}

static uint32_t site_get(uint32_t code, int line)
{
    uint32_t mask = SITE_CAP * 2 - 1;
    uint32_t i = (uint32_t)mix64(((uint64_t)code << 32) ^ (uint32_t)line) & mask;
    for (;; i = (i + 1) & mask) {
        uint32_t v = site_idx[i];
        if (!v) break;
        if (sites[v - 1].code == code && sites[v - 1].line == line) return v - 1;
    }
    if (nsites_total + 1 >= SITE_CAP) return 2;
    sites[nsites_total] = (struct site_ent){code, codes[code].file, codes[code].name, line};
    site_idx[i] = nsites_total + 1;
    return nsites_total++;
}

/* Lookups take no lock: an index slot is published (release) only after its entry is written,
 * and entries never change or move. Inserts happen under intern_lock. */
static inline uint32_t slot_load(const uint32_t *p)
{
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void slot_publish(uint32_t *p, uint32_t v)
{
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

static inline uint32_t frame_hash(uint64_t codep, int32_t pos)
{
    return (uint32_t)mix64(codep ^ ((uint64_t)(uint32_t)pos << 47));
}

/* The frame for (code object, position), or UINT32_MAX when not interned yet; `id`: the live
 * code object's identity where the entry may be of an earlier object at the same address. */
static uint32_t frame_find(uint64_t codep, int32_t pos, const struct msh_rawframe *id)
{
    uint32_t mask = FRAME_CAP * 2 - 1;
    for (uint32_t i = frame_hash(codep, pos) & mask;; i = (i + 1) & mask) {
        uint32_t v = slot_load(&frame_idx[i]);
        if (!v) return UINT32_MAX;
        const struct frame_ent *f = &frames[v - 1];
        if (f->codep == codep && f->pos == pos && code_is(&codes[f->code], id)) return v - 1;
    }
}

/* Set while this thread interns a frame: resolving a code object's names calls into Python with
 * intern_lock held, and an allocation made from there must not come back for that lock. */
static __thread int tl_interning;

/* Intern (code, pos): `frame` is the frame object (GIL held), or NULL for a frame read raw (`rid`,
 * no GIL: names and line come from the code object's own memory). */
static uint32_t frame_insert(pyobj *frame, pyobj *code, int32_t pos, const struct msh_rawframe *rid)
{
    uint64_t codep = (uint64_t)(uintptr_t)code;
    pthread_mutex_lock(&intern_lock);
    tl_interning = 1;
    uint32_t id = frame_find(codep, pos, rid);
    if (id == UINT32_MAX && nframes + 1 < FRAME_CAP) {
        uint32_t c = code_get(code, rid, frame == NULL);
        if (c != UINT32_MAX) {
            int line = !frame ? msh_pyframes_line(code, pos) : py.frame_lasti ? py.frame_line(frame) : pos;
            frames[nframes] = (struct frame_ent){codep, pos, line, c, site_get(c, line), codes[c].internal};
            uint32_t mask = FRAME_CAP * 2 - 1, i = frame_hash(codep, pos) & mask;
            while (frame_idx[i]) i = (i + 1) & mask;
            id = nframes++;
            slot_publish(&frame_idx[i], id + 1);
        }
    }
    tl_interning = 0;
    pthread_mutex_unlock(&intern_lock);
    return id;
}

static uint32_t stack_find(const uint32_t *f, int n, uint32_t h)
{
    uint32_t mask = STACK_CAP * 2 - 1;
    for (uint32_t i = h & mask;; i = (i + 1) & mask) {
        uint32_t v = slot_load(&stack_idx[i]);
        if (!v) return UINT32_MAX;
        const struct stack_ent *s = &stacks[v - 1];
        if (s->hash == h && s->n == n && !memcmp(stkf + s->off, f, (size_t)n * sizeof *f)) return v - 1;
    }
}

static uint32_t stack_get(const uint32_t *f, int n, int site_at)
{
    uint32_t h = 2166136261u;
    for (int k = 0; k < n; k++) h = (h ^ f[k]) * 16777619u;
    uint32_t id = stack_find(f, n, h);
    if (id != UINT32_MAX) return id;
    pthread_mutex_lock(&intern_lock);
    id = stack_find(f, n, h);
    if (id == UINT32_MAX) {
        if (nstacks + 1 >= STACK_CAP || nstkf + (size_t)n > STKF_CAP) {
            id = MSH_STACK_UNATTRIBUTED;
        } else {
            memcpy(stkf + nstkf, f, (size_t)n * sizeof *f);
            stacks[nstacks] = (struct stack_ent){h, (uint32_t)nstkf, frames[f[site_at]].site, (uint16_t)n};
            nstkf += (size_t)n;
            uint32_t mask = STACK_CAP * 2 - 1, i = h & mask;
            while (stack_idx[i]) i = (i + 1) & mask;
            id = nstacks++;
            slot_publish(&stack_idx[i], id + 1);
        }
    }
    pthread_mutex_unlock(&intern_lock);
    return id;
}

/* The last walk of this thread: the (code object, position) seen at each depth and its interned
 * frame, and the stack it made. The same positions at every depth are the same stack, so a
 * repeated walk (an operator allocating from the same line again) skips every table lookup.
 * Interned code objects are kept alive, so a code address here is never another code object. */
static __thread int tl_walking;
static __thread struct {
    uint64_t codep[WALK_MAX];
    int32_t pos[WALK_MAX];
    uint32_t id[WALK_MAX];
    int looked, callers;
    uint32_t stack;
} tl_memo;

/* Walk this thread's Python stack (GIL held). */
static uint32_t walk(void)
{
    pyobj *f = py.get_frame();
    if (!f) return MSH_STACK_UNATTRIBUTED;
    uint32_t ids[MSH_SITE_MAX_FRAMES];
    int n = 0, site_at = -1, looked = 0;
    /* Callers above the site only serve the snapshot's frames: walk them while history records. */
    int callers = atomic_load_explicit(&capture_all, memory_order_relaxed) ? SITE_CALLERS : 0;
    /* A walk inside a walk (Python's GC, run while a frame object is made, may free and allocate)
     * leaves the memo to the outer one. */
    bool memo = !tl_walking++;
    bool same = memo && tl_memo.stack != MSH_STACK_NONE && tl_memo.callers == callers;
    pyobj *owned = NULL; /* the frame we hold a reference to */
    while (f && looked < WALK_MAX) {
        pyobj *code = py.frame_code(f);
        if (!code) break;
        int32_t pos = py.frame_lasti ? py.frame_lasti(f) : py.frame_line(f);
        uint64_t codep = (uint64_t)(uintptr_t)code;
        uint32_t id;
        if (memo && looked < tl_memo.looked && tl_memo.codep[looked] == codep && tl_memo.pos[looked] == pos) {
            id = tl_memo.id[looked];
        } else {
            same = false;
            id = frame_find(codep, pos, NULL);
            if (id == UINT32_MAX) id = frame_insert(f, code, pos, NULL);
            if (memo && id != UINT32_MAX) {
                tl_memo.codep[looked] = codep;
                tl_memo.pos[looked] = pos;
                tl_memo.id[looked] = id;
                tl_memo.looked = looked + 1; /* deeper entries belong to another stack */
            }
        }
        py.decref(code); /* the interned code object keeps its own reference */
        if (id == UINT32_MAX) break; /* a table is full */
        bool internal = frames[id].internal;
        looked++;
        if (n < MSH_SITE_MAX_FRAMES) ids[n++] = id;
        else if (site_at < 0 && !internal) ids[n - 1] = id; /* keep the site as the last frame */
        if (site_at < 0 && !internal) site_at = n - 1;
        if (site_at >= 0 && (n - 1 - site_at >= callers || n == MSH_SITE_MAX_FRAMES)) break;
        pyobj *back = py.frame_back(f);
        if (owned) py.decref(owned);
        owned = back;
        f = back;
    }
    if (owned) py.decref(owned);
    tl_walking--;
    if (n == 0) return MSH_STACK_UNATTRIBUTED;
    if (same && looked == tl_memo.looked) return tl_memo.stack;
    uint32_t st = stack_get(ids, n, site_at >= 0 ? site_at : 0);
    if (memo) {
        bool keep = st != MSH_STACK_UNATTRIBUTED && looked == tl_memo.looked;
        tl_memo.callers = callers;
        tl_memo.stack = keep ? st : MSH_STACK_NONE;
    }
    return st;
}

/* Walk this thread's Python stack from its own frames (shim/pyframes.c: CPython 3.11, probed),
 * with or without the GIL. The same tables and memo as walk(); entries made here are checked
 * against the live code object's identity, since no reference keeps their object alive. */
static uint32_t walk_raw(const void *tstate)
{
    struct msh_rawframe rf[WALK_MAX];
    int nraw = msh_pyframes_walk(tstate, rf, WALK_MAX);
    if (nraw < 0) return MSH_STACK_UNATTRIBUTED;
    if (nraw == 0) return MSH_STACK_BACKWARD; /* no Python frame: autograd's device threads */
    uint32_t ids[MSH_SITE_MAX_FRAMES];
    int n = 0, site_at = -1, looked = 0;
    int callers = atomic_load_explicit(&capture_all, memory_order_relaxed) ? SITE_CALLERS : 0;
    bool memo = !tl_walking++;
    bool same = memo && tl_memo.stack != MSH_STACK_NONE && tl_memo.callers == callers;
    for (int k = 0; k < nraw && looked < WALK_MAX; k++) {
        const struct msh_rawframe *r = &rf[k];
        uint64_t codep = (uint64_t)(uintptr_t)r->code;
        uint32_t id;
        if (memo && looked < tl_memo.looked && tl_memo.codep[looked] == codep && tl_memo.pos[looked] == r->pos &&
            code_is(&codes[frames[tl_memo.id[looked]].code], r)) {
            id = tl_memo.id[looked];
        } else {
            same = false;
            id = frame_find(codep, r->pos, r);
            if (id == UINT32_MAX) id = frame_insert(NULL, (pyobj *)(uintptr_t)r->code, r->pos, r);
            if (memo && id != UINT32_MAX) {
                tl_memo.codep[looked] = codep;
                tl_memo.pos[looked] = r->pos;
                tl_memo.id[looked] = id;
                tl_memo.looked = looked + 1;
            }
        }
        if (id == UINT32_MAX) break; /* a table is full */
        bool internal = frames[id].internal;
        looked++;
        if (n < MSH_SITE_MAX_FRAMES) ids[n++] = id;
        else if (site_at < 0 && !internal) ids[n - 1] = id;
        if (site_at < 0 && !internal) site_at = n - 1;
        if (site_at >= 0 && (n - 1 - site_at >= callers || n == MSH_SITE_MAX_FRAMES)) break;
    }
    tl_walking--;
    if (n == 0) return MSH_STACK_UNATTRIBUTED;
    if (same && looked == tl_memo.looked) return tl_memo.stack;
    uint32_t st = stack_get(ids, n, site_at >= 0 ? site_at : 0);
    if (memo) {
        bool keep = st != MSH_STACK_UNATTRIBUTED && looked == tl_memo.looked;
        tl_memo.callers = callers;
        tl_memo.stack = keep ? st : MSH_STACK_NONE;
    }
    return st;
}

static bool py_finalizing(void)
{
    return !py.is_initialized() || (py.is_finalizing && py.is_finalizing());
}

/* The frame reader is probed once, by the first caller holding the GIL (the memshim package at
 * start-up: memshim_sites_probe; or an allocation made with the GIL held), else by the first
 * allocation of a Python thread, which then takes the GIL this once. */
static _Atomic int probe_state;  /* 0 not yet, 1 running or done */
static _Atomic bool probe_waited; /* the one probe that took the GIL has run */

static bool raw_ready(bool gil)
{
    if (MSH_LIKELY(msh_pyframes_ok())) return true;
    if (atomic_load_explicit(&probe_state, memory_order_relaxed) || !msh_pyframes_available()) return false;
    if (!gil && atomic_load_explicit(&probe_waited, memory_order_relaxed)) return false; /* never twice */
    int expect = 0;
    if (!atomic_compare_exchange_strong(&probe_state, &expect, 1)) return false;
    if (!gil) atomic_store(&probe_waited, true);
    /* Without the memshim package (python -I, a program that loads libmemshim.so itself) nobody
     * probed at start-up: the first allocation without the GIL takes it this once. */
    int g = gil ? 0 : py.ensure();
    int rc = ENOENT;
    if (!py_finalizing()) {
        tl_interning++; /* the probe makes frame objects: an allocation from there is not attributed */
        rc = msh_pyframes_probe();
        tl_interning--;
    }
    if (!gil) py.release(g);
    if (rc == ENOENT) atomic_store(&probe_state, 0); /* no Python frame to compare: try again later */
    return msh_pyframes_ok();
}

/* A thread found with no Python frame after taking the GIL (MEMSHIM_SITES=acquire): autograd's
 * device threads hold a thread state for life; they never take the GIL for sites again. */
static __thread bool tl_no_frames;

static uint32_t capture(void)
{
    if (tl_interning || py_finalizing()) return MSH_STACK_UNATTRIBUTED;
    bool gil = py.gil_check();
    void *ts = py.this_thread_state();
    if (!gil && !ts) return MSH_STACK_BACKWARD;
    /* CPython 3.11: the thread's own frames, GIL or not; nothing waits. */
    if (sites_mode != MSH_SITES_ACQUIRE && ts && (gil || sites_mode == MSH_SITES_FRAMES) && raw_ready(gil))
        return walk_raw(ts);
    if (gil) return walk();
    if (sites_mode != MSH_SITES_ACQUIRE) return MSH_STACK_UNATTRIBUTED; /* held, or frames without a reader */
    if (tl_no_frames) return MSH_STACK_BACKWARD;
    /* the back-off window (a second) needs no precision; the wait is timed in CPU ticks */
    if (msh_coarse_ns() < atomic_load_explicit(&gil_backoff_until, memory_order_relaxed)) return MSH_STACK_UNATTRIBUTED;
    uint64_t t0 = msh_ticks();
    int g = py.ensure();
    /* signed: a thread moved to another CPU mid-way can read a counter tens of ns behind */
    if ((int64_t)(msh_ticks() - t0) <= (int64_t)gil_slow_ticks) {
        tl_gil_slow = 0;
    } else if (++tl_gil_slow >= 2) {
        tl_gil_slow = 0;
        atomic_store_explicit(&gil_backoff_until, msh_coarse_ns() + GIL_BACKOFF_NS, memory_order_relaxed);
    }
    uint32_t st;
    if (py_finalizing()) {
        /* Finalization began while this thread waited: read nothing (its frames may be going). */
        st = MSH_STACK_UNATTRIBUTED;
    } else if (!py.get_frame()) {
        tl_no_frames = true;
        st = MSH_STACK_BACKWARD;
    } else {
        st = walk();
    }
    py.release(g);
    return st;
}

/* For the memshim package at start-up (GIL held, ctypes.PyDLL): probe the frame reader now, so
 * the first allocation inside an operator already gets its site. 0, or why not (pyframes.h). */
MSH_EXPORT int memshim_sites_probe(void)
{
    if (!msh_pyframes_available()) return ENOSYS;
    if (msh_pyframes_ok()) return 0;
    int expect = 0;
    if (!atomic_compare_exchange_strong(&probe_state, &expect, 1)) return EBUSY;
    tl_interning++;
    int rc = msh_pyframes_probe();
    tl_interning--;
    if (rc == ENOENT) atomic_store(&probe_state, 0);
    return rc;
}

/* ---- accounting per device --------------------------------------------------------------------- */

#define TREND 8
struct site_acc {
    int64_t live, live_cnt; /* bytes; blocks x 1024 */
    int64_t peak, peak_cnt;
    int64_t end[TREND];
    uint8_t nend, seen;
};
/* A tracked block's mark in the pool (msh_pool_tags): its stack id, and whether its site was
 * sampled (its weight is then its size over the chance it had of being sampled). */
#define TAG_SAMPLED 0x80000000u
struct dev_acc {
    pthread_mutex_t lock;
    struct site_acc *site;
    uint32_t site_hi;          /* one past the highest site id accounted */
    /* under lock: */
    int64_t total;      /* tensor bytes live on the device (every allocation) */
    int64_t max_total;  /* the epoch's peak of total */
    int64_t next_copy;  /* take the next peak copy when total passes this */
    int64_t copy_total; /* total when the peak copy was taken */
};
static struct dev_acc *_Atomic accs[MSH_MAX_DEVICES];
static pthread_mutex_t acc_create_lock = PTHREAD_MUTEX_INITIALIZER;

static struct dev_acc *acc_get(int device, bool create)
{
    if (device < 0 || device >= MSH_MAX_DEVICES) return NULL;
    struct dev_acc *a = atomic_load_explicit(&accs[device], memory_order_acquire);
    if (a || !create) return a;
    pthread_mutex_lock(&acc_create_lock);
    a = atomic_load(&accs[device]);
    if (!a) {
        a = vm(sizeof *a);
        struct site_acc *s = a ? vm((size_t)SITE_CAP * sizeof *s) : NULL;
        if (s) {
            pthread_mutex_init(&a->lock, NULL);
            a->site = s;
            atomic_store(&accs[device], a);
        } else {
            if (a) munmap(a, sizeof *a);
            a = NULL;
        }
    }
    pthread_mutex_unlock(&acc_create_lock);
    return a;
}

static void peak_copy(struct dev_acc *a)
{
    for (uint32_t s = 1; s < a->site_hi; s++) {
        a->site[s].peak = a->site[s].live;
        a->site[s].peak_cnt = a->site[s].live_cnt;
    }
}

static void set_next_copy(struct dev_acc *a, int64_t total)
{
    a->next_copy = total + total / 64 + 1;
}

/* Copies are taken every 1/64 of growth; when the device sits at its epoch peak right now (the
 * peak came last, as when memory only grows), bring the copy up to it exactly (lock held). */
static void refresh_peak(struct dev_acc *a)
{
    int64_t max = a->max_total;
    if (max > a->copy_total && a->total == max) {
        peak_copy(a);
        a->copy_total = max;
    }
}

/* One update of a device's accounts, in one lock hold: a tracked block's site (site 0: none) and
 * the device's total, with the peak copy when the total passes the last by 1/64. */
static void account(struct dev_acc *a, uint32_t site, int64_t w, int64_t wc, int64_t dtotal)
{
    pthread_mutex_lock(&a->lock);
    if (site) {
        struct site_acc *s = &a->site[site];
        s->live += w;
        s->live_cnt += wc;
        s->seen = 1;
        if (site >= a->site_hi) a->site_hi = site + 1;
    }
    a->total += dtotal;
    if (dtotal > 0) {
        if (a->total > a->max_total) a->max_total = a->total;
        if (a->total > a->next_copy) {
            peak_copy(a);
            a->copy_total = a->total;
            set_next_copy(a, a->total);
        }
    }
    pthread_mutex_unlock(&a->lock);
}

/* This thread's device (cached) and the bytes it allocated minus freed there that the device's
 * total has not seen yet. Exact sites move the total at every call (in the lock hold that
 * accounts the block); with sampling an untracked block only moves this balance, which reaches
 * the total at the next tracked block or when it passes the sampling interval: the peak copy
 * then lags the true peak by at most that interval per thread (besides its own 1/64). */
static __thread struct dev_acc *tl_acc;
static __thread int tl_acc_dev = -1;
static __thread int64_t tl_pend;
static uint64_t flush_at; /* sample_T */

static struct dev_acc *acc_for(int device)
{
    if (MSH_LIKELY(device == tl_acc_dev)) return tl_acc;
    struct dev_acc *a = acc_get(device, true);
    if (!a) return NULL;
    if (tl_pend && tl_acc) account(tl_acc, 0, 0, 0, tl_pend);
    tl_pend = 0;
    tl_acc = a;
    tl_acc_dev = device;
    return a;
}

/* What a tracked block stands for: its bytes and blocks x 1024 (estimates when sampled). */
static void block_weight(uint32_t tag, uint64_t size, int64_t *w, int64_t *wc)
{
    if (!(tag & TAG_SAMPLED)) {
        *w = (int64_t)size;
        *wc = 1024;
        return;
    }
    double p = -expm1(-(double)size / (double)sample_T); /* P(this allocation was sampled) */
    if (p < 1e-12) p = 1e-12;
    *w = (int64_t)((double)(size ? size : 1) / p + 0.5);
    *wc = (int64_t)(1024.0 / p + 0.5);
}

/* ---- the entry points -------------------------------------------------------------------------- */

static void do_init(void)
{
    msh_hotclock_init();
    gil_slow_ticks = msh_ticks_from_ns(GIL_SLOW_NS);
    sites_mode = msh_cfg.sites;
    sample_T = msh_cfg.sites_sample;
    flush_at = sample_T;
    if (sites_mode == MSH_SITES_OFF) return;
    py_resolve();
    if (!py_ok) return;
    pthread_mutex_lock(&intern_lock);
    tables_ok = tables_init();
    pthread_mutex_unlock(&intern_lock);
    if (!tables_ok) {
        msh_warn("allocation sites: cannot map the site tables; reports carry no sites");
        return;
    }
    sites_ready = true;
}

void msh_sites_init(bool wanted)
{
    pthread_once(&init_once, do_init);
    if (!wanted) return;
    atomic_store(&sites_wanted, true);
    if (sites_ready) atomic_store(&msh_sites_active, true);
}

void msh_sites_set_capture_all(bool on)
{
    atomic_store(&capture_all, on ? 1 : 0);
}

static __thread int64_t tl_until;
static __thread uint64_t tl_rng;

/* Bytes until the next sample: exponential with mean T. */
static int64_t next_gap(void)
{
    if (!tl_rng) tl_rng = mix64((uint64_t)(uintptr_t)&tl_rng ^ msh_ticks()) | 1;
    tl_rng ^= tl_rng << 13;
    tl_rng ^= tl_rng >> 7;
    tl_rng ^= tl_rng << 17;
    double u = ((double)(tl_rng >> 11) + 0.5) / 9007199254740992.0;
    return (int64_t)(-log(u) * (double)sample_T) + 1;
}

uint32_t msh_sites_tag_slow(size_t size)
{
    if (!sites_on) return 0; /* msh_sites_last_stack stays 0: the history ring clears it on use */
    msh_sites_last_stack = MSH_STACK_NONE;
    bool sampled = sample_T && size < sample_T && !atomic_load_explicit(&capture_all, memory_order_relaxed);
    if (sampled) {
        if (tl_until <= 0) tl_until = next_gap();
        tl_until -= (int64_t)size;
        if (tl_until > 0) return 0;
        tl_until = next_gap();
    }
    uint32_t stack = capture();
    msh_sites_last_stack = stack;
    return stack | (sampled ? TAG_SAMPLED : 0);
}

/* A block of `bytes` (negative: freed) with mark `tag` on `device`. */
static void note(int device, uint32_t tag, int64_t bytes)
{
    struct dev_acc *a = acc_for(device);
    if (!a) return;
    if (!tag) {
        tl_pend += bytes;
        if (tl_pend < (int64_t)flush_at && tl_pend > -(int64_t)flush_at) return;
        account(a, 0, 0, 0, tl_pend);
        tl_pend = 0;
        return;
    }
    int64_t w, wc, d = tl_pend + bytes;
    block_weight(tag, (uint64_t)(bytes < 0 ? -bytes : bytes), &w, &wc);
    tl_pend = 0;
    account(a, stacks[tag & ~TAG_SAMPLED].site, bytes < 0 ? -w : w, bytes < 0 ? -wc : wc, d);
}

void msh_sites_alloc_slow(int device, uint32_t tag, size_t size)
{
    if (sites_on) note(device, tag, (int64_t)size);
}

void msh_sites_free_slow(int device, uint32_t tag, size_t size)
{
    if (sites_on && (tag || size)) note(device, tag, -(int64_t)size);
}

void msh_sites_epoch_end(void)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct dev_acc *a = acc_get(d, false);
        if (!a) continue;
        pthread_mutex_lock(&a->lock);
        refresh_peak(a);
        for (uint32_t s = 1; s < a->site_hi; s++) {
            struct site_acc *x = &a->site[s];
            if (!x->seen) continue;
            if (x->nend == TREND) {
                memmove(x->end, x->end + 1, (TREND - 1) * sizeof x->end[0]);
                x->nend--;
            }
            x->end[x->nend++] = x->live;
        }
        pthread_mutex_unlock(&a->lock);
    }
}

void msh_sites_epoch_reset(void)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct dev_acc *a = acc_get(d, false);
        if (!a) continue;
        pthread_mutex_lock(&a->lock);
        peak_copy(a);
        a->copy_total = a->total;
        a->max_total = a->total;
        set_next_copy(a, a->total);
        pthread_mutex_unlock(&a->lock);
    }
}

/* ---- queries --------------------------------------------------------------------------------- */

const char *msh_sites_note(void)
{
    if (!atomic_load(&sites_wanted)) return NULL;
    if (sites_mode == MSH_SITES_OFF) return "MEMSHIM_SITES=off";
    if (py_missing) return py_missing;
    if (!sites_ready) return "allocation sites are unavailable (see the log)";
    return NULL;
}

uint64_t msh_sites_sample_bytes(void)
{
    return sample_T;
}

static int cmp_desc(uint64_t a, uint64_t b)
{
    return a < b ? 1 : a > b ? -1 : 0;
}

int msh_sites_top(int device, struct msh_site_row *rows, int max)
{
    struct dev_acc *a = sites_on ? acc_get(device, false) : NULL;
    if (!a || max <= 0) return 0;
    int n = 0;
    pthread_mutex_lock(&a->lock);
    refresh_peak(a);
    for (uint32_t s = 1; s < a->site_hi; s++) {
        int64_t b = a->site[s].peak;
        if (b <= 0) continue;
        struct msh_site_row r = {NULL, NULL, sites[s].line, (uint64_t)b, (uint64_t)((a->site[s].peak_cnt + 512) / 1024)};
        r.file = str_arena + sites[s].file;
        r.function = str_arena + sites[s].name;
        /* insertion into the sorted top list */
        int k = n < max ? n++ : max;
        if (k == max && cmp_desc(rows[max - 1].bytes, r.bytes) <= 0) continue;
        if (k == max) k = max - 1;
        while (k > 0 && cmp_desc(rows[k - 1].bytes, r.bytes) > 0) {
            rows[k] = rows[k - 1];
            k--;
        }
        rows[k] = r;
    }
    pthread_mutex_unlock(&a->lock);
    return n;
}

int msh_sites_growing(int device, struct msh_site_growth *rows, int max)
{
    struct dev_acc *a = sites_on ? acc_get(device, false) : NULL;
    if (!a || max <= 0) return 0;
    /* below a page of growth per epoch is jitter, and with sampling below the interval is noise */
    int64_t step = sample_T > 4096 ? (int64_t)sample_T : 4096;
    int n = 0;
    pthread_mutex_lock(&a->lock);
    for (uint32_t s = 1; s < a->site_hi; s++) {
        struct site_acc *x = &a->site[s];
        if (x->nend < 3) continue;
        bool grew = true;
        for (int i = 1; i < x->nend && grew; i++) grew = x->end[i] - x->end[i - 1] >= step;
        if (!grew) continue;
        struct msh_site_growth g = {str_arena + sites[s].file, str_arena + sites[s].name, sites[s].line,
                                    (uint64_t)((x->end[x->nend - 1] - x->end[0]) / (x->nend - 1)), x->nend};
        int k = n < max ? n++ : max;
        if (k == max && rows[max - 1].growth_bytes_per_epoch >= g.growth_bytes_per_epoch) continue;
        if (k == max) k = max - 1;
        while (k > 0 && rows[k - 1].growth_bytes_per_epoch < g.growth_bytes_per_epoch) {
            rows[k] = rows[k - 1];
            k--;
        }
        rows[k] = g;
    }
    pthread_mutex_unlock(&a->lock);
    return n;
}

int msh_sites_stack_frames(uint32_t stack, struct msh_site_frame *out, int max)
{
    if (!tables_ok || stack == MSH_STACK_NONE || max <= 0) return 0;
    pthread_mutex_lock(&intern_lock); /* nstacks is only read under the lock */
    int n = 0;
    if (stack < nstacks) {
        struct stack_ent *s = &stacks[stack];
        if (s->n == 0) { /* a pseudo stack: its site as the one frame */
            out[n++] = (struct msh_site_frame){str_arena + sites[s->site].file, str_arena + sites[s->site].name, 0};
        }
        for (int k = 0; k < s->n && n < max; k++) {
            struct frame_ent *f = &frames[stkf[s->off + k]];
            out[n++] = (struct msh_site_frame){str_arena + codes[f->code].file, str_arena + codes[f->code].name, f->line};
        }
    }
    pthread_mutex_unlock(&intern_lock);
    return n;
}

/* Spill (issue 20): the sites of the blocks on host memory, by host bytes. */
struct spilled_acc {
    uint64_t *addr, *bytes;
    size_t n, cap;
};

static void spilled_one(void *arg, uint64_t addr, size_t size, size_t host_bytes)
{
    (void)size;
    struct spilled_acc *s = arg;
    if (s->n < s->cap) {
        s->addr[s->n] = addr;
        s->bytes[s->n++] = host_bytes;
    }
}

int msh_sites_spilled(struct msh_pool *pool, struct msh_site_row *rows, int max, uint64_t *unattributed)
{
    *unattributed = 0;
    if (!pool || max <= 0) return 0;
    enum { CAP = 1 << 16 };
    struct spilled_acc s = {malloc(CAP * sizeof(uint64_t)), malloc(CAP * sizeof(uint64_t)), 0, CAP};
    uint32_t *tags = malloc(CAP * sizeof(uint32_t));
    int n = 0;
    if (!s.addr || !s.bytes || !tags) goto out;
    msh_pool_for_each_spilled(pool, spilled_one, &s);
    msh_sites_block_stacks(pool, s.addr, tags, s.n);
    pthread_mutex_lock(&intern_lock);
    for (size_t i = 0; i < s.n; i++) {
        uint32_t st = tags[i];
        uint32_t site = tables_ok && st && st < nstacks ? stacks[st].site : 0;
        if (site <= 2) { /* no site known (no Python, sampled out, a pseudo site) */
            *unattributed += s.bytes[i];
            continue;
        }
        int k = 0;
        while (k < n && !(rows[k].line == sites[site].line && rows[k].file == str_arena + sites[site].file &&
                          rows[k].function == str_arena + sites[site].name))
            k++;
        if (k == n) {
            if (n == max) { /* the table is full: the smallest row gives way if this block is larger */
                int lo = 0;
                for (int j = 1; j < n; j++)
                    if (rows[j].bytes < rows[lo].bytes) lo = j;
                if (rows[lo].bytes >= s.bytes[i]) {
                    *unattributed += s.bytes[i];
                    continue;
                }
                *unattributed += rows[lo].bytes;
                k = lo;
            } else {
                n++;
            }
            rows[k] = (struct msh_site_row){str_arena + sites[site].file, str_arena + sites[site].name,
                                            sites[site].line, 0, 0};
        }
        rows[k].bytes += s.bytes[i];
        rows[k].count++;
    }
    pthread_mutex_unlock(&intern_lock);
    for (int i = 1; i < n; i++) /* largest first */
        for (int j = i; j > 0 && rows[j].bytes > rows[j - 1].bytes; j--) {
            struct msh_site_row t = rows[j];
            rows[j] = rows[j - 1];
            rows[j - 1] = t;
        }
out:
    free(s.addr);
    free(s.bytes);
    free(tags);
    return n;
}

void msh_sites_block_stacks(struct msh_pool *pool, const uint64_t *addrs, uint32_t *out, size_t n)
{
    if (!sites_on || !pool) {
        memset(out, 0, n * sizeof *out);
        return;
    }
    msh_pool_block_tags(pool, addrs, out, n);
    for (size_t i = 0; i < n; i++) out[i] &= ~TAG_SAMPLED;
}
