/*
 * watch.h: memshim's watcher thread and the end of a run (shim/watch.c): epochs on time
 * (MEMSHIM_EPOCH=seconds) and on MEMSHIM_EPOCH_SIGNAL closed by a thread of memshim's own, and
 * the reports of a run ended by SIGTERM, SIGINT or SIGHUP written before it ends with that signal,
 * and the files of a request refused before any driver work. Called by shim/core.c only.
 */
#ifndef MSH_WATCH_H
#define MSH_WATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "pool.h"

/* At start-up (memshim enabled): the thread, then the signal handlers. Failures are one warning;
 * without the thread, time and signal epochs close at allocations only. */
void msh_watch_start(void);
/* At each allocation (`now`: the coarse clock): the time or signal epoch that is due, claimed by
 * this caller ("signal", "seconds"), or NULL. Two relaxed loads when nothing is due. An epoch
 * that no allocation closes within 50 ms is closed by the thread. */
const char *msh_watch_poll(uint64_t now);
/* A signal that ends runs reached a handler the program installed, which memshim's handler ran
 * (so the summary says the run was interrupted); 0 when none. */
int msh_watch_noted_signal(void);
/* A request refused before any driver work (issue 31): its OOM report `index` and OOM snapshot
 * `snap` (-1: none) are handed to the thread, with `o`, the failure the report shows. A few
 * stores and a semaphore post: the failing thread does no file work. false when the thread is
 * not running (the caller writes them itself). */
bool msh_watch_defer_oom(int device, int index, int snap, const struct msh_pool_oom *o);
/* Write the handed-over OOM files not yet written (the thread after each wake; the run's end
 * before its summary). `at_end`: also wait, up to OOMQ_END_WAIT_S, for the files another thread
 * is writing or handing over right now, so that the process does not end halfway through them. */
void msh_watch_flush_oom(bool at_end);
/* In a forked child (pthread_atfork): the program's own dispositions back, no thread. */
void msh_watch_fork_child(void);
/* The name of a signal for reports ("SIGTERM"), or "signal N". Static storage for the common
 * ones; `buf` for the rest. */
const char *msh_signal_name(int sig, char *buf, int len);

#endif
