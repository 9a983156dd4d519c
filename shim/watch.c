/*
 * watch.c: memshim's watcher thread, and how a run ends.
 *
 * One thread per process (started with memshim) waits on a semaphore. Signal handlers and the
 * clock wake it: it closes MEMSHIM_EPOCH=seconds epochs on time and MEMSHIM_EPOCH_SIGNAL epochs
 * when the signal came, whether or not the job allocates (a quiet phase, an evaluation loop, or
 * PyTorch's cache serving every tensor in segment mode; a job that allocates closes them at its
 * next allocation, within GRACE_NS), and it writes the reports of a run that a signal ends. SIGTERM (how torchrun, Slurm and Kubernetes stop ranks), SIGINT and SIGHUP, when
 * the program left them at their default action, get memshim's handler: the thread writes the
 * open epoch (reason `interrupted`), the summary and MEMSHIM_SNAPSHOT, then restores the default
 * action and sends the signal again, so the job ends with the status it would have had. When the
 * program installed a handler first, memshim's handler runs it (chains, never replaces): the
 * program decides what happens, and a summary written later says the run was interrupted.
 * A request refused before any driver work (larger than the device or the limit alone) hands its
 * OOM report and OOM snapshot to the thread, so a batch-size finder's refused probe costs the
 * allocating thread no file work (issue 31).
 * Python's own end after an uncaught KeyboardInterrupt (it finalizes, then kills itself with
 * SIGINT, so C exit handlers never run) is covered from Python's exit path
 * (memshim_run_interrupted, hooks/python/memshim/_boot.py).
 *
 * What a signal handler here does is async-signal-safe only: atomics, sem_post, getpid,
 * sigaction, raise and the program's own handler. Nothing is written, allocated or locked there.
 * The thread never serves hooks, blocks every signal, and never holds a pool lock while a report
 * is written (shim/core.c builds reports outside the pool lock). A second signal of the same
 * kind while the reports are being written ends the process at once (the default action): a
 * user pressing Ctrl-C twice, or a launcher that escalates, is never kept waiting by memshim.
 */
#include "watch.h"

#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "msh.h"

static const int end_sigs[] = {SIGTERM, SIGINT, SIGHUP};

/* OOM files handed over by msh_watch_defer_oom: at most 16 reports and 16 snapshots per process
 * (shim/core.c, shim/record/history.c), one entry for both of a failure. state: 0 free (or claimed
 * and being filled), 1 ready, 2 taken by a writer, 3 written. */
#define OOMQ_MAX 32
static struct {
    _Atomic int state;
    int device, index, snap;
    struct msh_pool_oom oom;
} oomq[OOMQ_MAX];
static _Atomic int oomq_n;
#define NEND ((int)(sizeof end_sigs / sizeof end_sigs[0]))

static sem_t wake;
static pid_t owner;                 /* the process that installed the handlers */
static _Atomic bool running;        /* the thread waits on `wake` */
static _Atomic int end_signal;      /* the signal that ends the run (0: none yet) */
static _Atomic int noted_signal;    /* an end signal handled by the program's own handler */
static _Atomic int epoch_pending;   /* MEMSHIM_EPOCH_SIGNAL arrived */
static _Atomic uint64_t seconds_due; /* MEMSHIM_EPOCH=seconds: when the next one closes (0: off) */
/* An epoch is due (the signal came, or the seconds passed): the allocation path reads this flag,
 * never a clock, and closes the epoch at its next call (msh_core_count, core.h). */
_Atomic int msh_watch_flag;
static uint64_t seconds_period;

/* What the program had on each end signal, and what memshim did with it. Written before the
 * handlers are installed, read-only after (the handlers read them). */
static struct sigaction prev[NEND];
static bool installed[NEND], chains[NEND];
static struct sigaction prev_epoch;
static bool epoch_installed;

static int end_index(int sig)
{
    for (int i = 0; i < NEND; i++)
        if (end_sigs[i] == sig) return i;
    return -1;
}

