/*
 * dev_sim.c: the simulated device, for replay and benchmarks.
 *
 * It only counts: capacity, handles and mappings are numbers, addresses come from a counter, and
 * events complete at once. It must never touch host memory on behalf of a "device pointer" and
 * never fail except for capacity (ENOMEM from create) and misuse (EINVAL), so a replay measures
 * the pool and nothing else. The pool calls it without its lock, from any thread: every counter is
 * atomic.
 */
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "msh.h"

struct sim {
    size_t capacity, gran;
    size_t used;                 /* atomic */
    uint64_t next_va, next_handle, next_event;
    uint64_t mapped_bytes;       /* atomic */
    bool host;                   /* host memory through VMM (msh_dev_sim_host) */
    size_t host_capacity;        /* 0: unlimited */
    size_t host_used;            /* atomic */
    uint64_t copied_bytes;       /* atomic: bytes copy() moved */
};

/* Host handles carry this bit, so release() knows whose memory comes back. */
#define SIM_HOST_BIT ((uint64_t)1 << 62)

static struct sim *S(struct msh_device *d) { return d->impl; }

static int sim_mem_info(struct msh_device *d, size_t *free_b, size_t *total)
{
    struct sim *s = S(d);
    size_t cap = s->capacity ? s->capacity : ((size_t)1 << 46);
    size_t used = __atomic_load_n(&s->used, __ATOMIC_RELAXED);
    *total = cap;
    *free_b = used < cap ? cap - used : 0;
    return 0;
}

static int sim_granularity(struct msh_device *d, size_t *g)
{
    *g = S(d)->gran;
    return 0;
}

static int sim_reserve(struct msh_device *d, size_t size, size_t align, uint64_t *va)
{
    struct sim *s = S(d);
    if (!size || size % s->gran) return EINVAL;
    if (align < s->gran) align = s->gran;
    /* a guard gap keeps ranges apart; the slack covers any alignment up to `align` */
    uint64_t span = size + s->gran + align;
    uint64_t a = __atomic_fetch_add(&s->next_va, span, __ATOMIC_RELAXED);
    *va = (a + align - 1) / align * align;
    return 0;
}

static int sim_unreserve(struct msh_device *d MSH_UNUSED, uint64_t va MSH_UNUSED, size_t size MSH_UNUSED) { return 0; }

static int sim_create(struct msh_device *d, size_t size, uint64_t *h)
{
    struct sim *s = S(d);
    if (!size || size % s->gran) return EINVAL;
    size_t used = __atomic_load_n(&s->used, __ATOMIC_RELAXED);
    do {
        if (s->capacity && used + size > s->capacity) return ENOMEM;
    } while (!__atomic_compare_exchange_n(&s->used, &used, used + size, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *h = __atomic_add_fetch(&s->next_handle, 1, __ATOMIC_RELAXED);
    return 0;
}

static int sim_release(struct msh_device *d, uint64_t h, size_t size)
{
    struct sim *s = S(d);
    if (!h || !size || size % s->gran) return EINVAL;
    __atomic_fetch_sub(h & SIM_HOST_BIT ? &s->host_used : &s->used, size, __ATOMIC_RELAXED);
    return 0;
}

static int sim_host_create(struct msh_device *d, size_t size, uint64_t *h)
{
    struct sim *s = S(d);
    if (!s->host) return ENOTSUP;
    if (!size || size % s->gran) return EINVAL;
    size_t used = __atomic_load_n(&s->host_used, __ATOMIC_RELAXED);
    do {
        if (s->host_capacity && used + size > s->host_capacity) return ENOMEM;
    } while (!__atomic_compare_exchange_n(&s->host_used, &used, used + size, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *h = __atomic_add_fetch(&s->next_handle, 1, __ATOMIC_RELAXED) | SIM_HOST_BIT;
    return 0;
}

static int sim_copy(struct msh_device *d, uint64_t dst MSH_UNUSED, uint64_t src MSH_UNUSED, size_t size)
{
    __atomic_fetch_add(&S(d)->copied_bytes, size, __ATOMIC_RELAXED);
    return 0;
}

static int sim_map(struct msh_device *d, uint64_t va MSH_UNUSED, size_t size, uint64_t h MSH_UNUSED)
{
    __atomic_fetch_add(&S(d)->mapped_bytes, size, __ATOMIC_RELAXED);
    return 0;
}

static int sim_set_access(struct msh_device *d MSH_UNUSED, uint64_t va MSH_UNUSED, size_t size MSH_UNUSED) { return 0; }

static int sim_unmap(struct msh_device *d, uint64_t va MSH_UNUSED, size_t size)
{
    __atomic_fetch_sub(&S(d)->mapped_bytes, size, __ATOMIC_RELAXED);
    return 0;
}

static int sim_event_create(struct msh_device *d, uint64_t *ev)
{
    *ev = __atomic_add_fetch(&S(d)->next_event, 1, __ATOMIC_RELAXED);
    return 0;
}

static int sim_event_record(struct msh_device *d MSH_UNUSED, uint64_t ev MSH_UNUSED, uint64_t stream MSH_UNUSED)
{
    return 0;
}
static int sim_event_query(struct msh_device *d MSH_UNUSED, uint64_t ev MSH_UNUSED) { return 0; }
static int sim_event_release(struct msh_device *d MSH_UNUSED, uint64_t ev MSH_UNUSED) { return 0; }
static int sim_stream_wait(struct msh_device *d MSH_UNUSED, uint64_t stream MSH_UNUSED, uint64_t ev MSH_UNUSED)
{
    return 0;
}
static int sim_synchronize(struct msh_device *d MSH_UNUSED) { return 0; }

static const struct msh_device_ops sim_ops = {
    .name = "simulated",
    .mem_info = sim_mem_info,
    .granularity = sim_granularity,
    .reserve = sim_reserve,
    .unreserve = sim_unreserve,
    .create = sim_create,
    .release = sim_release,
    .map = sim_map,
    .set_access = sim_set_access,
    .unmap = sim_unmap,
    .event_create = sim_event_create,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_release = sim_event_release,
    .stream_wait = sim_stream_wait,
    .synchronize = sim_synchronize,
    .host_create = sim_host_create,
    .copy = sim_copy,
};

int msh_dev_sim_init(struct msh_device *d, size_t capacity, size_t gran)
{
    struct sim *s = calloc(1, sizeof *s);
    if (!s) return ENOMEM;
    s->capacity = capacity;
    s->gran = gran ? gran : 2 * MSH_MiB;
    s->next_va = (uint64_t)1 << 40;
    d->ops = &sim_ops;
    d->ordinal = 0;
    d->impl = s;
    return 0;
}

void msh_dev_sim_host(struct msh_device *d, size_t host_capacity)
{
    S(d)->host = true;
    S(d)->host_capacity = host_capacity;
}

size_t msh_dev_sim_host_used(struct msh_device *d)
{
    return __atomic_load_n(&S(d)->host_used, __ATOMIC_RELAXED);
}

void msh_dev_sim_fini(struct msh_device *d)
{
    free(d->impl);
    d->impl = NULL;
}
