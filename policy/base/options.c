/*
 * options.c: the one table of MEMSHIM_* options, their parsers, and everything generated from
 * the table (the parsed struct msh_config, the effective-config dump and iterator, and
 * docs/configuration.md through memshim-options --markdown).
 *
 * A new option is one row in `opts` plus its field in struct msh_config: its name, type,
 * default (written in the option's own grammar and parsed by the same parser as user input),
 * allowed values, unit and help all live in that row, so the docs and the warnings cannot
 * disagree with the code. A bad value must never stop the job: it gives one warning naming the
 * variable, the value and what is allowed, and the next source (MEMSHIM_CONF, then the default)
 * is used; only MEMSHIM_STRICT=1 turns problems into an abort, after every option was read.
 * Parsing never allocates (fixed static buffers under one mutex) and never reads the process
 * environment except in msh_config_load().
 */
#include "msh.h"

#include <ctype.h>
#include <locale.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

/* ---- the table ------------------------------------------------------------------------------ */

enum opt_type {
    T_ENUM,     /* int: one of opt.vals */
    T_LIMIT,    /* a size (limit_bytes) or a fraction (limit_fraction) */
    T_SIZE,     /* uint64_t bytes */
    T_FRACTION, /* double 0..1 */
    T_BOOL,     /* bool */
    T_SECONDS,  /* double seconds */
    T_COUNT,    /* uint64_t whole number */
    T_SIGNAL,   /* int signal number */
    T_PATH,     /* char[4096]; read with secure_getenv */
    T_CONF,     /* MEMSHIM_CONF itself */
};

struct enum_val {
    const char *name;
    int value;
    const char *help;
};

struct opt {
    const char *name;
    enum opt_type type;
    const char *def;      /* default, in this option's grammar ("" for an empty path) */
    const char *def_note; /* what the default means, or NULL */
    const char *allowed;  /* allowed values or range (docs and warnings); NULL: from vals */
    const char *unit;
    const char *help;
    size_t off, off2;            /* fields in struct msh_config (off2: T_LIMIT's fraction) */
    uint64_t min, max;           /* T_SIZE / T_COUNT range */
    const struct enum_val *vals; /* T_ENUM, terminated by a NULL name */
    const char *vals_intro;      /* T_ENUM: sentence above the per-value list in the docs */
};

static const struct enum_val mode_vals[] = {
    {"auto", MSH_MODE_AUTO,
     "In a Python process, memshim's start-up hook makes memshim PyTorch's allocator at PyTorch's "
     "first CUDA use (`tensor`), unless the program chose an allocator or allocator settings "
     "itself, PyTorch's allocator settings (`PYTORCH_ALLOC_CONF`, or the older "
     "`PYTORCH_CUDA_ALLOC_CONF`, whichever PyTorch reads) tune its own allocator, or the C++ glue "
     "is missing (then `segment`, said once at info level; docs/pytorch.md). Settings with only "
     "`per_process_memory_fraction` (memshim's limit in tensor mode) and `pinned_*` keys do not "
     "keep it out. Elsewhere as `segment`."},
    {"tensor", MSH_MODE_TENSOR,
     "As `auto`, but the switch to memshim's allocator also overrides PyTorch's allocator "
     "settings (their `per_process_memory_fraction` still becomes memshim's limit), and a switch "
     "that cannot happen is a warning. `torch.cuda.memory_stats()` and friends answer from "
     "memshim's counters. The interposed calls are served as in `segment`."},
    {"segment", MSH_MODE_SEGMENT,
     "PyTorch keeps its caching allocator; memshim serves the segments it asks for from the "
     "pool, accounts them, enforces the limit and runs the policies."},
    {"off", MSH_MODE_OFF,
     "Exact pass-through: every call goes straight to CUDA, as if memshim were not loaded."},
    {NULL, 0, NULL},
};
static const struct enum_val empty_cache_vals[] = {
    {"never", MSH_EC_NEVER, "Physical memory the pool holds is never given back to the driver."},
    {"oom", MSH_EC_OOM,
     "Free physical memory goes back to the driver only as a step of the OOM rescue chain, "
     "before an allocation would fail."},
    {"epoch", MSH_EC_EPOCH, "At every epoch boundary (see `MEMSHIM_EPOCH`)."},
    {"threshold", MSH_EC_THRESHOLD,
     "Reserved-but-free memory above `MEMSHIM_EMPTY_CACHE_THRESHOLD` once it has not been reused for 1 s."},
    {"idle", MSH_EC_IDLE,
     "After `MEMSHIM_EMPTY_CACHE_IDLE` seconds without an allocation."},
    {NULL, 0, NULL},
};
static const struct enum_val spill_vals[] = {
    {"off", MSH_SPILL_OFF, "A request the device cannot serve fails with PyTorch's out-of-memory error."},
    {"host", MSH_SPILL_HOST,
     "When the rescue chain cannot serve a request, the physical backing of cold pages (touched only "
     "by blocks allocated before the latest optimizer step or epoch, least recently allocated first) "
     "moves to host memory mapped at the same addresses: kernels still reach it, over PCIe or "
     "NVLink-C2C, slower; it comes back at a step boundary once the device has room. Needs the "
     "driver's host memory through VMM (CUDA 12.2+ on Linux); without it, one warning and `off`."},
    {NULL, 0, NULL},
};
static const struct enum_val gc_vals[] = {
    {"never", MSH_GC_NEVER, "memshim never runs Python's garbage collector."},
    {"oom", MSH_GC_OOM, "`gc.collect()` runs as a step of the OOM rescue chain."},
    {"epoch", MSH_GC_EPOCH, "`gc.collect()` runs at every epoch boundary."},
    {"threshold", MSH_GC_THRESHOLD,
     "`gc.collect()` runs when the memory in use exceeds `MEMSHIM_GC_THRESHOLD` of the limit "
     "(of the device's memory when no limit is set)."},
    {NULL, 0, NULL},
};
static const struct enum_val epoch_vals[] = {
    {"auto", MSH_EPOCH_AUTO,
     "`steps` when `MEMSHIM_EPOCH_STEPS` is set, else `seconds` when `MEMSHIM_EPOCH_SECONDS` is "
     "set, else, in a Python process, epochs are detected: the HF Trainer's or Lightning's own "
     "epochs, else one pass over a `DataLoader` with at least one optimizer step "
     "(docs/pytorch.md); elsewhere `manual`. `memshim_epoch()` calls always close an epoch."},
    {"steps", MSH_EPOCH_STEPS,
     "An epoch closes every `MEMSHIM_EPOCH_STEPS` optimizer steps (`memshim_step()` calls, "
     "which the Python integration makes after each `optimizer.step()`)."},
    {"seconds", MSH_EPOCH_SECONDS, "An epoch closes every `MEMSHIM_EPOCH_SECONDS` seconds."},
    {"signal", MSH_EPOCH_SIGNAL,
     "An epoch closes each time the process receives `MEMSHIM_EPOCH_SIGNAL` "
     "(for example `kill -USR2 <pid>`)."},
    {"manual", MSH_EPOCH_MANUAL, "Only the program's own `memshim_epoch()` calls close an epoch."},
    {NULL, 0, NULL},
};
static const struct enum_val report_fmt_vals[] = {
    {"json", MSH_REPORT_JSON, "Compact JSON, one object per file."},
    {"json-pretty", MSH_REPORT_JSON_PRETTY, "Indented JSON: easier to read, larger."},
    {NULL, 0, NULL},
};
static const struct enum_val sites_vals[] = {
    {"off", MSH_SITES_OFF, "No allocation sites: reports carry `sites: []` and a `sites_note`."},
    {"held", MSH_SITES_HELD,
     "Read the Python stack only when the allocating thread already holds the GIL (Python code "
     "calling `memshim_malloc` directly). PyTorch's operators release the GIL before they "
     "allocate, so under PyTorch most allocations then count as `<python> unattributed`."},
    {"frames", MSH_SITES_FRAMES,
     "Also read the Python frames of a thread that released the GIL inside a PyTorch operator, "
     "without taking the GIL: only that thread changes its own frames, and it is inside the "
     "operator (the care a sampling profiler takes; docs/reports.md). CPython 3.11 only, checked "
     "against the interpreter's own frame API when memshim's Python package starts; on other "
     "versions, or before that check, as `held`. A thread whose stack holds no Python frame "
     "(autograd's device threads) counts as the site `<backward>`. No allocation waits for the "
     "GIL."},
    {"acquire", MSH_SITES_ACQUIRE,
     "Re-take the GIL on a Python thread that released it inside a PyTorch operator, as "
     "PyTorch's own `_record_memory_history()` does (about 150 ns when the GIL is free, up to the "
     "interpreter's switch interval, 5 ms, when another thread runs Python). When taking it waits "
     "more than 20 us twice in a row, memshim stops re-taking it for one second. A thread found "
     "with no Python frame (autograd's device threads hold a thread state for life) never takes "
     "it again: its allocations count as the site `<backward>`."},
    {NULL, 0, NULL},
};
static const struct enum_val log_vals[] = {
    {"error", MSH_LOG_ERROR, "Only errors."},
    {"warn", MSH_LOG_WARN, "Errors and warnings (bad settings, fallbacks, OOM diagnoses)."},
    {"info", MSH_LOG_INFO,
     "Also every setting that is not at its default (`MEMSHIM_LIMIT set by environment to "
     "40G`, like `NCCL_DEBUG=INFO`), what the policies do, and at exit the three largest costs of "
     "memshim's own driver calls (the report's `memshim_overhead`)."},
    {"debug", MSH_LOG_DEBUG, "Also per-event detail for debugging memshim itself; verbose."},
    {NULL, 0, NULL},
};

