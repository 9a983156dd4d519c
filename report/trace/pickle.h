/*
 * pickle.h: a reader for the plain-container subset of Python pickle (protocols 2-5), enough for
 * PyTorch memory snapshots. It builds a value graph (None, bool, int, float, str, bytes, tuple,
 * list, dict, set, frozenset) and never executes or imports anything: every opcode that could
 * (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ*, PERSID, EXT*, ...) is refused with an
 * error naming the opcode and its offset.
 *
 * Memory: every node of one document lives in one arena, freed at once by msh_pk_free(); memo
 * references (BINGET) share nodes, so the result is a DAG and, for hostile input, may even hold a
 * cycle (a list appended to itself). Never walk it recursively; walk known paths with bounded
 * loops. str and bytes values point into the input buffer (zero copy): the buffer must outlive
 * the document. Errors follow msh.h: 0, EINVAL (malformed or refused, reason in err), ENOMEM.
 */
#ifndef MSH_PICKLE_H
#define MSH_PICKLE_H

#include <stddef.h>
#include <stdint.h>

enum msh_pk_kind {
    MSH_PK_NONE = 0,
    MSH_PK_BOOL,      /* i = 0 or 1 */
    MSH_PK_INT,       /* i, or u when big (a LONG between 2^63 and 2^64-1) */
    MSH_PK_FLOAT,     /* f */
    MSH_PK_STR,       /* s: UTF-8 bytes as written (not validated, not NUL-terminated) */
    MSH_PK_BYTES,     /* s */
    MSH_PK_TUPLE,     /* seq */
    MSH_PK_LIST,      /* seq */
    MSH_PK_DICT,      /* seq: v[2k] is a key, v[2k+1] its value; n counts pairs */
    MSH_PK_SET,       /* seq */
    MSH_PK_FROZENSET, /* seq */
};

struct msh_pk {
    uint8_t kind;  /* enum msh_pk_kind */
    uint8_t big;   /* MSH_PK_INT only: the value is u, above INT64_MAX */
    uint32_t depth; /* containers: nesting depth as built (1 = holds no container) */
    union {
        int64_t i;
        uint64_t u;
        double f;
        struct { const char *p; size_t len; } s;
        struct { struct msh_pk **v; size_t n, cap; } seq;
    };
};

/* Limits against hostile input; zero fields take the defaults shown. */
struct msh_pk_limits {
    size_t max_depth;       /* MARK nesting and container nesting as built (10000) */
    size_t max_stack;       /* values on the unpickler stack (1 << 24) */
    size_t max_memo;        /* memo slots (1 << 24; never more than the input length) */
    size_t max_arena_bytes; /* all nodes together (64 * input length + 1 MiB) */
};

struct msh_pk_doc;

/* Parse buf[0..len) up to its STOP opcode (bytes after STOP are ignored, as CPython does). */
int msh_pk_parse(const unsigned char *buf, size_t len, const struct msh_pk_limits *lim,
                 struct msh_pk_doc **out, char *err, size_t errlen);
const struct msh_pk *msh_pk_root(const struct msh_pk_doc *doc);
size_t msh_pk_arena_bytes(const struct msh_pk_doc *doc);
void msh_pk_free(struct msh_pk_doc *doc);

/* "None", "int", "dict", ... */
const char *msh_pk_kind_name(int kind);
/* Name of a pickle opcode byte ("STACK_GLOBAL"), or NULL when the byte is no opcode. */
const char *msh_pk_opcode_name(unsigned char op);

/* Helpers for walking known shapes. All accept NULL and wrong kinds (returning NULL/0/EINVAL). */
int msh_pk_is_str(const struct msh_pk *v, const char *s);        /* 1 when v is str equal to s */
const struct msh_pk *msh_pk_dict_get(const struct msh_pk *dict, const char *key); /* last match */
int msh_pk_get_i64(const struct msh_pk *v, int64_t *out);        /* int or bool; EINVAL/ERANGE */
int msh_pk_get_u64(const struct msh_pk *v, uint64_t *out);       /* non-negative int */
size_t msh_pk_len(const struct msh_pk *v);                       /* items (pairs for dict) */
const struct msh_pk *msh_pk_item(const struct msh_pk *seq, size_t i); /* tuple/list/set item */

#endif
