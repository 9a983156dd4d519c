/*
 * drvcost.h: the driver calls an allocator makes, by kind, and what they cost (issue 10).
 *
 * The pool counts every call it makes to its device backend by kind (struct msh_pool_stats
 * drv_calls/drv_bytes/drv_maps); the replay's PyTorch models count the calls PyTorch's allocator would
 * make. A cost table turns counts into modelled seconds, so allocators can be compared on the
 * driver work a real GPU would pay, not only on bytes. The default table and where each figure
 * comes from are in docs/benchmarks.md; `memshim-replay --driver-costs FILE` replaces it. Nothing
 * here calls the driver.
 */
#ifndef MSH_DRVCOST_H
#define MSH_DRVCOST_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* One kind per driver call an allocator pays for. MALLOC/FREE are cudaMalloc/cudaFree (PyTorch's
 * native allocator); the others are the VMM and stream calls memshim's pool (and PyTorch's
 * expandable segments) make. RESERVE/UNRESERVE: cuMemAddressReserve/Free. MEM_INFO: cuMemGetInfo,
 * which the pool asks before creating handles when the answer can change what it does (issue 31). */
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
    X(UNRESERVE, "unreserve")                                                                      \
    X(HOST_CREATE, "host_create")                                                                  \
    X(COPY_D2H, "copy_to_host")                                                                    \
    X(COPY_H2D, "copy_to_device")                                                                  \
    X(MEM_INFO, "mem_info")
#define MSH_DRV_ENUM_(e, s) MSH_DRV_##e,
enum msh_drv_call { MSH_DRV_CALLS(MSH_DRV_ENUM_) MSH_DRV_NKINDS };
#undef MSH_DRV_ENUM_
/* "create", "release", ...: the key names of `driver_calls` in JSON. */
extern const char *const msh_drv_call_names[MSH_DRV_NKINDS];

/* ---- the cost table (policy/drvcost.c) ---------------------------------------------------------
 * Each kind costs a fixed time per call, plus a time per MiB the call covers (the drv_bytes
 * counters), plus a time per mapping it covers (the drv_maps counters): cuMemSetAccess over a
 * range of k mappings costs about k times one mapping's grant on an H200, so a call is not the
 * unit there. Every other call covers one mapping (its per-mapping term is 0 in the defaults).
 * Defaults and their sources: docs/benchmarks.md, "Driver cost table". */
struct msh_drvcost {
    double per_call_s[MSH_DRV_NKINDS];    /* seconds per call */
    double per_mib_s[MSH_DRV_NKINDS];     /* seconds per MiB the call covers */
    double per_mapping_s[MSH_DRV_NKINDS]; /* seconds per mapping the call covers */
};
/* The built-in table (fitted to the H200's measured VMM calls; see docs/benchmarks.md). */
const struct msh_drvcost *msh_drvcost_default(void);
/* Kind by name ("create", "set_access"...): 0 and *k, or EINVAL. */
int msh_drvcost_kind(const char *name, enum msh_drv_call *k);
/* Parse a cost file held in memory. Format, one entry per line ('#' starts a comment):
 *     KIND  PER_CALL  [PER_MIB  [PER_MAPPING]]
 * KIND is a driver_calls key (create, map, set_access...); the times are non-negative numbers in
 * seconds, or with a unit suffix s, ms, us or ns (193us, 0.5ms, 2e-6). The table starts from the
 * defaults; a line replaces its kind's row (PER_MIB and PER_MAPPING default to 0). Each kind at
 * most once; at least one entry. `name` is only used in messages ("FILE:LINE: reason"). Returns 0, or EINVAL
 * with the first problem in err (out is then unchanged). */
int msh_drvcost_parse(const char *text, size_t len, const char *name, struct msh_drvcost *out, char *err,
                      size_t errlen);
/* msh_drvcost_parse() of a file (at most 1 MiB). Returns 0, EINVAL (bad content), or the errno of
 * opening/reading it, with the reason in err. */
int msh_drvcost_load(const char *path, struct msh_drvcost *out, char *err, size_t errlen);
/* The link spill copies cross (copy_to_host, copy_to_device per MiB): PCIe Gen5 x16 (the default
 * table's) or Grace Hopper's NVLink-C2C. */
enum { MSH_LINK_PCIE5 = 0, MSH_LINK_C2C = 1 };
void msh_drvcost_link(struct msh_drvcost *t, int link);
/* Modelled seconds of a set of counts: sum over kinds of calls*per_call + bytes/MiB*per_mib +
 * mappings*per_mapping. bytes NULL: no per-MiB terms; maps NULL: one mapping per call. */
double msh_drvcost_seconds(const struct msh_drvcost *c, const uint64_t calls[MSH_DRV_NKINDS],
                           const uint64_t bytes[MSH_DRV_NKINDS], const uint64_t maps[MSH_DRV_NKINDS]);
/* Modelled seconds of one call of kind k covering `mib` MiB in `maps` mappings. */
double msh_drvcost_call(const struct msh_drvcost *c, enum msh_drv_call k, double mib, double maps);
/* The table in the file format above, one line per kind (what --driver-costs reads back). */
void msh_drvcost_write(FILE *f, const struct msh_drvcost *c);
/* The table as one JSON object keyed by the driver function each kind stands for
 * ({"cuMemCreate": {"kind": "create", "per_call_us": .., "per_mib_us": .., "per_mapping_us": ..},
 * ...}; `memshim-replay --print-driver-costs`). */
void msh_drvcost_json(FILE *f, const struct msh_drvcost *c);
/* The driver function a kind stands for ("cuMemCreate"; host_create: "cuMemCreate (host memory)"). */
const char *msh_drvcost_function(enum msh_drv_call k);

#endif