enum {
    O_MODE, O_LIMIT, O_EMPTY_CACHE, O_EMPTY_CACHE_THRESHOLD, O_EMPTY_CACHE_IDLE, O_GC,
    O_GC_THRESHOLD, O_DEFRAG, O_FRONT, O_SPILL, O_SPILL_MAX, O_SMALL_MAX, O_EPOCH, O_EPOCH_STEPS, O_EPOCH_SECONDS,
    O_EPOCH_SIGNAL, O_EPOCH_INTERVAL, O_CATCH_SIGNALS, O_REPORT_DIR, O_REPORT_FORMAT, O_LATENCY_SAMPLE, O_TRACE_FILE, O_SITES,
    O_SITES_SAMPLE, O_SNAPSHOT, O_SNAPSHOT_EVENTS, O_LOG, O_LOG_FILE, O_TRAINER_METRICS, O_STRICT, O_CONF, O_COUNT
};

#define F(field) offsetof(struct msh_config, field)
static const struct opt opts[O_COUNT] = {
    [O_MODE] = {"MEMSHIM_MODE", T_ENUM, "auto", NULL, NULL, "-",
                "What memshim intercepts; `off` is an exact pass-through.", F(mode), 0, 0, 0,
                mode_vals, "Which level memshim works at (see DESIGN.md section 3)."},
    [O_LIMIT] = {"MEMSHIM_LIMIT", T_LIMIT, "0", "no limit",
                 "bytes like 40G or a fraction 0..1", "bytes or fraction",
                 "Most memory the job may hold on each device. A value of at most 1 written with "
                 "a dot, or exactly `1`, is a fraction of the device's memory (`0.9`); anything "
                 "else is a size (`40G`, `512MiB`, `1073741824`). `0`, `1`, or any size at or above "
                 "the device's memory: no limit (the device is the cap). In tensor mode "
                 "`set_per_process_memory_fraction` and `per_process_memory_fraction` in PyTorch's "
                 "allocator settings set a smaller one; `cudaMemGetInfo` reports whichever is in "
                 "force.",
                 F(limit_bytes), F(limit_fraction), 0, UINT64_MAX, NULL, NULL},
    [O_EMPTY_CACHE] = {"MEMSHIM_EMPTY_CACHE", T_ENUM, "oom", NULL, NULL, "-",
                       "When unused physical memory goes back to the driver.", F(empty_cache), 0,
                       0, 0, empty_cache_vals,
                       "When memshim returns wholly free physical pages to the driver (what "
                       "`torch.cuda.empty_cache()` does by hand). Except under `never`, in segment "
                       "mode a `cudaFree` of a pool block (PyTorch releasing a segment) also gives "
                       "that block's pages that no live block touches back at once."},
    [O_EMPTY_CACHE_THRESHOLD] = {"MEMSHIM_EMPTY_CACHE_THRESHOLD", T_SIZE, "0", NULL,
                                 "a size, 0 or more", "bytes",
                                 "With `MEMSHIM_EMPTY_CACHE=threshold`: reserved-but-free bytes "
                                 "above which free pages are released, once unused for 1 s (a loop "
                                 "that reuses them keeps them).",
                                 F(empty_cache_threshold), 0, 0, UINT64_MAX, NULL, NULL},
    [O_EMPTY_CACHE_IDLE] = {"MEMSHIM_EMPTY_CACHE_IDLE", T_SECONDS, "10", NULL,
                            "seconds like 10, 2.5s, 500ms, 5m or 1h", "seconds",
                            "With `MEMSHIM_EMPTY_CACHE=idle`: time without an allocation after "
                            "which free pages are released.",
                            F(empty_cache_idle_s), 0, 0, 0, NULL, NULL},
    [O_GC] = {"MEMSHIM_GC", T_ENUM, "oom", NULL, NULL, "-",
              "When memshim runs Python's `gc.collect()` to free tensors held by reference "
              "cycles.",
              F(gc), 0, 0, 0, gc_vals,
              "When memshim runs a garbage collection: the callback registered with "
              "`memshim_set_gc_callback()`, else, in a CPython process, `gc.collect()` itself "
              "(`PyGC_Collect`, which honours `gc.disable()`). Either one runs only from "
              "`memshim_malloc` or an epoch boundary, never inside the `cudaMalloc` hook where "
              "PyTorch's own allocator is mid-call, and in a CPython process only on a thread that "
              "holds the GIL (autograd's worker threads do not: DESIGN.md section 2). Skips are "
              "counted in the reports (`gc_skipped_no_gil`). `threshold` runs at most once a "
              "second."},
    [O_GC_THRESHOLD] = {"MEMSHIM_GC_THRESHOLD", T_FRACTION, "0.9", NULL, "a fraction 0..1",
                        "fraction",
                        "With `MEMSHIM_GC=threshold`: fraction of the limit (of device memory "
                        "when there is no limit) in use that triggers a collection.",
                        F(gc_threshold), 0, 0, 0, NULL, NULL},
    [O_DEFRAG] = {"MEMSHIM_DEFRAG", T_BOOL, "1", NULL, "1/0, true/false, yes/no, on/off", "-",
                  "Under memory pressure, reclaim wholly free pages from free blocks and remap "
                  "them where a new block needs them.",
                  F(defrag), 0, 0, 0, NULL, NULL},
    [O_FRONT] = {"MEMSHIM_FRONT", T_BOOL, "1", NULL, "1/0, true/false, yes/no, on/off", "-",
                 "The allocation fast path (docs/pool.md \"The front end\"): a block freed on the "
                 "stream it was used on goes into a bin of its (stream, size), and the next request "
                 "of that size on that stream gets it back with no search, no page work and no "
                 "event. Binned bytes count as reserved, never as allocated; the bins are emptied "
                 "before any driver work they could spare, first when a request does not fit, on "
                 "empty-cache and, for sizes that stopped recurring, at step marks. Under a limit "
                 "they wait for two step marks (PyTorch's optimizer steps, `memshim.step()`) with the "
                 "pool at most 31/32 of the limit, and stay empty once the pool had to reclaim at the "
                 "limit (there the learned step places every block). `0`: every "
                 "allocation takes the pool's general path.",
                 F(front), 0, 0, 0, NULL, NULL},
    [O_SPILL] = {"MEMSHIM_SPILL", T_ENUM, "off", NULL, NULL, "-",
                 "Survive a request the device cannot serve by moving cold pages to host memory "
                 "behind the same addresses (opt-in; docs/pool.md \"Spill\").",
                 F(spill), 0, 0, 0, spill_vals,
                 "What happens when even the rescue chain cannot serve a request under the limit or "
                 "the device's capacity. Only the main pool spills (never a CUDA-graph pool), never "
                 "during a capture, and only whole pages that no block of the current step touches. "
                 "The reports' `spill` section and `memshim-report` say what it cost. In segment "
                 "mode, `throw_on_cudamalloc_oom:True` in PyTorch's allocator settings makes PyTorch "
                 "refuse a segment past its memory fraction before asking memshim: a warning says "
                 "so."},
    [O_SPILL_MAX] = {"MEMSHIM_SPILL_MAX", T_LIMIT, "0.5", NULL,
                     "bytes like 64G or a fraction 0..1 of host RAM", "bytes or fraction",
                     "With `MEMSHIM_SPILL=host`: most host memory spilled pages may take. A value of "
                     "at most 1 written with a dot, or exactly `1`, is a fraction of the host's RAM "
                     "(`0.5`, the default); anything else a size (`64G`); `0`: no cap but what the "
                     "host gives. Past it, the request fails with PyTorch's out-of-memory error, "
                     "whose message says what was spilled.",
                     F(spill_max_bytes), F(spill_max_fraction), 0, UINT64_MAX, NULL, NULL},
    [O_SMALL_MAX] = {"MEMSHIM_SMALL_MAX", T_SIZE, "1MiB", NULL, "a size from 0 to 64MiB",
                     "bytes",
                     "Requests up to this size are packed together into the small-block "
                     "region; `0` turns packing off.",
                     F(small_max), 0, 0, 64 * MSH_MiB, NULL, NULL},
    [O_EPOCH] = {"MEMSHIM_EPOCH", T_ENUM, "auto", NULL, NULL, "-",
                 "Where epoch boundaries (one report each) come from.", F(epoch_src), 0, 0, 0,
                 epoch_vals,
                 "Where epoch boundaries come from. Each epoch ends with a report when "
                 "`MEMSHIM_REPORT_DIR` is set, and the `epoch` policies act there."},
    [O_EPOCH_STEPS] = {"MEMSHIM_EPOCH_STEPS", T_COUNT, "0", "not set",
                       "a whole number from 1 to 1000000000000", "optimizer steps",
                       "With `MEMSHIM_EPOCH=steps`: optimizer steps per epoch.", F(epoch_steps),
                       0, 1, 1000000000000ull, NULL, NULL},
    [O_EPOCH_SECONDS] = {"MEMSHIM_EPOCH_SECONDS", T_SECONDS, "0", "not set",
                         "seconds like 10, 2.5s, 500ms, 5m or 1h", "seconds",
                         "With `MEMSHIM_EPOCH=seconds`: length of an epoch.", F(epoch_seconds),
                         0, 0, 0, NULL, NULL},
    [O_EPOCH_SIGNAL] = {"MEMSHIM_EPOCH_SIGNAL", T_SIGNAL, "SIGUSR2", NULL,
                        "a signal name like SIGUSR2 or USR2, or a number 1..64 (not KILL, STOP or a fault signal such as SEGV)",
                        "-", "With `MEMSHIM_EPOCH=signal`: the signal that closes an epoch.",
                        F(epoch_signal), 0, 0, 0, NULL, NULL},
    [O_EPOCH_INTERVAL] = {"MEMSHIM_EPOCH_INTERVAL", T_COUNT, "1000", NULL,
                          "a whole number from 0 to 1000000000000", "optimizer steps",
                          "With `MEMSHIM_EPOCH=auto` in a Python process: when this many optimizer "
                          "steps pass and no epoch closed (a loop with no `DataLoader` pass that "
                          "ends: nanoGPT-style `get_batch` loops, an endless sampler, LLM "
                          "pretraining), memshim writes an interval report (reason `interval`) and "
                          "keeps doing so every this many steps, and says so once (warn level). A "
                          "`DataLoader` pass of known length of at most 16 intervals, and the "
                          "frameworks' epochs, are waited for instead. `0`: no interval reports.",
                          F(epoch_interval), 0, 0, 1000000000000ull, NULL, NULL},
    [O_CATCH_SIGNALS] = {"MEMSHIM_CATCH_SIGNALS", T_BOOL, "1", NULL, "1/0, true/false, yes/no, on/off",
                         "-",
                         "When SIGTERM (torchrun, Slurm, Kubernetes), SIGINT or SIGHUP ends the "
                         "job, write the epoch in progress (reason `interrupted`), the summary and "
                         "`MEMSHIM_SNAPSHOT` first, then end it with that signal as it would have "
                         "ended. Only for signals the program left at their default action; a "
                         "handler the program installed is run, never replaced. Python's end after "
                         "an uncaught `KeyboardInterrupt` is covered too (docs/reports.md). `0`: "
                         "memshim installs no signal handler (except `MEMSHIM_EPOCH=signal`'s).",
                         F(catch_signals), 0, 0, 0, NULL, NULL},
    [O_REPORT_DIR] = {"MEMSHIM_REPORT_DIR", T_PATH, "", "no reports",
                      "a directory path (%p: pid, %h: host name)", "-",
                      "Directory for the JSON reports (one per epoch, an OOM report, a final "
                      "summary). Empty: no reports.",
                      F(report_dir), 0, 0, 0, NULL, NULL},
    [O_REPORT_FORMAT] = {"MEMSHIM_REPORT_FORMAT", T_ENUM, "json", NULL, NULL, "-",
                         "Format of the report files.", F(report_format), 0, 0, 0,
                         report_fmt_vals, "How report files are written."},
    [O_LATENCY_SAMPLE] = {"MEMSHIM_LATENCY_SAMPLE", T_COUNT, "64", NULL,
                           "a whole number from 1 to 65536", "calls",
                           "With reports on: after each thread's first 4096 pool calls (all "
                           "timed), time one pool alloc/free in this many (on average, at random) "
                           "for the reports' `latency` and `alloc_mean_ns`; each timed call counts "
                           "for this many. A timed call reads the CPU's counter twice (a few ns); in "
                           "tensor mode from memshim's entry point to its return. `1`: time every "
                           "call. Without reports nothing is timed.",
                           F(latency_sample), 0, 1, 65536, NULL, NULL},
    [O_TRACE_FILE] = {"MEMSHIM_TRACE_FILE", T_PATH, "", "no trace",
                      "a file path (%p: pid, %h: host name)", "-",
                      "Write every allocation and free to this file in memshim's trace format "
                      "(for `memshim-replay`). Empty: no trace.",
                      F(trace_file), 0, 0, 0, NULL, NULL},
    [O_SITES] = {"MEMSHIM_SITES", T_ENUM, "frames", NULL, NULL, "-",
                 "How memshim reads the Python call site of each tensor allocation (reports' "
                 "`sites`, the snapshot's `frames`).",
                 F(sites), 0, 0, 0, sites_vals,
                 "How memshim learns the Python call site of the blocks it places in tensor mode "
                 "(the first frame outside torch and memshim's own package; docs/reports.md). "
                 "Only used when reports or a snapshot are on, and only in a CPython process."},
    [O_SITES_SAMPLE] = {"MEMSHIM_SITES_SAMPLE", T_SIZE, "0", "every allocation exactly",
                        "a size, 0 or more", "bytes",
                        "Allocations of at least this size always get their exact site; smaller "
                        "ones are sampled (on average one per this many bytes, as a Poisson "
                        "process) and their live bytes and counts per site are unbiased "
                        "estimates. `0`: every allocation exactly (reading a stack whose frames "
                        "Python already holds costs tens of ns, about what sampling saves: "
                        "docs/benchmarks.md). While a snapshot history is recorded, every "
                        "allocation gets its site.",
                        F(sites_sample), 0, 0, UINT64_MAX, NULL, NULL},
    [O_SNAPSHOT] = {"MEMSHIM_SNAPSHOT", T_PATH, "", "no snapshot",
                    "a file path (%p: pid, %h: host name, %r: rank)", "-",
                    "Record the allocation history and write a PyTorch memory snapshot (the "
                    "pickle `torch.cuda.memory._dump_snapshot()` writes, for "
                    "`torch.cuda._memory_viz` and pytorch.org/memory_viz) to this file at exit, "
                    "and one beside it at each out-of-memory (`NAME-oomNNNN.pickle`, at most 16). "
                    "Without `%r`, the rank its launcher set (docs/reports.md, \"Who wrote a "
                    "report\") is added as `-rankR` before the extension; `%r` in a job with no rank is 0. Empty: no snapshot.",
                    F(snapshot), 0, 0, 0, NULL, NULL},
    [O_SNAPSHOT_EVENTS] = {"MEMSHIM_SNAPSHOT_EVENTS", T_COUNT, "100000", NULL,
                           "a whole number from 1 to 16777216", "events",
                           "Events (alloc, free, map, unmap, oom) the history ring keeps for the "
                           "snapshot's `device_traces`; older ones are dropped. Each thread that "
                           "allocates records into a ring of its own of this many entries (48 bytes "
                           "of host memory each, a free being one entry), committed as it fills. "
                           "PyTorch's own default "
                           "(`max_entries=sys.maxsize`) keeps everything; a bounded ring needs "
                           "a bound.",
                           F(snapshot_events), 0, 1, 16777216, NULL, NULL},
    [O_LOG] = {"MEMSHIM_LOG", T_ENUM, "warn", NULL, NULL, "-",
               "How much memshim logs. Read before every other option, so it applies to their "
               "warnings.",
               F(log_level), 0, 0, 0, log_vals,
               "How much memshim writes to its log (stderr, or `MEMSHIM_LOG_FILE`). Every line "
               "starts with `memshim[PID]: LEVEL: `; after 100 warnings, further warnings are "
               "suppressed."},
    [O_LOG_FILE] = {"MEMSHIM_LOG_FILE", T_PATH, "", "stderr",
                    "a file path (%p: pid, %h: host name)", "-",
                    "Append the log to this file instead of stderr (`%p`: pid, `%h`: host "
                    "name, `%%`: a percent sign). Opened as soon as it is read, so the warnings "
                    "about other options already go there; if it cannot be opened, one warning "
                    "and stderr.",
                    F(log_file), 0, 0, 0, NULL, NULL},
    [O_TRAINER_METRICS] = {"MEMSHIM_TRAINER_METRICS", T_BOOL, "1", NULL,
                           "1/0, true/false, yes/no, on/off", "-",
                           "When a Lightning `Trainer` with a logger (TensorBoard, W&B, MLflow, "
                           "CSV) or an HF `Trainer` runs, log memshim's figures at each epoch end "
                           "through the trainer's own logging under `memshim/` (peak allocated and "
                           "reserved bytes, fragmentation, OOMs and rescues, growth per epoch; "
                           "docs/pytorch.md). `0`: log nothing there.",
                           F(trainer_metrics), 0, 0, 0, NULL, NULL},
    [O_STRICT] = {"MEMSHIM_STRICT", T_BOOL, "0", NULL, "1/0, true/false, yes/no, on/off", "-",
                  "Abort the process, after reading and reporting every option, if any "
                  "`MEMSHIM_*` setting was invalid or unknown.",
                  F(strict), 0, 0, 0, NULL, NULL},
    [O_CONF] = {"MEMSHIM_CONF", T_CONF, "", NULL,
                "key:value pairs separated by commas", "-",
                "All options in one variable: `key:value,key:value`, keys are the names without "
                "`MEMSHIM_`, in any case (`limit:40G,empty_cache:epoch`). A variable set on its "
                "own wins over the same key here.",
                0, 0, 0, 0, NULL, NULL},
};
#undef F

