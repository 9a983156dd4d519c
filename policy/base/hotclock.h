/*
 * hotclock.h: time on the allocation path (policy/base/hotclock.c). clock_gettime(CLOCK_MONOTONIC)
 * costs 20-60 ns on a virtual machine, about what the pool's whole cached path costs, so the
 * path reads no precise clock on most calls: msh_ticks() (the CPU's invariant counter, as
 * PyTorch's own history recorder stamps its events) stamps the snapshot ring and times GIL
 * waits, msh_coarse_ns() (CLOCK_MONOTONIC_COARSE, a few ns) serves the per-call activity tick,
 * and msh_lat_sampled() picks the pool calls whose latency is timed for the reports.
 *
 * Must never allocate, take a lock or call a CUDA hook from the inline functions; ticks taken
 * before msh_hotclock_init() are nanoseconds and must not be compared with later ones.
 *
 * policy/base/ is the ground floor every folder may use (msh.h says what it holds); it includes
 * nothing of memshim's outside policy/base.
 */
#ifndef MSH_HOTCLOCK_H
#define MSH_HOTCLOCK_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "msh.h"

/* Start-up: decide the tick source, calibrate it, pick the coarse clock. Idempotent. */
void msh_hotclock_init(void);

/* 1 once ticks come from the CPU counter; 0: they are CLOCK_MONOTONIC nanoseconds. */
extern int msh_ticks_hw;
/* CLOCK_MONOTONIC_COARSE where the kernel has it (same origin as CLOCK_MONOTONIC, at most one
 * scheduler tick behind), else CLOCK_MONOTONIC. */
extern clockid_t msh_coarse_clock;

/* A time stamp that orders events across threads: the TSC (x86) or the generic timer (arm64)
 * only where the kernel uses that counter as its own clock source (it checked that the CPUs
 * agree), else CLOCK_MONOTONIC in ns. */
static inline uint64_t msh_ticks(void)
{
#if defined(__x86_64__) || defined(__i386__)
    if (MSH_LIKELY(msh_ticks_hw)) return __rdtsc();
#elif defined(__aarch64__)
    if (MSH_LIKELY(msh_ticks_hw)) {
        uint64_t v;
        __asm__ __volatile__("isb\n\tmrs %0, cntvct_el0" : "=r"(v)::"memory");
        return v;
    }
#endif
    return msh_now_ns();
}

static inline uint64_t msh_coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(msh_coarse_clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Nanoseconds per tick (1.0 without a hardware counter), refined as the process runs. */
double msh_ticks_ns_per_tick(void);
/* `ns` as a tick count (for thresholds). */
uint64_t msh_ticks_from_ns(uint64_t ns);

/* Converting stamps to wall-clock time: taken once per batch (a snapshot). */
struct msh_ticks_wall {
    uint64_t ticks_now;
    int64_t wall_now_ns; /* CLOCK_REALTIME */
    double ns_per_tick;
};
void msh_ticks_wall_init(struct msh_ticks_wall *w);
/* Microseconds since 1970 of stamp `t` (PyTorch's time_us). */
uint64_t msh_ticks_wall_us(const struct msh_ticks_wall *w, uint64_t t);

/* ---- sampled latency timing ------------------------------------------------------------------
 * The pool times every one of a thread's first MSH_LAT_EXACT calls (short runs and tests get
 * exact figures), then one call in MEMSHIM_LATENCY_SAMPLE (on average, at random: geometric gaps
 * per thread, so periodic training steps cannot alias with the choice), each counting
 * msh_lat_weight times: its histogram and totals stay unbiased estimates of all calls. */
#define MSH_LAT_EXACT 4096
extern uint32_t msh_lat_weight;
extern __thread uint32_t msh_lat_left;
uint32_t msh_lat_next(void);
/* The weight this call's timing counts with: 0 (not timed), 1 or msh_lat_weight. */
static inline uint32_t msh_lat_sample(void)
{
    if (MSH_LIKELY(msh_lat_left > 1)) {
        msh_lat_left--;
        return 0;
    }
    return msh_lat_next();
}
/* Tests: time one call in n from now on (1: every call), this thread's exact start skipped. */
void msh_lat_set_every(uint32_t n);

#endif
