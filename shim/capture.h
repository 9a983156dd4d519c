/*
 * capture.h: which devices have a CUDA-graph capture in progress (shim/capture.c).
 *
 * While a stream of a device captures (in the default global mode), a device synchronize
 * invalidates the capture, and memory the capture may use must not be unmapped: the pools of that
 * device defer every synchronize, unmap, release and destroy until the last capture ends
 * (docs/pytorch.md "CUDA graphs", docs/pool.md "Captures"). Two sources say a capture is on: the
 * window PyTorch opens with begin_allocate_to_pool (called before cudaStreamBeginCapture) and
 * closes with end_allocate_to_pool (after cudaStreamEndCapture), and memshim's hooks on the
 * runtime's and the driver's stream-capture calls, which also see captures PyTorch does not make.
 */
#ifndef MSH_CAPTURE_H
#define MSH_CAPTURE_H

#include <stdbool.h>
#include <stdint.h>

/* Kinds of what keeps a capture open, so that a stream handle and a pool id never collide. */
enum { MSH_CAPTURE_TORCH = 1, MSH_CAPTURE_STREAM = 2 };

/* The counter of captures in progress that device's pools read (struct msh_pool_params.capturing,
 * with __atomic_load_n): every capture of the process, since a capture in global mode prohibits
 * an unmap from any thread, on any device. NULL for an invalid device. */
const int *msh_capture_counter(int device);
/* Whether any capture is open in the process. */
bool msh_capture_any(void);
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