/* ---- value parsers -------------------------------------------------------------------------- */

/* Internal result codes beyond the errno values the public parsers return. */
#define E_EMPTY (-1)   /* nothing but spaces */
#define E_NOCATCH (-2) /* a signal that cannot be caught */

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* The value without leading and trailing white space: [*b, *e). */
static void trim(const char *s, const char **b, const char **e)
{
    const char *p = s, *q = s + strlen(s);
    while (p < q && is_space(*p)) p++;
    while (q > p && is_space(q[-1])) q--;
    *b = p;
    *e = q;
}

static bool span_ieq(const char *b, const char *e, const char *word)
{
    size_t n = (size_t)(e - b);
    return strlen(word) == n && strncasecmp(b, word, n) == 0;
}

/* A plain decimal number (digits, optionally one dot and more digits; no sign, no exponent),
 * written without the locale: a PyTorch process may run under any LC_NUMERIC. Advances *pp. */
/* A decimal "123", "1.5", ".5": the syntax is checked here, the value comes from strtod_l in
 * the C locale, which rounds correctly (so what format_plain prints reads back exactly) and
 * ignores the host program's LC_NUMERIC. */
static int parse_decimal(const char **pp, const char *e, double *out)
{
    static locale_t c_locale;
    const char *p = *pp, *b = p;
    int digits = 0;
    while (p < e && isdigit((unsigned char)*p)) p++, digits++;
    if (p < e && *p == '.') {
        p++;
        while (p < e && isdigit((unsigned char)*p)) p++, digits++;
    }
    if (digits == 0) return EINVAL;
    char buf[128];
    if ((size_t)(p - b) >= sizeof buf) return EINVAL;
    memcpy(buf, b, (size_t)(p - b));
    buf[p - b] = 0;
    locale_t loc = __atomic_load_n(&c_locale, __ATOMIC_ACQUIRE);
    if (!loc) {
        locale_t fresh = newlocale(LC_ALL_MASK, "C", (locale_t)0);
        locale_t expect = (locale_t)0;
        if (fresh && !__atomic_compare_exchange_n(&c_locale, &expect, fresh, false, __ATOMIC_ACQ_REL,
                                                  __ATOMIC_ACQUIRE))
            freelocale(fresh); /* another thread won */
        loc = __atomic_load_n(&c_locale, __ATOMIC_ACQUIRE);
    }
    double v = loc ? strtod_l(buf, NULL, loc) : strtod(buf, NULL);
    if (!isfinite(v)) return EINVAL;
    *pp = p;
    *out = v;
    return 0;
}

