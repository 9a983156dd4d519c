/*
 * capture.c: the devices on which a CUDA-graph capture is in progress (capture.h), and the safe
 * point after the last one ends, where the pools run what they deferred meanwhile.
 *
 * A capture is open from a stream-capture begin to its end seen by memshim's hooks (hooks/: every
 * route a program can begin one by; PyTorch's pool window alone is none, capture.h). Entries
 * live in a small fixed table under one lock that nothing else takes; the per-device counters are
 * what the pools read, lock-free, at every decision that would need a synchronize or an unmap.
 * It must never call a CUDA function, and never hold its lock while the deferred work runs.
 */
#include "capture.h"

#include <pthread.h>
#include <stdatomic.h>

#include "core.h"
#include "msh.h"
#include "pool.h"
#include "torch.h"

#define CAPTURE_ENTRIES 256

struct centry {
    int kind, device; /* kind 0: free slot */
    uint64_t token;
};

static pthread_mutex_t ctab_lock = PTHREAD_MUTEX_INITIALIZER;
static struct centry ents[CAPTURE_ENTRIES];
static int counters[MSH_MAX_DEVICES]; /* per device, for the settle and for tests */
/* Every capture in the process: what the pools read (__atomic, without the lock). A capture in
 * the default global mode prohibits "potentially unsafe" calls (an unmap among them) from every
 * other thread, whatever device they work on, so every pool defers while any capture is open. */
int msh_capture_total; /* captures open in the process (capture.h msh_capture_any) */
static bool overflow_warned;

const int *msh_capture_counter(int device)
{
    return device >= 0 && device < MSH_MAX_DEVICES ? &msh_capture_total : NULL;
}

int msh_capture_active(int device)
{
    return device >= 0 && device < MSH_MAX_DEVICES ? __atomic_load_n(&counters[device], __ATOMIC_ACQUIRE) : 0;
}

void msh_capture_open(int device, int kind, uint64_t token)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || kind <= 0) return;
    pthread_mutex_lock(&ctab_lock);
    int slot = -1;
    for (int i = 0; i < CAPTURE_ENTRIES && slot < 0; i++)
        if (!ents[i].kind) slot = i;
    if (slot >= 0) ents[slot] = (struct centry){.kind = kind, .device = device, .token = token};
    /* Counted even when the table is full: deferring too much is safe, too little is not. The
     * entry that could not be kept is then never closed, and the device stays "capturing". */
    __atomic_add_fetch(&counters[device], 1, __ATOMIC_ACQ_REL);
    __atomic_add_fetch(&msh_capture_total, 1, __ATOMIC_ACQ_REL);
    bool warn = slot < 0 && !overflow_warned;
    if (warn) overflow_warned = true;
    pthread_mutex_unlock(&ctab_lock);
    if (warn)
        msh_warn("more than %d CUDA-graph captures open at once; device %d's pools now defer every "
                 "unmap and release for the rest of the run", CAPTURE_ENTRIES, device);
}

void msh_capture_close(int kind, uint64_t token)
{
    int device = -1;
    pthread_mutex_lock(&ctab_lock);
    for (int i = 0; i < CAPTURE_ENTRIES; i++) {
        if (ents[i].kind != kind || ents[i].token != token) continue;
        device = ents[i].device;
        ents[i].kind = 0;
        break;
    }
    int left = -1;
    if (device >= 0) {
        __atomic_sub_fetch(&counters[device], 1, __ATOMIC_ACQ_REL);
        left = __atomic_sub_fetch(&msh_capture_total, 1, __ATOMIC_ACQ_REL);
    }
    pthread_mutex_unlock(&ctab_lock);
    if (left == 0)
        for (int d = 0; d < MSH_MAX_DEVICES; d++) msh_capture_settle(d);
}

bool msh_capture_settle(int device)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || __atomic_load_n(&msh_capture_total, __ATOMIC_ACQUIRE)) return false;
    msh_torch_capture_settle(device); /* capture pools released meanwhile, and their deferred work */
    struct msh_pool *p = msh_core_pool_get(device);
    if (p) msh_pool_after_capture(p);
    return true;
}
