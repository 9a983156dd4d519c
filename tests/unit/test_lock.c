/*
 * test_lock.c: the pool's lock and condition (policy/base/lock.h): mutual exclusion under
 * contention, a waiter that sleeps in the kernel marks the lock so that the unlock wakes it, and
 * the condition loses no wake-up (a broadcast wakes every waiter, a signal at least one, a
 * broadcast between a waiter's unlock and its sleep is seen), and the kernel is entered only when
 * a thread waits. A lost wake-up would hang: every join has a deadline and fails the test instead.
 *
 * lock.c enters the kernel through syscall(2); this file's syscall() stands in for glibc's (the
 * static library's objects link against it) and counts each thread's futex calls.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "lock.h"

static __thread long futex_calls; /* this thread's futex(2) calls through syscall() */

static long (*real_syscall)(long, ...);

__attribute__((constructor)) static void find_real_syscall(void) /* before any thread */
{
    real_syscall = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
}

long syscall(long number, ...)
{
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_futex) futex_calls++;
    return real_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}

/* join t within `secs`, else false (the thread is left behind: the test has failed) */
static bool join_within(pthread_t t, int secs)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += secs;
    return pthread_timedjoin_np(t, NULL, &dl) == 0;
}

static struct msh_lock mx = MSH_LOCK_INIT;
static uint64_t counter;        /* plain: only the lock keeps its increments whole */
static int inside;              /* threads inside the critical section */
static _Atomic int overlaps;    /* times a thread found another inside */
enum { THREADS = 8, ROUNDS = 100000 };

static void *hammer(void *arg)
{
    (void)arg;
    for (int i = 0; i < ROUNDS; i++) {
        msh_lock(&mx);
        if (inside++ != 0) atomic_fetch_add(&overlaps, 1);
        uint64_t c = counter;
        if ((i & 255) == 0) sched_yield(); /* preempted inside now and then: the others contend */
        counter = c + 1;
        inside--;
        msh_unlock(&mx);
    }
    return NULL;
}

TEST(lock_excludes_under_contention)
{
    pthread_t t[THREADS];
    counter = 0;
    for (int i = 0; i < THREADS; i++) REQUIRE(pthread_create(&t[i], NULL, hammer, NULL) == 0);
    for (int i = 0; i < THREADS; i++) REQUIRE(join_within(t[i], 120));
    CHECKF(counter == (uint64_t)THREADS * ROUNDS, "%llu of %llu increments", (unsigned long long)counter,
           (unsigned long long)THREADS * ROUNDS);
    CHECK(atomic_load(&overlaps) == 0);
    CHECK(atomic_load(&mx.v) == 0); /* free, no waiter mark left behind */
}

static _Atomic int entered;

static void *take_once(void *arg)
{
    struct msh_lock *l = arg;
    msh_lock(l);
    atomic_store(&entered, 1);
    msh_unlock(l);
    return NULL;
}

TEST(a_sleeping_waiter_marks_the_lock_and_the_unlock_wakes_it)
{
    struct msh_lock l = MSH_LOCK_INIT;
    atomic_store(&entered, 0);
    msh_lock(&l);
    CHECK(atomic_load(&l.v) == 1);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, take_once, &l) == 0);
    /* past its spin, the waiter marks the lock (2) and sleeps */
    for (int i = 0; i < 2000 && atomic_load(&l.v) != 2; i++) usleep(1000);
    CHECK(atomic_load(&l.v) == 2);
    usleep(20000);
    CHECK(atomic_load(&entered) == 0); /* still held: it must not get in */
    msh_unlock(&l);                    /* 2: the unlock wakes it */
    REQUIRE(join_within(t, 10));
    CHECK(atomic_load(&entered) == 1);
    CHECK(atomic_load(&l.v) == 0); /* the woken waiter took it marked, and its unlock cleared the mark */
}

struct gate {
    struct msh_lock l;
    struct msh_cond c;
    int open;     /* the predicate, under l */
    int woken;    /* waiters through, under l */
    int turn;     /* ping-pong: whose turn, under l */
};

static void *wait_open(void *arg)
{
    struct gate *g = arg;
    msh_lock(&g->l);
    while (!g->open) msh_cond_wait(&g->c, &g->l);
    g->woken++;
    msh_unlock(&g->l);
    return NULL;
}

