/*
 * stepfig.h: a figure noted once per optimizer step, summarized over an epoch as min, median and
 * max: the reports' fragmentation.step_allocated_over_reserved (STAlloc's per-iteration max
 * allocated / max reserved; docs/reports.md) and the replay's per-pass figure.
 *
 * Min and max are exact. The median is exact up to MSH_STEPFIG_KEEP steps; past that the set
 * keeps every k-th step (k doubles each time it fills: a uniform sample of the epoch's steps) and
 * the median is that sample's. Noting a step never allocates and never takes a lock: the caller
 * serializes (the shim's epoch lock, the replay's single thread).
 */
#ifndef MSH_STEPFIG_H
#define MSH_STEPFIG_H

#include <stdbool.h>
#include <stdint.h>

#define MSH_STEPFIG_KEEP 2048

struct msh_stepfig {
    uint64_t n;        /* steps noted */
    double min, max;
    uint32_t nkept;    /* values in kept[] */
    uint32_t stride;   /* steps n with n % stride == 0 are kept (0 before the first note) */
    double kept[MSH_STEPFIG_KEEP];
};

/* What a report shows: `steps` 0 when nothing was noted (the figure is then unknown). */
struct msh_stepfig_summary {
    uint64_t steps;
    double min, median, max;
};

void msh_stepfig_reset(struct msh_stepfig *s);
void msh_stepfig_note(struct msh_stepfig *s, double v);
void msh_stepfig_summarize(const struct msh_stepfig *s, struct msh_stepfig_summary *out);

#endif