static int parse_size_span(const char *b, const char *e, uint64_t *out)
{
    if (b == e) return E_EMPTY;
    const char *p = b;
    uint64_t ip = 0;
    bool overflow = false, dot = false;
    int digits = 0;
    while (p < e && isdigit((unsigned char)*p)) {
        unsigned d = (unsigned)(*p++ - '0');
        if (ip > (UINT64_MAX - d) / 10) overflow = true;
        else ip = ip * 10 + d;
        digits++;
    }
    uint64_t frac = 0, frac_den = 1;
    if (p < e && *p == '.') {
        dot = true;
        p++;
        while (p < e && isdigit((unsigned char)*p)) {
            if (frac_den <= 100000000000000000ull) /* 18 digits are plenty; ignore the rest */
                frac = frac * 10 + (uint64_t)(*p - '0'), frac_den *= 10;
            p++;
            digits++;
        }
    }
    if (digits == 0) return EINVAL;
    while (p < e && is_space(*p)) p++;
    unsigned shift = 0;
    if (p < e) {
        switch (toupper((unsigned char)*p)) {
        case 'K': shift = 10; p++; break;
        case 'M': shift = 20; p++; break;
        case 'G': shift = 30; p++; break;
        case 'T': shift = 40; p++; break;
        case 'B': break;
        default: return EINVAL;
        }
        if (shift && span_ieq(p, e, "iB")) p += 2;
        else if (p < e && toupper((unsigned char)*p) == 'B') p++;
        if (p != e) return EINVAL;
    }
    if (dot && shift == 0) return EINVAL; /* fractions of a byte mean nothing */
    if (overflow) return ERANGE;
    __extension__ typedef unsigned __int128 u128; /* 64 bits times 2^40 needs 104 */
    u128 total = ((u128)ip << shift) + (((u128)frac << shift) / frac_den);
    if (total > UINT64_MAX) return ERANGE;
    *out = (uint64_t)total;
    return 0;
}

static int parse_fraction_span(const char *b, const char *e, double *out)
{
    if (b == e) return E_EMPTY;
    double v;
    const char *p = b;
    if (parse_decimal(&p, e, &v) != 0 || p != e) return EINVAL;
    if (v > 1) return ERANGE;
    *out = v;
    return 0;
}

static int parse_bool_span(const char *b, const char *e, bool *out)
{
    if (b == e) return E_EMPTY;
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (span_ieq(b, e, yes[i])) return *out = true, 0;
        if (span_ieq(b, e, no[i])) return *out = false, 0;
    }
    return EINVAL;
}

static int parse_seconds_span(const char *b, const char *e, double *out)
{
    if (b == e) return E_EMPTY;
    double v;
    const char *p = b;
    if (parse_decimal(&p, e, &v) != 0) return EINVAL;
    while (p < e && is_space(*p)) p++;
    double mult;
    if (p == e || span_ieq(p, e, "s")) mult = 1;
    else if (span_ieq(p, e, "ms")) mult = 1e-3;
    else if (span_ieq(p, e, "m")) mult = 60;
    else if (span_ieq(p, e, "h")) mult = 3600;
    else return EINVAL;
    v *= mult;
    if (!isfinite(v)) return ERANGE;
    *out = v;
    return 0;
}

