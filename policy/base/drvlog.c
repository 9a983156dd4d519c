/*
 * drvlog.c: the ledger of the CUDA calls memshim makes itself (drvlog.h): the names, the snapshots
 * and their differences, the synchronize kinds, the line MEMSHIM_LOG=info prints at exit. It never
 * calls CUDA and never takes a lock.
 */
#include "drvlog.h"

#include <stdio.h>
#include <string.h>

const char *const msh_drvlog_names[MSH_DL_N] = {
#define MSH_DL_NAME_(n) #n,
    MSH_DRVLOG_FUNCS(MSH_DL_NAME_) MSH_DRVLOG_RT_FUNCS(MSH_DL_NAME_)
#undef MSH_DL_NAME_
};

struct msh_drvlog_cell msh_drvlog[MSH_DL_N];

void msh_drvlog_read(struct msh_drvlog_snap *s)
{
    double ns = msh_ticks_ns_per_tick();
    for (int f = 0; f < MSH_DL_N; f++) {
        s->ticks[f] = atomic_load_explicit(&msh_drvlog[f].ticks, memory_order_acquire);
        s->count[f] = atomic_load_explicit(&msh_drvlog[f].count, memory_order_relaxed);
        s->seconds[f] = (double)s->ticks[f] * ns * 1e-9;
    }
}

void msh_drvlog_diff(const struct msh_drvlog_snap *now, const struct msh_drvlog_snap *prev,
                     struct msh_drvlog_snap *out)
{
    double ns = msh_ticks_ns_per_tick();
    for (int f = 0; f < MSH_DL_N; f++) {
        uint64_t c0 = prev ? prev->count[f] : 0, t0 = prev ? prev->ticks[f] : 0;
        out->count[f] = now->count[f] > c0 ? now->count[f] - c0 : 0;
        out->ticks[f] = now->ticks[f] > t0 ? now->ticks[f] - t0 : 0;
        out->seconds[f] = (double)out->ticks[f] * ns * 1e-9;
    }
}

const char *const msh_sync_kind_names[MSH_SYNC_NKINDS] = {"device", "context", "stream", "event"};

int msh_sync_kind_fn(int kind)
{
    switch (kind) {
    case MSH_SYNC_DEVICE: return MSH_DL_cudaDeviceSynchronize;
    case MSH_SYNC_CONTEXT: return MSH_DL_cuCtxSynchronize;
    case MSH_SYNC_STREAM: return MSH_DL_cuStreamSynchronize;
    case MSH_SYNC_EVENT: return MSH_DL_cuEventSynchronize;
    default: return -1;
    }
}

void msh_drvlog_top3(const struct msh_drvlog_snap *s, char *buf, size_t len)
{
    int top[3] = {-1, -1, -1};
    for (int f = 0; f < MSH_DL_N; f++) {
        if (!s->count[f]) continue;
        for (int i = 0; i < 3; i++) {
            if (top[i] < 0 || s->seconds[f] > s->seconds[top[i]]) {
                for (int j = 2; j > i; j--) top[j] = top[j - 1];
                top[i] = f;
                break;
            }
        }
    }
    size_t o = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < 3 && top[i] >= 0 && o < len; i++) {
        int n = snprintf(buf + o, len - o, "%s%s %llu calls %.3f ms", i ? ", " : "", msh_drvlog_names[top[i]],
                         (unsigned long long)s->count[top[i]], s->seconds[top[i]] * 1e3);
        if (n < 0) break;
        o += (size_t)n;
    }
}