const char *msh_signal_name(int sig, char *buf, int len)
{
    switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    default: snprintf(buf, (size_t)len, "signal %d", sig); return buf;
    }
}

/* The default action, now: restore it and raise the signal again. Inside a handler the signal is
 * blocked, so it is delivered (and ends the process) as the handler returns. */
static void default_action_now(int sig)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
    raise(sig);
}

static void call_prev(const struct sigaction *p, int sig, siginfo_t *si, void *uc)
{
    if (p->sa_flags & SA_SIGINFO) {
        if (p->sa_sigaction) p->sa_sigaction(sig, si, uc);
    } else if (p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN && p->sa_handler) {
        p->sa_handler(sig);
    }
}

static void on_end_signal(int sig, siginfo_t *si, void *uc)
{
    int saved = errno;
    int i = end_index(sig);
    if (i < 0) {
        errno = saved;
        return;
    }
    if (chains[i]) {
        /* The program's handler decides; memshim only remembers that the run was interrupted
         * (in this process: a forked child's own signals are not its parent's). */
        if (getpid() == owner) atomic_store(&noted_signal, sig);
        call_prev(&prev[i], sig, si, uc);
    } else if (getpid() != owner || !atomic_load(&running)) {
        default_action_now(sig); /* a forked child, or no thread to write: end as without memshim */
    } else {
        int expect = 0;
        if (atomic_compare_exchange_strong(&end_signal, &expect, sig)) sem_post(&wake);
        else default_action_now(sig); /* a second one while the reports are written */
    }
    errno = saved;
}

static void on_epoch_signal(int sig)
{
    (void)sig;
    int saved = errno;
    if (getpid() == owner) {
        atomic_store(&epoch_pending, 1);
        atomic_store(&msh_watch_flag, 1);
        if (atomic_load(&running)) sem_post(&wake);
    }
    errno = saved;
}

/* The run is ending by `sig`: write its reports, then end it as the signal would have. */
static _Noreturn void end_run(int sig)
{
    char nb[32];
    const char *name = msh_signal_name(sig, nb, sizeof nb);
    msh_info("%s: writing the open epoch, the summary and the snapshot, then ending with %s as the "
             "job would have without memshim", name, name);
    msh_core_finish(true, sig);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, NULL);
    kill(getpid(), sig);
    for (;;) pause();
}

/* CLOCK_MONOTONIC deadline -> a CLOCK_REALTIME one for sem_timedwait, at most `cap_ns` ahead (a
 * wall clock set back cannot stall the thread for longer than that). */