static int parse_count_span(const char *b, const char *e, uint64_t *out)
{
    if (b == e) return E_EMPTY;
    uint64_t v = 0;
    bool overflow = false;
    for (const char *p = b; p < e; p++) {
        if (!isdigit((unsigned char)*p)) return EINVAL;
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) overflow = true;
        else v = v * 10 + d;
    }
    if (overflow) return ERANGE;
    *out = v;
    return 0;
}

static int parse_signal_span(const char *b, const char *e, int *out)
{
    if (b == e) return E_EMPTY;
    int sig = 0;
    if (isdigit((unsigned char)*b)) {
        uint64_t v;
        int rc = parse_count_span(b, e, &v);
        if (rc) return rc;
        if (v < 1 || v > 64) return ERANGE;
        sig = (int)v;
    } else {
        if (e - b > 3 && strncasecmp(b, "SIG", 3) == 0) b += 3;
        for (int s = 1; s < 65 && !sig; s++) {
            const char *abbrev = sigabbrev_np(s);
            if (abbrev && span_ieq(b, e, abbrev)) sig = s;
        }
        if (!sig) return EINVAL;
    }
    if (sig == SIGKILL || sig == SIGSTOP) return E_NOCATCH;
    /* A fault signal must keep killing the process: catching it to close an epoch would loop on
     * the faulting instruction forever. */
    if (sig == SIGSEGV || sig == SIGBUS || sig == SIGFPE || sig == SIGILL || sig == SIGABRT ||
        sig == SIGTRAP || sig == SIGSYS)
        return E_NOCATCH;
    *out = sig;
    return 0;
}

/* Public forms: trim, parse, and map the internal codes to EINVAL. */
static int public_rc(int rc)
{
    return rc < 0 ? EINVAL : rc;
}
int msh_parse_size(const char *s, uint64_t *out)
{
    if (!s) return EINVAL;
    const char *b, *e;
    trim(s, &b, &e);
    return public_rc(parse_size_span(b, e, out));
}
int msh_parse_fraction(const char *s, double *out)
{
    if (!s) return EINVAL;
    const char *b, *e;
    trim(s, &b, &e);
    int rc = parse_fraction_span(b, e, out);
    return rc == ERANGE ? EINVAL : public_rc(rc);
}
int msh_parse_bool(const char *s, bool *out)
{
    if (!s) return EINVAL;
    const char *b, *e;
    trim(s, &b, &e);
    return public_rc(parse_bool_span(b, e, out));
}
int msh_parse_seconds(const char *s, double *out)
{
    if (!s) return EINVAL;
    const char *b, *e;
    trim(s, &b, &e);
    int rc = parse_seconds_span(b, e, out);
    return rc == ERANGE ? EINVAL : public_rc(rc);
}
int msh_parse_signal(const char *s, int *out)
{
    if (!s) return EINVAL;
    const char *b, *e;
    trim(s, &b, &e);
    return public_rc(parse_signal_span(b, e, out));
}

/* ---- one option's value --------------------------------------------------------------------- */

union val {
    int i;
    uint64_t u;
    double d;
    bool b;
    struct { uint64_t bytes; double frac; } lim;
    struct { const char *p; size_t n; } s;
};

static int parse_value(const struct opt *o, const char *text, union val *v)
{
    const char *b, *e;
    trim(text, &b, &e);
    int rc;
    switch (o->type) {
    case T_ENUM:
        if (b == e) return E_EMPTY;
        for (const struct enum_val *ev = o->vals; ev->name; ev++)
            if (span_ieq(b, e, ev->name)) return v->i = ev->value, 0;
        return EINVAL;
    case T_LIMIT: {
        if (b == e) return E_EMPTY;
        /* "0.9" or "1" is a fraction of the device; "1.5" is neither (a size needs a unit to
         * have decimals), "40G" and "1073741824" are sizes. */
        bool dot = memchr(b, '.', (size_t)(e - b)) != NULL;
        if (dot || span_ieq(b, e, "1")) {
            double f;
            if (parse_fraction_span(b, e, &f) == 0) {
                v->lim.bytes = 0;
                v->lim.frac = f;
                return 0;
            }
        }
        v->lim.frac = 0;
        return parse_size_span(b, e, &v->lim.bytes);
    }
    case T_SIZE:
        rc = parse_size_span(b, e, &v->u);
        if (rc == 0 && (v->u < o->min || v->u > o->max)) rc = ERANGE;
        return rc;
    case T_FRACTION:
        return parse_fraction_span(b, e, &v->d);
    case T_BOOL:
        return parse_bool_span(b, e, &v->b);
    case T_SECONDS:
        return parse_seconds_span(b, e, &v->d);
    case T_COUNT:
        rc = parse_count_span(b, e, &v->u);
        if (rc == 0 && (v->u < o->min || v->u > o->max)) rc = ERANGE;
        return rc;
    case T_SIGNAL:
        return parse_signal_span(b, e, &v->i);
    case T_PATH:
    case T_CONF:
        /* An empty path is valid: it means "none", the default. MEMSHIM_CONF's own length is
         * checked where it is split. */
        if (o->type == T_PATH && (size_t)(e - b) >= sizeof msh_cfg.report_dir)
            return ENAMETOOLONG;
        v->s.p = b;
        v->s.n = (size_t)(e - b);
        return 0;
    }
    return EINVAL;
}

static char conf_text[8192]; /* MEMSHIM_CONF as given (trimmed) */

static void store_value(const struct opt *o, const union val *v)
{
    char *base = (char *)&msh_cfg;
    switch (o->type) {
    case T_ENUM:
    case T_SIGNAL: memcpy(base + o->off, &v->i, sizeof(int)); break;
    case T_SIZE:
    case T_COUNT: memcpy(base + o->off, &v->u, sizeof(uint64_t)); break;
    case T_FRACTION:
    case T_SECONDS: memcpy(base + o->off, &v->d, sizeof(double)); break;
    case T_BOOL: memcpy(base + o->off, &v->b, sizeof(bool)); break;
    case T_LIMIT:
        memcpy(base + o->off, &v->lim.bytes, sizeof(uint64_t));
        memcpy(base + o->off2, &v->lim.frac, sizeof(double));
        break;
    case T_PATH:
        memcpy(base + o->off, v->s.p, v->s.n);
        base[o->off + v->s.n] = '\0';
        break;
    case T_CONF: {
        size_t n = v->s.n < sizeof conf_text ? v->s.n : sizeof conf_text - 1;
        memcpy(conf_text, v->s.p, n);
        conf_text[n] = '\0';
        break;
    }
    }
}

static void format_size(uint64_t v, char *buf, size_t len)
{
    static const char *const units[] = {"TiB", "GiB", "MiB", "KiB"};
    for (int i = 0; i < 4 && v; i++) {
        unsigned shift = 40 - 10 * (unsigned)i;
        if ((v & ((1ull << shift) - 1)) == 0) {
            snprintf(buf, len, "%llu%s", (unsigned long long)(v >> shift), units[i]);
            return;
        }
    }
    snprintf(buf, len, "%llu", (unsigned long long)v);
}

/* The effective value of option `o`, in the spelling the docs use. */

/* Numbers as the parser reads them back: plain decimals, never an exponent ("%g" would print
 * 3333333333 as 3.33333e+09, which the parser rightly refuses). */
static void format_plain(double d, char *buf, size_t len)
{
    snprintf(buf, len, "%.9f", d);
    char *dot = strchr(buf, '.');
    if (!dot) return;
    char *end = buf + strlen(buf) - 1;
    while (end > dot && *end == '0') *end-- = 0;
    if (end == dot) *end = 0;
}

