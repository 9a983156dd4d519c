/*
 * devtime.h: memshim-replay --device, every call the pool makes to the real driver timed on its way
 * (a wrapper backend between the pool and the CUDA backend), and the cost table fitted to one-page
 * and ten-page handles timed directly (docs/replay.md "--device"). Used by main.c only.
 */
#ifndef MSH_REPLAY_DEVTIME_H
#define MSH_REPLAY_DEVTIME_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "drvcost.h"

#define TIMING_MAX_SAMPLES (1u << 20)
struct dev_timing {
    struct msh_device outer;
    struct msh_device *inner;
    struct { double *v; size_t n, cap; uint64_t calls; } k[MSH_DRV_NKINDS];
};
    /* (the wrapper: .outer is handed to the pool, .inner is the real backend) */

/* what the pool is handed: every call timed into dev_timing_now's samples */
extern const struct msh_device_ops timed_ops;
extern struct dev_timing *dev_timing_now; /* the current trace's timings, or NULL */
void timing_reset(struct dev_timing *tm);
/* ,"driver_timing":{...} and the text lines, for the kinds the pool called */
void json_timing(struct dev_timing *tm);
void text_timing(struct dev_timing *tm);

/* --device calibration: each VMM call on one handle of one page and of ten pages, and the
 * per-call/per-MiB split that fits the two medians; cuMemSetAccess over 8 one-page mappings for
 * its per-mapping term */
#define CALIB_REPS 16
struct calib {
    bool ok;
    size_t gran;
    double med[2][MSH_DRV_NKINDS]; /* [one page, ten pages] */
    double access8;                /* one cuMemSetAccess over 8 one-page mappings (median) */
    struct msh_drvcost fit;
};
void calibrate(int ordinal, const struct msh_drvcost *base, struct calib *c);
void json_calib(const struct calib *c);
#endif
