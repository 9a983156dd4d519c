/*
 * lock.h: the pool's lock and the conditions waited on under it (policy/base/lock.c).
 *
 * A pool takes its lock twice per allocation and free pair, and every other figure of its cached
 * path is a few dozen instructions; glibc's pthread_mutex_lock/unlock cost 57 instructions per
 * lock and unlock through the PLT (the mutex kind's dispatch, elision checks, the owner field).
 * This is the three-state futex lock (0 free, 1 held, 2 held and maybe waited for; Drepper,
 * "Futexes Are Tricky"): the uncontended lock is one compare-exchange inline, the unlock one
 * exchange, and the kernel is entered only when a thread waits. A waiter that finds it held
 * sleeps at once, as on glibc's default mutex (lock.c says why it does not spin).
 *
 * The condition is a sequence number: a waiter reads it under the lock, unlocks, and sleeps only
 * while it is unchanged, so a broadcast between the unlock and the sleep is never lost. A wake
 * enters the kernel only when a thread waits. Waits may end spuriously (as pthread_cond_wait's):
 * every caller loops on its own predicate.
 *
 * Not recursive, no owner check, no robustness: the pool never relocks, and a fork child never
 * uses its parent's pools (shim/core.c fork_child). Must never allocate or log.
 */
#ifndef MSH_LOCK_H
#define MSH_LOCK_H

#include <stdatomic.h>
#include <stdint.h>

#include "msh.h"

struct msh_lock {
    _Atomic uint32_t v; /* 0 free, 1 held, 2 held with a thread that may sleep on it */
};

struct msh_cond {
    _Atomic uint32_t seq;     /* bumped by every signal and broadcast */
    _Atomic uint32_t waiters; /* threads between their read of seq and their wake */
};

#define MSH_LOCK_INIT {0}
#define MSH_COND_INIT {0, 0}

void msh_lock_wait(struct msh_lock *l); /* the contended lock (lock.c) */
void msh_lock_wake(struct msh_lock *l); /* one sleeper woken */

static inline void msh_lock_init(struct msh_lock *l) { atomic_init(&l->v, 0); }

static inline void msh_lock(struct msh_lock *l)
{
    uint32_t free_ = 0;
    if (MSH_LIKELY(atomic_compare_exchange_strong_explicit(&l->v, &free_, 1, memory_order_acquire,
                                                           memory_order_relaxed)))
        return;
    msh_lock_wait(l);
}

static inline void msh_unlock(struct msh_lock *l)
{
    if (MSH_UNLIKELY(atomic_exchange_explicit(&l->v, 0, memory_order_release) == 2)) msh_lock_wake(l);
}

static inline void msh_cond_init(struct msh_cond *c)
{
    atomic_init(&c->seq, 0);
    atomic_init(&c->waiters, 0);
}

/* Called with l held; returns with l held, after a signal, a broadcast or spuriously. */
void msh_cond_wait(struct msh_cond *c, struct msh_lock *l);
/* Wake every waiter / at least one (with the lock held or not). */
void msh_cond_broadcast(struct msh_cond *c);
void msh_cond_signal(struct msh_cond *c);

#endif