static void format_value(const struct opt *o, char *buf, size_t len)
{
    const char *base = (const char *)&msh_cfg;
    int i;
    uint64_t u;
    double d;
    bool b;
    if (len == 0) return;
    switch (o->type) {
    case T_ENUM:
        memcpy(&i, base + o->off, sizeof i);
        for (const struct enum_val *ev = o->vals; ev->name; ev++)
            if (ev->value == i) {
                snprintf(buf, len, "%s", ev->name);
                return;
            }
        snprintf(buf, len, "%d", i);
        return;
    case T_LIMIT:
        memcpy(&d, base + o->off2, sizeof d);
        memcpy(&u, base + o->off, sizeof u);
        if (d > 0) format_plain(d, buf, len);
        else format_size(u, buf, len);
        return;
    case T_SIZE: memcpy(&u, base + o->off, sizeof u); format_size(u, buf, len); return;
    case T_COUNT:
        memcpy(&u, base + o->off, sizeof u);
        snprintf(buf, len, "%llu", (unsigned long long)u);
        return;
    case T_FRACTION:
    case T_SECONDS: memcpy(&d, base + o->off, sizeof d); format_plain(d, buf, len); return;
    case T_BOOL: memcpy(&b, base + o->off, sizeof b); snprintf(buf, len, "%d", b ? 1 : 0); return;
    case T_SIGNAL: {
        memcpy(&i, base + o->off, sizeof i);
        const char *abbrev = sigabbrev_np(i);
        if (abbrev) snprintf(buf, len, "SIG%s", abbrev);
        else snprintf(buf, len, "%d", i);
        return;
    }
    case T_PATH: snprintf(buf, len, "%s", base + o->off); return;
    case T_CONF: snprintf(buf, len, "%s", conf_text); return;
    }
}

/* ---- loading -------------------------------------------------------------------------------- */

struct msh_config msh_cfg;
void (*msh_config_abort_fn)(void) = abort;

enum src { SRC_DEFAULT, SRC_ENV, SRC_CONF };
static const char *const src_names[] = {"default", "environment", "MEMSHIM_CONF"};
static enum src opt_src[O_COUNT];
static pthread_mutex_t cfg_mu = PTHREAD_MUTEX_INITIALIZER;

#define CONF_MAX_ENTRIES 64
struct conf_entry {
    const char *key, *value; /* NUL-terminated pieces of conf_copy (key trimmed) */
    const char *raw;         /* the entry as the user wrote it (trimmed), for messages */
    int rawlen;
    int opt; /* index into opts, or -1 */
};
static char conf_copy[sizeof conf_text];
static struct conf_entry conf_entries[CONF_MAX_ENTRIES];
static int conf_n;

struct load_ctx {
    char *const *envp;
    bool real;   /* envp is the process environment: paths through secure_getenv */
    bool secure; /* secure-execution mode (setuid/setgid): paths are not taken from anywhere */
    int conf_for[O_COUNT]; /* the MEMSHIM_CONF entry that sets each option (last wins), or -1 */
    int problems;
    bool quiet; /* no info echo yet: the log file is not open */
};