static struct timespec wait_until(uint64_t due_ns, uint64_t cap_ns)
{
    uint64_t now = msh_now_ns(), left = due_ns > now ? due_ns - now : 0;
    if (left > cap_ns) left = cap_ns;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + left % 1000000000ull;
    ts.tv_sec += (time_t)(left / 1000000000ull + ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    return ts;
}

/* The boundary after `due`: one period on; a job that fell far behind (suspended, or no thread
 * to close them) starts a fresh period rather than writing a burst of empty epochs. */
static uint64_t next_due(uint64_t due, uint64_t now)
{
    uint64_t next = due + seconds_period;
    return next <= now ? now + seconds_period : next;
}

/* A time or signal epoch due while the job allocates is closed by its next allocation
 * (msh_watch_poll): between two of the allocating thread's calls, so a single-threaded job's
 * epoch ends exactly there, as it always did. The thread closes it when no allocation came within
 * GRACE_NS: a quiet phase, an evaluation loop, PyTorch's cache serving everything. */
#define GRACE_NS 50000000ull

static void *watch_main(void *arg)
{
    (void)arg;
    msh_in_hook = 1; /* this thread never serves hooks */
    uint64_t pending_seen = 0; /* when this thread first saw the epoch signal pending */
    for (;;) {
        uint64_t due = atomic_load(&seconds_due), until = 0;
        /* at the deadline the flag goes up (the next allocation closes it); GRACE_NS later, if
         * none came, this thread closes it */
        if (due) until = msh_now_ns() < due ? due : due + GRACE_NS;
        if (pending_seen && (!until || pending_seen + GRACE_NS < until)) until = pending_seen + GRACE_NS;
        if (until) {
            struct timespec ts = wait_until(until, 1000000000ull);
            sem_timedwait(&wake, &ts);
        } else {
            sem_wait(&wake);
        }
        int sig = atomic_load(&end_signal);
        if (sig) end_run(sig);
        msh_watch_flush_oom(false);
        uint64_t now = msh_now_ns();
        if (!atomic_load(&epoch_pending)) pending_seen = 0;
        else if (!pending_seen) pending_seen = now;
        else if (now >= pending_seen + GRACE_NS) {
            pending_seen = 0;
            if (atomic_exchange(&epoch_pending, 0)) msh_core_close_epoch("signal");
        }
        due = atomic_load(&seconds_due);
        if (due && now >= due) atomic_store(&msh_watch_flag, 1);
        if (due && now >= due + GRACE_NS && atomic_compare_exchange_strong(&seconds_due, &due, next_due(due, now)))
            msh_core_close_epoch("seconds");
    }
    return NULL;
}

int msh_watch_noted_signal(void)
{
    return atomic_load(&noted_signal);
}

static bool has_handler(const struct sigaction *a)
{
    return a->sa_flags & SA_SIGINFO ? a->sa_sigaction != NULL
                                    : a->sa_handler != SIG_DFL && a->sa_handler != SIG_IGN;
}

static void install_epoch_signal(int signo)
{
    struct sigaction old;
    if (sigaction(signo, NULL, &old) == 0 && has_handler(&old)) {
        msh_warn("MEMSHIM_EPOCH=signal: signal %d already has a handler in this program; memshim "
                 "leaves it alone (call memshim_epoch() instead)", signo);
        return;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_epoch_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    prev_epoch = old;
    if (sigaction(signo, &sa, NULL) == 0) epoch_installed = true;
}

void msh_watch_start(void)
{
    owner = getpid();
    /* The first deadline before the thread starts: it reads it on its way into its first wait. */
    if (msh_cfg.epoch_src == MSH_EPOCH_SECONDS && msh_cfg.epoch_seconds > 0) {
        seconds_period = (uint64_t)(msh_cfg.epoch_seconds * 1e9);
        if (!seconds_period) seconds_period = 1;
        atomic_store(&seconds_due, msh_now_ns() + seconds_period);
    }
    bool sem = sem_init(&wake, 0, 0) == 0;
    if (sem) {
        /* The thread starts with every signal blocked: handlers run on the program's threads. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        if (pthread_create(&th, &attr, watch_main, NULL) == 0) atomic_store(&running, true);
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (!atomic_load(&running))
        msh_warn("cannot start memshim's watcher thread; time and signal epochs close at the next "
                 "allocation, and a run ended by a signal gets no summary");
    int epoch_signo = msh_cfg.epoch_src == MSH_EPOCH_SIGNAL ? msh_cfg.epoch_signal : 0;
    if (epoch_signo) install_epoch_signal(epoch_signo);
    if (!msh_cfg.catch_signals || !atomic_load(&running)) return;
    for (int i = 0; i < NEND; i++) {
        int sig = end_sigs[i];
        if (sig == epoch_signo) continue; /* the user chose it to close epochs */
        if (sigaction(sig, NULL, &prev[i]) != 0) continue;
        if (!(prev[i].sa_flags & SA_SIGINFO) && prev[i].sa_handler == SIG_IGN) continue; /* nohup */
        chains[i] = has_handler(&prev[i]);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_end_signal;
        /* the program's flags where memshim runs its handler (SA_RESTART, SA_ONSTACK), and the
         * signal itself blocked while the handler runs (a second one is seen after it) */
        sa.sa_flags = SA_SIGINFO | (chains[i] ? prev[i].sa_flags & (SA_RESTART | SA_ONSTACK) : SA_RESTART);
        sa.sa_mask = chains[i] ? prev[i].sa_mask : sa.sa_mask;
        if (!chains[i]) sigemptyset(&sa.sa_mask);
        if (sigaction(sig, &sa, NULL) == 0) installed[i] = true;
    }
}

const char *msh_watch_poll(uint64_t now)
{
    /* down first: a signal or deadline that comes after this look raises it again */
    atomic_store_explicit(&msh_watch_flag, 0, memory_order_relaxed);
    if (MSH_UNLIKELY(atomic_load_explicit(&epoch_pending, memory_order_relaxed)) && atomic_exchange(&epoch_pending, 0))
        return "signal";
    uint64_t due = atomic_load_explicit(&seconds_due, memory_order_relaxed);
    /* Many threads see the deadline pass; the one that moves it closes the epoch. */
    if (MSH_UNLIKELY(due && now >= due) && atomic_compare_exchange_strong(&seconds_due, &due, next_due(due, now)))
        return "seconds";
    return NULL;
}

bool msh_watch_defer_oom(int device, int index, int snap, const struct msh_pool_oom *o)
{
    if (getpid() != owner || !atomic_load(&running)) return false;
    int i = atomic_fetch_add(&oomq_n, 1);
    if (i >= OOMQ_MAX) return false;
    oomq[i].device = device, oomq[i].index = index, oomq[i].snap = snap, oomq[i].oom = *o;
    atomic_store_explicit(&oomq[i].state, 1, memory_order_release);
    sem_post(&wake);
    return true;
}

/* How long the run's end waits for OOM files another thread is writing (a report and a snapshot:
 * milliseconds, unless the disk stalls). */
#define OOMQ_END_WAIT_S 10

void msh_watch_flush_oom(bool at_end)
{
    uint64_t deadline = 0;
    for (;;) {
        int n = atomic_load(&oomq_n);
        bool busy = false;
        for (int i = 0; i < n && i < OOMQ_MAX; i++) {
            int ready = 1; /* an entry claimed but not yet filled is left to the wake its owner posts */
            if (atomic_compare_exchange_strong(&oomq[i].state, &ready, 2)) {
                msh_core_write_oom(oomq[i].device, oomq[i].index, oomq[i].snap, &oomq[i].oom);
                atomic_store_explicit(&oomq[i].state, 3, memory_order_release);
            } else if (ready != 3) {
                busy = true; /* being filled by its owner, or written by the watcher right now */
            }
        }
        if (!at_end || !busy) return;
        /* The run ends: the watcher (or a failing thread) is halfway through an entry, and the
         * process must not end before the files are on disk (a refusal right before the end). */
        uint64_t now = msh_now_ns();
        if (!deadline) deadline = now + OOMQ_END_WAIT_S * 1000000000ull;
        if (now >= deadline) {
            msh_warn("the run ends while an OOM report or snapshot is still being written; waited "
                     "%d s, it may be incomplete", OOMQ_END_WAIT_S);
            return;
        }
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    }
}

void msh_watch_fork_child(void)
{
    /* The child has no watcher thread and serves nothing: the program's own dispositions back
     * (a DataLoader worker must still die of the SIGTERM its parent sends it). */
    for (int i = 0; i < NEND; i++)
        if (installed[i]) {
            sigaction(end_sigs[i], &prev[i], NULL);
            installed[i] = false;
        }
    if (epoch_installed) {
        sigaction(msh_cfg.epoch_signal, &prev_epoch, NULL);
        epoch_installed = false;
    }
    atomic_store(&running, false);
    atomic_store(&seconds_due, 0);
    atomic_store(&end_signal, 0);
    atomic_store(&noted_signal, 0);
    /* the child writes nothing of its parent's, and its end waits for none of them */
    for (int i = 0; i < OOMQ_MAX; i++) atomic_store(&oomq[i].state, 3);
    atomic_store(&oomq_n, OOMQ_MAX);
}
