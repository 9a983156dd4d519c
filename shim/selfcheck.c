/*
 * selfcheck.c: memshim_debug_check(), the test-only way into msh_pool_check() for a program that
 * runs under LD_PRELOAD=libmemshim.so (docs/testing.md). The fault-injection suite calls it after
 * every allocator call of its workloads, so the pool's invariants are verified after every
 * injected driver failure in the real library, not in a special build.
 *
 * It is exported (memshim_* in shim/exports.map) but deliberately not declared in memshim.h: it
 * is no part of the public API and may change. It only reads: it never creates a pool, never
 * calls the driver, never changes state, and memshim never calls it itself, so a program that
 * does not call it pays nothing. It takes each pool's lock, so it must not be called from inside
 * a GC callback that the pool runs (none does).
 */
#include <stdio.h>

#include "core.h"
#include "msh.h"

/* 0 when every existing pool passes msh_pool_check (or there is none), else EFAULT with
 * "device N: <the first violation>" in why (may be NULL). */
MSH_EXPORT int memshim_debug_check(char *why, size_t whylen);

MSH_EXPORT int memshim_debug_check(char *why, size_t whylen)
{
    if (why && whylen) why[0] = 0;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = msh_core_pool_get(d);
        if (!p) continue;
        char buf[480];
        int rc = msh_pool_check(p, buf, sizeof buf);
        if (rc) {
            if (why && whylen) snprintf(why, whylen, "device %d: %s", d, buf);
            return rc;
        }
    }
    return 0;
}
