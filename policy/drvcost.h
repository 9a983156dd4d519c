/*
 * drvcost.h: the driver calls an allocator makes, by kind, and what they cost (issue 10).
 *
 * The pool counts every call it makes to its device backend by kind (struct msh_pool_stats
 * drv_calls/drv_bytes); the replay's PyTorch models count the calls PyTorch's allocator would
 * make. A cost table turns counts into modelled seconds, so allocators can be compared on the
 * driver work a real GPU would pay, not only on bytes. The default table and where each figure
 * comes from are in docs/benchmarks.md; `memshim-replay --driver-costs FILE` replaces it. Nothing
 * here calls the driver.
 */
#ifndef MSH_DRVCOST_H
#define MSH_DRVCOST_H

#include <stddef.h>
#include <stdint.h>

/* One kind per driver call an allocator pays for. MALLOC/FREE are cudaMalloc/cudaFree (PyTorch's
 * native allocator); the others are the VMM and stream calls memshim's pool (and PyTorch's
 * expandable segments) make. RESERVE/UNRESERVE: cuMemAddressReserve/Free. */
#define MSH_DRV_CALLS(X)                                                                           \
    X(CREATE, "create")                                                                            \
    X(RELEASE, "release")                                                                          \
    X(MAP, "map")                                                                                  \
    X(UNMAP, "unmap")                                                                              \
    X(SET_ACCESS, "set_access")                                                                    \
    X(EVENT_RECORD, "event_record")                                                                \
    X(STREAM_WAIT, "stream_wait")                                                                  \
    X(SYNCHRONIZE, "synchronize")                                                                  \
    X(MALLOC, "malloc")                                                                            \
    X(FREE, "free")                                                                                \
    X(RESERVE, "reserve")                                                                          \
    X(UNRESERVE, "unreserve")
#define MSH_DRV_ENUM_(e, s) MSH_DRV_##e,
enum msh_drv_call { MSH_DRV_CALLS(MSH_DRV_ENUM_) MSH_DRV_NKINDS };
#undef MSH_DRV_ENUM_
/* "create", "release", ...: the key names of `driver_calls` in JSON. */
extern const char *const msh_drv_call_names[MSH_DRV_NKINDS];

#endif