static const char *env_lookup(char *const *envp, const char *name)
{
    size_t n = strlen(name);
    for (char *const *e = envp; e && *e; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

static const char *opt_env_value(struct load_ctx *c, int i)
{
    const char *v = env_lookup(c->envp, opts[i].name);
    if (v && c->real && opts[i].type == T_PATH && secure_getenv(opts[i].name) == NULL) {
        msh_warn("%s is ignored in a setuid/setgid program", opts[i].name);
        c->problems++;
        return NULL;
    }
    return v;
}

/* Every default goes through its option's parser; one outside the option's range (EPOCH_STEPS's
 * 0, "not set") leaves the zeroed field as it is. */
static void reset_defaults(void)
{
    memset(&msh_cfg, 0, sizeof msh_cfg);
    conf_text[0] = '\0';
    for (int i = 0; i < O_COUNT; i++) {
        union val v;
        if (parse_value(&opts[i], opts[i].def, &v) == 0) store_value(&opts[i], &v);
        opt_src[i] = SRC_DEFAULT;
    }
    __atomic_store_n(&msh_log_level, msh_cfg.log_level, __ATOMIC_RELAXED);
}

/* Levenshtein distance, case-insensitive, of the first 63 characters of each. */
static int edit_distance(const char *a, const char *b)
{
    int row[64], la = (int)strnlen(a, 63), lb = (int)strnlen(b, 63);
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int cost = toupper((unsigned char)a[i - 1]) != toupper((unsigned char)b[j - 1]);
            int best = diag + cost;
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* The option whose name (after `skip` characters: 8 drops "MEMSHIM_") is nearest to `s`. */
static int nearest_option(const char *s, size_t skip)
{
    int best = 0, best_d = INT_MAX;
    for (int i = 0; i < O_COUNT; i++) {
        int d = edit_distance(s, opts[i].name + skip);
        if (d < best_d) best = i, best_d = d;
    }
    return best;
}

static void lower_copy(char *dst, size_t len, const char *src)
{
    size_t i = 0;
    for (; src[i] && i + 1 < len; i++) dst[i] = (char)tolower((unsigned char)src[i]);
    dst[i] = '\0';
}

/* Split MEMSHIM_CONF into entries without any message (messages wait for MEMSHIM_LOG). Returns
 * false when it does not fit. */
static bool conf_split(const char *conf)
{
    conf_n = 0;
    if (!conf) return true;
    size_t n = strlen(conf);
    if (n >= sizeof conf_copy) return false;
    memcpy(conf_copy, conf, n + 1);
    char *p = conf_copy;
    while (*p) {
        char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        char *b = p, *e = end;
        p = *end ? end + 1 : end;
        while (b < e && is_space(*b)) b++;
        while (e > b && is_space(e[-1])) e--;
        if (b == e) continue; /* "a:1,,b:2" and a trailing comma are fine */
        if (conf_n == CONF_MAX_ENTRIES) return false;
        struct conf_entry *ce = &conf_entries[conf_n++];
        ce->raw = conf + (b - conf_copy);
        ce->rawlen = (int)(e - b);
        *e = '\0';
        ce->opt = -1;
        ce->key = b;
        ce->value = NULL;
        char *colon = strchr(b, ':');
        if (!colon) continue;
        *colon = '\0';
        ce->value = colon + 1;
        char *ke = colon;
        while (ke > b && is_space(ke[-1])) *--ke = '\0';
        for (int i = 0; i < O_COUNT; i++)
            if (i != O_CONF && strcasecmp(b, opts[i].name + 8) == 0) ce->opt = i;
    }
    return true;
}

/* A MEMSHIM_CONF entry for a message: at most 200 bytes of it, with "..." when cut. */
#define ENTRY_FMT "%.*s%s"
#define ENTRY(ce) \
    ((ce)->rawlen > 200 ? 200 : (ce)->rawlen), (ce)->raw, ((ce)->rawlen > 200 ? "..." : "")

/* Warnings for MEMSHIM_CONF entries that name no option. */
static void conf_check_entries(struct load_ctx *c)
{
    for (int k = 0; k < conf_n; k++) {
        const struct conf_entry *ce = &conf_entries[k];
        if (ce->opt >= 0) continue;
        c->problems++;
        if (!ce->value) {
            msh_warn("invalid MEMSHIM_CONF entry '" ENTRY_FMT "': expected key:value", ENTRY(ce));
        } else if (!ce->key[0]) {
            msh_warn("invalid MEMSHIM_CONF entry '" ENTRY_FMT "': the key is empty", ENTRY(ce));
        } else if (strcasecmp(ce->key, "conf") == 0) {
            msh_warn("invalid MEMSHIM_CONF entry '" ENTRY_FMT "': MEMSHIM_CONF cannot contain "
                     "itself",
                     ENTRY(ce));
        } else {
            char sugg[64];
            lower_copy(sugg, sizeof sugg, opts[nearest_option(ce->key, 8)].name + 8);
            msh_warn("invalid MEMSHIM_CONF entry '" ENTRY_FMT "': unknown key '%.100s' (did you "
                     "mean '%s'?)",
                     ENTRY(ce), ce->key, sugg);
        }
    }
}

/* "is not a size (expected ...)" and the like, for a parse result `rc` of `text`. */
static void describe_error(const struct opt *o, int rc, const char *text, char *buf, size_t len)
{
    static const char *const nouns[] = {
        [T_ENUM] = "a valid value", [T_LIMIT] = "a size or fraction", [T_SIZE] = "a size",
        [T_FRACTION] = "a fraction", [T_BOOL] = "a boolean", [T_SECONDS] = "a duration",
        [T_COUNT] = "a whole number", [T_SIGNAL] = "a signal", [T_PATH] = "a path",
        [T_CONF] = "a list",
    };
    char allowed[256];
    if (o->type == T_ENUM) {
        size_t n = (size_t)snprintf(allowed, sizeof allowed, "one of");
        for (const struct enum_val *ev = o->vals; ev->name && n < sizeof allowed; ev++)
            n += (size_t)snprintf(allowed + n, sizeof allowed - n, "%s %s",
                                  ev == o->vals ? "" : ",", ev->name);
    } else {
        snprintf(allowed, sizeof allowed, "%s", o->allowed);
    }
    switch (rc) {
    case E_EMPTY: snprintf(buf, len, "is empty (expected %s)", allowed); break;
    case ERANGE: snprintf(buf, len, "is out of range (expected %s)", allowed); break;
    case E_NOCATCH:
        snprintf(buf, len, "is a signal that cannot be caught here (expected %s)", allowed);
        break;
    case ENAMETOOLONG:
        snprintf(buf, len, "is too long (%zu bytes; at most %zu)", strlen(text),
                 sizeof msh_cfg.report_dir - 1);
        break;
    default: snprintf(buf, len, "is not %s (expected %s)", nouns[o->type], allowed); break;
    }
}

/* A value for a message: at most 200 bytes of it, with "..." when cut. */
#define SHOW_FMT "%.200s%s"
#define SHOW(s) (s), (strlen(s) > 200 ? "..." : "")

static void describe_default(const struct opt *o, char *buf, size_t len)
{
    if (o->def_note && o->def[0]) snprintf(buf, len, "%s: %s", o->def, o->def_note);
    else if (o->def_note) snprintf(buf, len, "%s", o->def_note);
    else snprintf(buf, len, "%s", o->def);
}

static void trimmed(const char *s, char *buf, size_t len)
{
    const char *b, *e;
    trim(s, &b, &e);
    size_t n = (size_t)(e - b);
    if (n >= len) n = len - 1;
    memcpy(buf, b, n);
    buf[n] = '\0';
}

/* Read option i from the environment and MEMSHIM_CONF: the environment wins; a bad value falls
 * back to the next source. */
static void load_option(struct load_ctx *c, int i)
{
    const struct opt *o = &opts[i];
    const char *env = opt_env_value(c, i);
    const struct conf_entry *ce = c->conf_for[i] >= 0 ? &conf_entries[c->conf_for[i]] : NULL;
    if (ce && o->type == T_PATH && c->secure) {
        msh_warn("MEMSHIM_CONF key '%s' is ignored in a setuid/setgid program", ce->key);
        c->problems++;
        ce = NULL;
    }
    union val v_env, v_conf;
    int rc_env = env ? parse_value(o, env, &v_env) : -100;
    int rc_conf = ce ? parse_value(o, ce->value, &v_conf) : -100;

    enum src src = rc_env == 0 ? SRC_ENV : rc_conf == 0 ? SRC_CONF : SRC_DEFAULT;
    const char *used = src == SRC_ENV ? env : src == SRC_CONF ? ce->value : o->def;
    char shown[256], using[320], why[400];
    trimmed(used, shown, sizeof shown);
    if (src == SRC_DEFAULT) {
        char d[128];
        describe_default(o, d, sizeof d);
        snprintf(using, sizeof using, "using the default (%s)", d);
    } else {
        snprintf(using, sizeof using, "using %s=%s from %s", o->name, shown,
                 src == SRC_ENV ? "the environment" : "MEMSHIM_CONF");
    }
    if (env && rc_env != 0) {
        c->problems++;
        describe_error(o, rc_env, env, why, sizeof why);
        msh_warn("%s='" SHOW_FMT "' %s; %s", o->name, SHOW(env), why, using);
    }
    if (ce && rc_conf != 0) {
        c->problems++;
        describe_error(o, rc_conf, ce->value, why, sizeof why);
        char cv[256];
        trimmed(ce->value, cv, sizeof cv);
        msh_warn("invalid MEMSHIM_CONF entry '" ENTRY_FMT "': '" SHOW_FMT "' %s; %s", ENTRY(ce),
                 SHOW(cv), why, using);
    }
    if (src == SRC_DEFAULT) return;
    store_value(o, src == SRC_ENV ? &v_env : &v_conf);
    opt_src[i] = src;
    if (i == O_LOG) __atomic_store_n(&msh_log_level, msh_cfg.log_level, __ATOMIC_RELAXED);
    if (o->type == T_CONF || c->quiet) return; /* CONF: echoed by the entries it holds */
    msh_info("%s set by %s to %s", o->name, src == SRC_ENV ? "environment" : "MEMSHIM_CONF",
             shown[0] ? shown : "\"\"");
    if (src == SRC_ENV && ce && rc_conf == 0) {
        char cv[128];
        trimmed(ce->value, cv, sizeof cv);
        msh_info("%s:%s in MEMSHIM_CONF is overridden by %s from the environment", ce->key, cv,
                 o->name);
    }
}

/* The info echo of option i after the fact, from its effective value. */
static void echo_setting(int i)
{
    if (opt_src[i] == SRC_DEFAULT || msh_log_level < MSH_LOG_INFO) return;
    char val[512];
    format_value(&opts[i], val, sizeof val);
    msh_info("%s set by %s to " SHOW_FMT, opts[i].name,
             opt_src[i] == SRC_ENV ? "environment" : "MEMSHIM_CONF", SHOW(val));
}

static void check_unknown_names(struct load_ctx *c)
{
    for (char *const *e = c->envp; e && *e; e++) {
        if (strncmp(*e, "MEMSHIM_", 8) != 0) continue;
        const char *eq = strchr(*e, '=');
        if (!eq) continue;
        size_t n = (size_t)(eq - *e);
        bool known = false;
        for (int i = 0; i < O_COUNT && !known; i++)
            known = strlen(opts[i].name) == n && strncmp(opts[i].name, *e, n) == 0;
        if (known) continue;
        char name[128];
        if (n >= sizeof name) n = sizeof name - 1;
        memcpy(name, *e, n);
        name[n] = '\0';
        c->problems++;
        msh_warn("unknown variable %s (did you mean %s?)", name,
                 opts[nearest_option(name + 8, 8)].name);
    }
}

static int load_locked(char *const *envp, bool real)
{
    struct load_ctx c = {.envp = envp, .real = real};
    c.secure = real && getauxval(AT_SECURE) != 0;
    reset_defaults();

    const char *conf = env_lookup(envp, "MEMSHIM_CONF");
    bool conf_fits = conf_split(conf);
    if (!conf_fits) conf_n = 0;
    for (int i = 0; i < O_COUNT; i++) c.conf_for[i] = -1;
    for (int k = 0; k < conf_n; k++)
        if (conf_entries[k].opt >= 0) c.conf_for[conf_entries[k].opt] = k; /* the last wins */

    /* The log level first, so that it governs every message below; then the log file, so that
     * they already go there (the real environment only: tests and tools keep their output). */
    c.quiet = true;
    load_option(&c, O_LOG);
    load_option(&c, O_LOG_FILE);
    c.quiet = false;
    if (real && msh_cfg.log_file[0]) msh_log_open(msh_cfg.log_file);
    echo_setting(O_LOG);
    echo_setting(O_LOG_FILE);

    if (!conf_fits) {
        c.problems++;
        msh_warn("MEMSHIM_CONF is too long or has too many entries (at most %zu bytes and %d "
                 "entries); it is ignored",
                 sizeof conf_copy - 1, CONF_MAX_ENTRIES);
    }
    conf_check_entries(&c);
    check_unknown_names(&c);
    for (int i = 0; i < O_COUNT; i++)
        if (i != O_LOG && i != O_LOG_FILE) load_option(&c, i);

    /* Combinations that parse but cannot work as written. Warned, not counted as invalid. */
    if (msh_cfg.epoch_src == MSH_EPOCH_STEPS && msh_cfg.epoch_steps == 0)
        msh_warn("MEMSHIM_EPOCH=steps but MEMSHIM_EPOCH_STEPS is not set: no epoch will close (only the "
                 "summary at exit); set MEMSHIM_EPOCH_STEPS=N for an epoch every N optimizer steps");
    if (msh_cfg.epoch_src == MSH_EPOCH_SECONDS && msh_cfg.epoch_seconds <= 0)
        msh_warn("MEMSHIM_EPOCH=seconds but MEMSHIM_EPOCH_SECONDS is not set: no epoch will close (only "
                 "the summary at exit); set MEMSHIM_EPOCH_SECONDS=S for an epoch every S seconds");

    if (msh_cfg.strict && c.problems) {
        msh_error("MEMSHIM_STRICT=1 and %d MEMSHIM_* setting%s invalid or unknown (see the "
                  "warnings above); aborting",
                  c.problems, c.problems == 1 ? " is" : "s are");
        msh_config_abort_fn();
    }
    return c.problems;
}

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_result;

static void load_process_env(void)
{
    pthread_mutex_lock(&cfg_mu);
    load_result = load_locked(environ, true);
    pthread_mutex_unlock(&cfg_mu);
}

int msh_config_load(void)
{
    pthread_once(&load_once, load_process_env);
    return load_result;
}

int msh_config_load_from(char *const *envp)
{
    pthread_mutex_lock(&cfg_mu);
    int n = load_locked(envp, false);
    pthread_mutex_unlock(&cfg_mu);
    return n;
}

int msh_config_iter(int i, const char **name, char *val, size_t vlen, const char **source)
{
    if (i < 0 || i >= O_COUNT) return 0;
    if (name) *name = opts[i].name;
    if (val && vlen) format_value(&opts[i], val, vlen);
    if (source) *source = src_names[opt_src[i]];
    return 1;
}

void msh_config_dump(int level)
{
    if (level > msh_log_level) return;
    msh_log(level, "effective configuration:");
    char val[512];
    const char *name, *source;
    for (int i = 0; msh_config_iter(i, &name, val, sizeof val, &source); i++)
        msh_log(level, "  %s=" SHOW_FMT " (%s)", name, SHOW(val), source);
}

/* ---- docs/configuration.md ------------------------------------------------------------------ */

static const char *const type_names[] = {
    [T_ENUM] = "enum", [T_LIMIT] = "size or fraction", [T_SIZE] = "size",
    [T_FRACTION] = "fraction", [T_BOOL] = "boolean", [T_SECONDS] = "duration",
    [T_COUNT] = "integer", [T_SIGNAL] = "signal", [T_PATH] = "path", [T_CONF] = "string",
};

static const char md_intro[] =
    "# memshim configuration\n"
    "\n"
    "<!-- Generated by `build/memshim-options --markdown > docs/configuration.md` from the "
    "option table in policy/base/options.c. Do not edit by hand: tests/unit/test_options.c checks "
    "that this file matches. -->\n"
    "\n"
    "memshim is configured only through environment variables, read once when the library "
    "starts:\n"
    "\n"
    "    LD_PRELOAD=/path/to/libmemshim.so MEMSHIM_LIMIT=40G MEMSHIM_REPORT_DIR=memreport "
    "python train.py\n"
    "\n"
    "**Combined form.** `MEMSHIM_CONF` holds several options at once as `key:value` pairs "
    "separated by commas, the grammar of `PYTORCH_CUDA_ALLOC_CONF`. A key is the variable's "
    "name without `MEMSHIM_`, in any case:\n"
    "\n"
    "    MEMSHIM_CONF=limit:40G,empty_cache:epoch,log:info\n"
    "\n"
    "**Precedence.** A variable set on its own (`MEMSHIM_LIMIT=20G`) wins over the same key in "
    "`MEMSHIM_CONF`, which wins over the default. When a key appears twice in `MEMSHIM_CONF`, "
    "the last one wins. A value in `MEMSHIM_CONF` cannot contain a comma: set such a value "
    "(a path, say) in its own variable.\n"
    "\n"
    "**Bad values never stop the job.** An invalid value gives one warning that names the "
    "variable, the value and what is allowed, and memshim uses the next source (the "
    "`MEMSHIM_CONF` value, else the default):\n"
    "\n"
    "    memshim[123]: warning: MEMSHIM_LIMIT='banana' is not a size or fraction (expected bytes "
    "like 40G or a fraction 0..1); using the default (0: no limit)\n"
    "\n"
    "A bad `MEMSHIM_CONF` entry is named exactly (`invalid MEMSHIM_CONF entry 'limit:banana': "
    "...`). An unknown `MEMSHIM_*` variable or `MEMSHIM_CONF` key gives a warning with the "
    "nearest known name (`unknown variable MEMSHIM_LIMT (did you mean MEMSHIM_LIMIT?)`).\n"
    "\n"
    "**Strict mode.** With `MEMSHIM_STRICT=1`, memshim still reads and reports every option, "
    "then, if any value was invalid or any variable or key unknown, logs an error and aborts "
    "the process instead of running with defaults.\n"
    "\n"
    "**Seeing what is in effect.** With `MEMSHIM_LOG=info`, memshim prints each setting that "
    "is not at its default, as NCCL does with `NCCL_DEBUG=INFO`:\n"
    "\n"
    "    memshim[123]: info: MEMSHIM_LIMIT set by environment to 40G\n"
    "    memshim[123]: info: MEMSHIM_EMPTY_CACHE set by MEMSHIM_CONF to epoch\n"
    "\n"
    "`build/memshim-options --check` reads the current environment the same way, prints the "
    "effective value and source of every option, and exits with status 1 if anything was "
    "invalid. Reports embed the same list.\n"
    "\n"
    "**Paths.** `MEMSHIM_REPORT_DIR`, `MEMSHIM_TRACE_FILE` and `MEMSHIM_LOG_FILE` expand `%p` "
    "to the process id and `%h` to the host name (`%%` is a percent sign), so ranks of one job "
    "do not collide. They are ignored in setuid/setgid programs, and a path of 4096 bytes or "
    "more is rejected. An empty path means \"none\", the default.\n"
    "\n"
    "## Value grammar\n"
    "\n"
    "Leading and trailing spaces are ignored; an empty value is invalid (except for paths).\n"
    "\n"
    "- **size**: bytes (`1048576`), or a number with `K`, `M`, `G` or `T`, optionally followed "
    "by `iB` or `B`, in any case: `512MiB`, `40G`, `1.5gb`. Units are binary (1K = 1024). "
    "Decimals need a unit; negative values and values over 2^64-1 bytes are invalid.\n"
    "- **fraction**: a decimal number from 0 to 1 (`0.9`).\n"
    "- **size or fraction**: a value of at most 1 written with a dot, or exactly `1`, is a "
    "fraction; anything else is a size.\n"
    "- **boolean**: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, in any case.\n"
    "- **duration**: seconds (`10`, `2.5`), or a number with `s`, `ms`, `m` (minutes) or `h`.\n"
    "- **integer**: a whole number, within the range shown.\n"
    "- **signal**: a name with or without `SIG` (`SIGUSR2`, `usr2`) or a number 1..64; "
    "`SIGKILL` and `SIGSTOP` cannot be caught, and fault signals (`SIGSEGV`, `SIGBUS`, `SIGFPE`, `SIGILL`, `SIGABRT`, `SIGTRAP`, `SIGSYS`) must keep their meaning: all are rejected.\n"
    "- **enum**: one of the listed words, in any case.\n"
    "\n"
    "## Options\n"
    "\n";

static void md_escape(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '|') fputs("\\|", f);
        else fputc(*s, f);
    }
}

void msh_config_print_markdown(FILE *f)
{
    fputs(md_intro, f);
    fputs("| Variable | Type | Default | Allowed values / range | Unit | Description |\n", f);
    fputs("|---|---|---|---|---|---|\n", f);
    for (int i = 0; i < O_COUNT; i++) {
        const struct opt *o = &opts[i];
        fprintf(f, "| `%s` | %s | ", o->name, type_names[o->type]);
        if (o->def[0]) fprintf(f, "`%s`", o->def);
        else fputs("`\"\"`", f);
        if (o->def_note) fprintf(f, " (%s)", o->def_note);
        fputs(" | ", f);
        if (o->type == T_ENUM) {
            for (const struct enum_val *ev = o->vals; ev->name; ev++)
                fprintf(f, "%s`%s`", ev == o->vals ? "" : ", ", ev->name);
        } else {
            md_escape(f, o->allowed);
        }
        fputs(" | ", f);
        md_escape(f, o->unit);
        fputs(" | ", f);
        md_escape(f, o->help);
        fputs(" |\n", f);
    }
    fputs("\n## Values of the enum options\n", f);
    for (int i = 0; i < O_COUNT; i++) {
        const struct opt *o = &opts[i];
        if (o->type != T_ENUM) continue;
        fprintf(f, "\n### %s\n\n%s Default: `%s`.\n\n", o->name, o->vals_intro, o->def);
        for (const struct enum_val *ev = o->vals; ev->name; ev++)
            fprintf(f, "- `%s`: %s\n", ev->name, ev->help);
    }
}
