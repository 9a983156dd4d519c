/*
 * policy_memshim.c: memshim's real pool (policy/pool/) over the simulated device, behind the
 * replay's common policy interface (policy.h). The capacity is the pool's limit, as in
 * `memshim-replay --capacity`; "segments" are the pool's physical handles (create/release).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "msh.h"
#include "policy.h"
#include "pool.h"

struct ms_policy {
    struct msh_policy base;
    struct msh_device dev;
    struct msh_pool *pool;
    uint64_t ooms;
};

static int ms_alloc(struct msh_policy *p, uint64_t size, uint64_t stream, uint64_t *addr)
{
    struct ms_policy *m = (struct ms_policy *)p;
    int rc = msh_pool_alloc(m->pool, size, stream, addr);
    if (rc) m->ooms++;
    return rc ? ENOMEM : 0;
}

static int ms_free(struct msh_policy *p, uint64_t addr, uint64_t stream)
{
    return msh_pool_free(((struct ms_policy *)p)->pool, addr, stream);
}

static void ms_empty_cache(struct msh_policy *p) { msh_pool_empty_cache(((struct ms_policy *)p)->pool); }

static void ms_stats(struct msh_policy *p, struct msh_policy_stats *out)
{
    struct ms_policy *m = (struct ms_policy *)p;
    struct msh_pool_stats s;
    msh_pool_get_stats(m->pool, &s);
    *out = (struct msh_policy_stats){
        .reserved = s.mapped_bytes, .peak_reserved = s.peak_mapped_bytes, .live_bytes = s.live_bytes,
        .peak_live_bytes = s.peak_live_bytes, .segs_created = s.create_ops, .segs_freed = s.release_ops,
        .map_ops = s.map_ops, .unmap_ops = s.unmap_ops, .ooms = m->ooms, .at_peak_reserved = s.at_peak_mapped_bytes,
        .at_peak_live = s.at_peak_live_bytes};
    memcpy(out->drv_calls, s.drv_calls, sizeof out->drv_calls);
    memcpy(out->drv_bytes, s.drv_bytes, sizeof out->drv_bytes);
    memcpy(out->drv_maps, s.drv_maps, sizeof out->drv_maps);
}

static void ms_destroy(struct msh_policy *p)
{
    struct ms_policy *m = (struct ms_policy *)p;
    msh_pool_destroy(m->pool);
    msh_dev_sim_fini(&m->dev);
    free(m);
}

static void ms_reset_peaks(struct msh_policy *p) { msh_pool_reset_peaks(((struct ms_policy *)p)->pool); }

static const struct msh_policy_ops ms_ops = {ms_alloc, ms_free, ms_empty_cache, ms_stats, ms_destroy, ms_reset_peaks};

bool msh_memshim_policy_front = true;

int msh_memshim_policy_create(uint64_t capacity, uint64_t granularity, uint64_t va_hint, struct msh_policy **out)
{
    struct ms_policy *m = calloc(1, sizeof *m);
    if (!m) return ENOMEM;
    m->base.ops = &ms_ops;
    m->base.kind = MSH_POLICY_MEMSHIM;
    int rc = msh_dev_sim_init(&m->dev, 0, granularity ? granularity : 2 * MSH_MiB);
    if (rc) {
        free(m);
        return rc;
    }
    struct msh_pool_params prm;
    msh_pool_params_default(&prm);
    prm.limit_bytes = capacity;
    prm.plan_sync = true; /* as memshim-replay: figures that do not depend on thread timing */
    prm.front = msh_memshim_policy_front; /* as tensor mode's pool (shim/core.c) */
    uint64_t base = capacity ? capacity : va_hint;
    prm.va_bytes = base * 4 > 8 * MSH_GiB ? base * 4 : 8 * MSH_GiB;
    if ((rc = msh_pool_create(&m->dev, &prm, &m->pool))) {
        msh_dev_sim_fini(&m->dev);
        free(m);
        return rc;
    }
    *out = &m->base;
    return 0;
}
