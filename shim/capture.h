/*
 * capture.h: which devices have a CUDA-graph capture in progress (shim/capture.c).
 *
 * While a stream of a device captures (in the default global mode), a device synchronize
 * invalidates the capture, and memory the capture may use must not be unmapped: the pools of that
 * device defer every synchronize, unmap, release and destroy until the last capture ends
 * (docs/pytorch.md "CUDA graphs", docs/pool.md "Captures"). One source says a capture is on:
 * memshim's hooks on every call that begins or ends a stream capture (the runtime's, the driver's,
 * through symbols, entry-point lookups and dlsym on a driver handle; hooks/). PyTorch's pool window
 * (begin_allocate_to_pool .. end_allocate_to_pool) is not one (issue 31): use_mem_pool opens it and
 * captures nothing, and torch.cuda.graph's own capture is seen at its stream's begin.
 */
#ifndef MSH_CAPTURE_H
#define MSH_CAPTURE_H

#include <stdbool.h>
#include <stdint.h>

/* Kinds of what keeps a capture open, so that tokens of different kinds never collide: stream
 * captures (the hooks), and TORCH, which nothing opens since issue 31 (kept for the table's tests). */
enum { MSH_CAPTURE_TORCH = 1, MSH_CAPTURE_STREAM = 2 };

/* The counter of captures in progress that device's pools read (struct msh_pool_params.capturing,
 * with __atomic_load_n): every capture of the process, since a capture in global mode prohibits
 * an unmap from any thread, on any device. NULL for an invalid device. */
const int *msh_capture_counter(int device);
/* Whether any capture is open in the process (inline: every tensor-mode allocation asks). */
extern int msh_capture_total;
static inline bool msh_capture_any(void)
{
    return __atomic_load_n(&msh_capture_total, __ATOMIC_ACQUIRE) > 0;
}
/* Captures in progress on the device now. */
int msh_capture_active(int device);
/* A capture opens (kind, token) on device / closes. Opening the same (kind, token) twice needs
 * two closes. Closing the last capture of the process runs what every pool deferred (on the
 * calling thread, which is never inside a pool). A close that matches nothing is ignored. */
void msh_capture_open(int device, int kind, uint64_t token);
void msh_capture_close(int kind, uint64_t token);
/* Run the deferred work of device's pools now when nothing captures in the process (a safe
 * point); returns whether it ran. */
bool msh_capture_settle(int device);

#endif