TEST(a_broadcast_wakes_every_waiter)
{
    struct gate g = {.l = MSH_LOCK_INIT, .c = MSH_COND_INIT};
    pthread_t t[6];
    for (int i = 0; i < 6; i++) REQUIRE(pthread_create(&t[i], NULL, wait_open, &g) == 0);
    for (int i = 0; i < 2000 && atomic_load(&g.c.waiters) < 6; i++) usleep(1000);
    CHECK(atomic_load(&g.c.waiters) == 6); /* all asleep on the condition */
    msh_lock(&g.l);
    g.open = 1;
    msh_cond_broadcast(&g.c);
    msh_unlock(&g.l);
    bool all = true;
    for (int i = 0; i < 6; i++) all &= join_within(t[i], 10);
    REQUIRE(all);
    CHECK(g.woken == 6);
    CHECK(atomic_load(&g.c.waiters) == 0);
}

TEST(a_signal_wakes_a_waiter)
{
    struct gate g = {.l = MSH_LOCK_INIT, .c = MSH_COND_INIT};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, wait_open, &g) == 0);
    for (int i = 0; i < 2000 && atomic_load(&g.c.waiters) < 1; i++) usleep(1000);
    msh_lock(&g.l);
    g.open = 1;
    msh_cond_signal(&g.c);
    msh_unlock(&g.l);
    REQUIRE(join_within(t, 10));
    CHECK(g.woken == 1);
}

enum { PINGS = 20000 };

static void *pong(void *arg)
{
    struct gate *g = arg;
    msh_lock(&g->l);
    for (int i = 0; i < PINGS; i++) {
        while (g->turn != 1) msh_cond_wait(&g->c, &g->l);
        g->turn = 0;
        msh_cond_broadcast(&g->c);
    }
    msh_unlock(&g->l);
    return NULL;
}

/* Each side waits for its turn and hands it over: a wake-up lost between a waiter's unlock and
 * its sleep stops both for good. */
TEST(ping_pong_loses_no_wake_up)
{
    struct gate g = {.l = MSH_LOCK_INIT, .c = MSH_COND_INIT};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, pong, &g) == 0);
    msh_lock(&g.l);
    for (int i = 0; i < PINGS; i++) {
        g.turn = 1;
        msh_cond_broadcast(&g.c);
        while (g.turn != 0) msh_cond_wait(&g.c, &g.l);
    }
    msh_unlock(&g.l);
    REQUIRE(join_within(t, 60));
    CHECK(g.turn == 0);
}

/* The allocation path's lock and the conditions' wakes make no system call while nobody waits;
 * with a sleeper, the unlock or the broadcast wakes it with one (the count is not blind). */
TEST(the_kernel_is_entered_only_when_a_thread_waits)
{
    struct msh_lock l = MSH_LOCK_INIT;
    struct msh_cond c = MSH_COND_INIT;
    long f0 = futex_calls;
    for (int i = 0; i < 10000; i++) {
        msh_lock(&l);
        msh_cond_broadcast(&c);
        msh_cond_signal(&c);
        msh_unlock(&l);
    }
    CHECKF(futex_calls == f0, "%ld futex calls for 10000 uncontended rounds", futex_calls - f0);

    /* a sleeper on the lock: the unlock wakes it, one call */
    atomic_store(&entered, 0);
    msh_lock(&l);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, take_once, &l) == 0);
    for (int i = 0; i < 2000 && atomic_load(&l.v) != 2; i++) usleep(1000);
    f0 = futex_calls;
    msh_unlock(&l);
    CHECK(futex_calls == f0 + 1);
    REQUIRE(join_within(t, 10));

    /* a sleeper on the condition: the broadcast wakes it, one call */
    struct gate g = {.l = MSH_LOCK_INIT, .c = MSH_COND_INIT};
    REQUIRE(pthread_create(&t, NULL, wait_open, &g) == 0);
    for (int i = 0; i < 2000 && atomic_load(&g.c.waiters) < 1; i++) usleep(1000);
    usleep(20000); /* (counted before its sleep: give it time to sleep) */
    msh_lock(&g.l);
    g.open = 1;
    f0 = futex_calls;
    msh_cond_broadcast(&g.c);
    CHECK(futex_calls == f0 + 1);
    msh_unlock(&g.l);
    REQUIRE(join_within(t, 10));
    CHECK(g.woken == 1);
}

TEST_MAIN()
