/*
 * lock.c: the slow halves of lock.h's lock and condition: sleeping and waking through futex(2).
 */
#include "lock.h"

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

static void futex_wait(_Atomic uint32_t *w, uint32_t val)
{
    /* returns at a wake, at once when *w != val (EAGAIN), or at a signal (EINTR): callers re-check */
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w, int n)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

/* Take l marked as waited for (2): whoever unlocks it then wakes a sleeper. */
static void lock_contended(struct msh_lock *l)
{
    while (atomic_exchange_explicit(&l->v, 2, memory_order_acquire) != 0) futex_wait(&l->v, 2);
}

void msh_lock_wait(struct msh_lock *l)
{
    /* No spinning, as glibc's default mutex: with more threads than CPUs a spinning waiter burns
     * the time slice its holder needs (a 64-round spin gave the pool's 4-thread p99 1.7-5.1 us
     * against glibc's 0.8-1.0 us in 3 alternating runs on 2 CPUs; without it, 10 alternating runs
     * put both at a median p99 of 0.8-1.1 us: docs/benchmarks.md "The front end"). */
    lock_contended(l);
}

void msh_lock_wake(struct msh_lock *l) { futex_wake(&l->v, 1); }

void msh_cond_wait(struct msh_cond *c, struct msh_lock *l)
{
    /* waiters is raised before seq is read, and a waker bumps seq before it reads waiters (both
     * sequentially consistent): either the waker sees this waiter, or this waiter sees the new
     * seq and does not sleep */
    atomic_fetch_add(&c->waiters, 1);
    uint32_t seq = atomic_load(&c->seq);
    msh_unlock(l);
    futex_wait(&c->seq, seq);
    atomic_fetch_sub(&c->waiters, 1);
    lock_contended(l); /* other waiters woken with this one may sleep on l now */
}

void msh_cond_broadcast(struct msh_cond *c)
{
    atomic_fetch_add(&c->seq, 1);
    if (atomic_load(&c->waiters)) futex_wake(&c->seq, INT_MAX);
}

void msh_cond_signal(struct msh_cond *c)
{
    atomic_fetch_add(&c->seq, 1);
    if (atomic_load(&c->waiters)) futex_wake(&c->seq, 1);
}
