/*
 * hotclock.c: the tick source behind msh_ticks(), its calibration against CLOCK_MONOTONIC and
 * CLOCK_REALTIME, the coarse clock, and the random gaps of sampled latency timing (hotclock.h).
 *
 * The CPU counter is used only where the kernel itself uses it as its clock source: then the
 * kernel has checked that it is invariant and that the CPUs agree, so stamps taken by different
 * threads order the events they stamp. Anything else (another clock source, another
 * architecture) falls back to CLOCK_MONOTONIC, slower but always right. Must never allocate or
 * take a lock after start-up, and never call a CUDA hook.
 */
#include "hotclock.h"

#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

int msh_ticks_hw;
clockid_t msh_coarse_clock = CLOCK_MONOTONIC;
uint32_t msh_lat_weight = 1;
__thread uint32_t msh_lat_left;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static uint64_t anchor_ticks, anchor_mono;
static double npt0 = 1.0; /* ns per tick from the start-up calibration */

static uint64_t clock_ns(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#if defined(__x86_64__) || defined(__i386__)
/* The kernel's current clock source is the TSC: it found the TSC invariant and synchronized. */
static bool kernel_trusts_tsc(void)
{
    int fd = open("/sys/devices/system/clocksource/clocksource0/current_clocksource", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    char buf[32] = "";
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n >= 3 && !strncmp(buf, "tsc", 3) && (n == 3 || buf[3] == '\n');
}
#endif

static void do_init(void)
{
    struct timespec res;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0 && res.tv_nsec <= 10000000 &&
        clock_gettime(CLOCK_MONOTONIC_COARSE, &res) == 0)
        msh_coarse_clock = CLOCK_MONOTONIC_COARSE;
#if defined(__x86_64__) || defined(__i386__)
    if (kernel_trusts_tsc()) {
        /* 200 us against CLOCK_MONOTONIC: good to 1e-3, refined later over the process's life */
        uint64_t t0 = __rdtsc(), m0 = clock_ns(CLOCK_MONOTONIC), m1, t1;
        do {
            m1 = clock_ns(CLOCK_MONOTONIC);
            t1 = __rdtsc();
        } while (m1 - m0 < 200000);
        if (t1 > t0) {
            npt0 = (double)(m1 - m0) / (double)(t1 - t0);
            msh_ticks_hw = 1;
        }
    }
#elif defined(__aarch64__)
    uint64_t freq;
    __asm__ __volatile__("mrs %0, cntfrq_el0" : "=r"(freq));
    if (freq) { /* the generic timer is one counter for every CPU, at this fixed rate */
        npt0 = 1e9 / (double)freq;
        msh_ticks_hw = 1;
    }
#endif
    anchor_mono = clock_ns(CLOCK_MONOTONIC);
    anchor_ticks = msh_ticks();
    uint64_t every = msh_cfg.latency_sample ? msh_cfg.latency_sample : 1;
    msh_lat_weight = every > UINT32_MAX ? UINT32_MAX : (uint32_t)every;
}

void msh_hotclock_init(void)
{
    pthread_once(&once, do_init);
}

double msh_ticks_ns_per_tick(void)
{
    if (!msh_ticks_hw) return 1.0;
    uint64_t t = msh_ticks(), m = clock_ns(CLOCK_MONOTONIC);
    /* after 50 ms the rate over the whole run beats the start-up estimate */
    if (m - anchor_mono >= 50000000 && t > anchor_ticks) return (double)(m - anchor_mono) / (double)(t - anchor_ticks);
    return npt0;
}

uint64_t msh_ticks_from_ns(uint64_t ns)
{
    return (uint64_t)((double)ns / msh_ticks_ns_per_tick());
}

void msh_ticks_wall_init(struct msh_ticks_wall *w)
{
    w->ns_per_tick = msh_ticks_ns_per_tick();
    w->ticks_now = msh_ticks();
    w->wall_now_ns = (int64_t)clock_ns(CLOCK_REALTIME);
}

uint64_t msh_ticks_wall_us(const struct msh_ticks_wall *w, uint64_t t)
{
    /* signed: a stamp taken a moment after ticks_now (another thread) lands a moment later */
    double back = ((double)w->ticks_now - (double)t) * w->ns_per_tick;
    int64_t ns = w->wall_now_ns - (int64_t)back;
    return ns > 0 ? (uint64_t)ns / 1000 : 0;
}

/* ---- sampled latency timing -------------------------------------------------------------------- */

static __thread uint64_t lat_rng;
static __thread uint32_t lat_exact; /* calls timed one by one on this thread */

/* Calls until the next timed one: geometric with mean `every`, i.e. each call is timed
 * independently with probability 1/every. */
static uint32_t gap(uint32_t every)
{
    if (every <= 1) return 1;
    if (!lat_rng) lat_rng = ((uint64_t)(uintptr_t)&lat_rng * 0x9E3779B97F4A7C15ull) ^ msh_ticks() ^ 1;
    lat_rng ^= lat_rng << 13;
    lat_rng ^= lat_rng >> 7;
    lat_rng ^= lat_rng << 17;
    double u = ((double)(lat_rng >> 11) + 0.5) / 9007199254740992.0; /* (0, 1) */
    double g = 1.0 + floor(log(u) / log1p(-1.0 / (double)every));
    return g >= 4294967295.0 ? UINT32_MAX : (uint32_t)g;
}

uint32_t msh_lat_next(void)
{
    if (lat_exact < MSH_LAT_EXACT) {
        lat_exact++;
        msh_lat_left = 1; /* the next call comes back here */
        return 1;
    }
    uint32_t every = __atomic_load_n(&msh_lat_weight, __ATOMIC_RELAXED);
    msh_lat_left = gap(every);
    return every;
}

void msh_lat_set_every(uint32_t n)
{
    __atomic_store_n(&msh_lat_weight, n ? n : 1, __ATOMIC_RELAXED);
    lat_exact = MSH_LAT_EXACT;
    msh_lat_left = 0;
}
