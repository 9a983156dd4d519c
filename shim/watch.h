/*
 * watch.h: memshim's watcher thread and the end of a run (shim/watch.c): epochs on time
 * (MEMSHIM_EPOCH=seconds) and on MEMSHIM_EPOCH_SIGNAL closed by a thread of memshim's own, and
 * the reports of a run ended by SIGTERM, SIGINT or SIGHUP written before it ends with that signal.
 * Called by shim/core.c only.
 */
#ifndef MSH_WATCH_H
#define MSH_WATCH_H

#include <stdbool.h>
#include <stdint.h>

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
/* In a forked child (pthread_atfork): the program's own dispositions back, no thread. */
void msh_watch_fork_child(void);
/* The name of a signal for reports ("SIGTERM"), or "signal N". Static storage for the common
 * ones; `buf` for the rest. */
const char *msh_signal_name(int sig, char *buf, int len);

#endif
