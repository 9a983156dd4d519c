#!/usr/bin/env python3
"""Every numeric field of memshim's epoch, summary and OOM reports against ground truth (issue 12).

The demo (build/memshim-train-demo, tests/demo/train_loop.c) runs under LD_PRELOAD=libmemshim.so
on the driver double, once per empty-cache policy and per epoch policy, under a limit and under a
small device, so peaks, currents and the OOM path all differ from run to run; a Python workload
(tests/reports/sites_workload.py, memshim_malloc through ctypes) gives the allocation sites. Two
records that share no code with memshim's accounting give the truth:
  - the trace memshim writes (MEMSHIM_TRACE_FILE): every allocation and free with its time, so the
    allocated bytes, live blocks, counts, size histogram, touched pages and largest live blocks at
    any report's t_end_s are recomputed here;
  - the driver double's own counters, read by libreport-spy.so (tests/reports/report_spy.c) the
    moment each report is renamed into place: handle, mapped and reserved-VA bytes with their
    peaks over the epoch and over the run (cudbl_get_bytes), bytes in use, and how many times each
    VMM call ran.
Every numeric field has an entry in FIELDS: the check that holds it against that truth, or,
where nothing independent exists, against the relations that must hold (peak >= current,
reserved >= allocated, run peak >= every epoch peak, counts that add up). A numeric field
without an entry fails the test (add its check to FIELDS: schema-2 fields such as sites,
latency, versions, driver or torch_memory_stats included), and so does an entry no report
ever showed. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, step  # noqa: E402

MiB = 1 << 20
GRAN = 2 * MiB
DEMO = os.path.join(BUILD, "memshim-train-demo")
LIB = os.path.join(BUILD, "libmemshim.so")
SPY = os.path.join(BUILD, "reports", "libreport-spy.so")
SPY_SRC = os.path.join(ROOT, "tests", "reports", "report_spy.c")
OOM_REPORTS_MAX = 16  # shim/core.c caps OOM reports per process

# One demo run per policy. cap: CUDBL_CAPACITY; limit: MEMSHIM_LIMIT (bytes or None); signals:
# SIGUSR2 sent every that many seconds while the demo runs.
# The trace knows allocations and frees, not the front end's bins (issue 30): the runs turn it off
# (MEMSHIM_FRONT=0) so that every page figure has an exact truth, except the run that keeps it on,
# where the figures bins change are held to what binned bytes allow (front.binned_bytes).
RUNS = [
    dict(name="front end on (the default), manual epochs", front=True, args=["--epochs", "3", "--steps", "3"]),
    dict(name="ec-oom (default), manual epochs, RANK=3", env={"RANK": "3"}, args=["--epochs", "3", "--steps", "3"]),
    dict(name="ec-never", env={"MEMSHIM_EMPTY_CACHE": "never"}, args=["--epochs", "3", "--steps", "3"]),
    dict(name="ec-epoch", env={"MEMSHIM_EMPTY_CACHE": "epoch"}, args=["--epochs", "3", "--steps", "3"]),
    # --quiet: no allocation for 2 s before each epoch mark, longer than the policy's quiet period
    dict(name="ec-threshold 16M", env={"MEMSHIM_EMPTY_CACHE": "threshold", "MEMSHIM_EMPTY_CACHE_THRESHOLD": "16M"},
         args=["--epochs", "3", "--steps", "3", "--quiet", "2"]),
    dict(name="ec-idle 0.2 s", env={"MEMSHIM_EMPTY_CACHE": "idle", "MEMSHIM_EMPTY_CACHE_IDLE": "0.2"},
         args=["--epochs", "2", "--steps", "3", "--pause", "0.7"]),
    dict(name="epoch-steps 2", env={"MEMSHIM_EPOCH": "steps", "MEMSHIM_EPOCH_STEPS": "2"},
         args=["--epochs", "2", "--steps", "3"]),
    dict(name="epoch-seconds 0.25", env={"MEMSHIM_EPOCH_SECONDS": "0.25"},
         args=["--epochs", "3", "--steps", "3", "--pause", "0.3"]),
    dict(name="epoch-signal SIGUSR2", env={"MEMSHIM_EPOCH": "signal"}, signals=0.15,
         args=["--epochs", "3", "--steps", "3", "--pause", "0.35"]),
    dict(name="limit 330M (OOMs past the report cap)", limit=330 * MiB, args=["--epochs", "3", "--steps", "3"]),
    dict(name="device of 370M (driver OOM)", cap=370 * MiB, args=["--epochs", "3", "--steps", "3"]),
    dict(name="limit 340M, no defrag, cache never emptied (OOM beside cached pages)", limit=340 * MiB,
         env={"MEMSHIM_DEFRAG": "0", "MEMSHIM_EMPTY_CACHE": "never"}, args=["--epochs", "3", "--steps", "3"]),
    dict(name="limit 340M, no defrag (empty-cache rescue under the limit)", limit=340 * MiB,
         env={"MEMSHIM_DEFRAG": "0"}, args=["--epochs", "3", "--steps", "3"]),
    dict(name="device of 370M, no defrag (empty-cache rescue)", cap=370 * MiB, env={"MEMSHIM_DEFRAG": "0"},
         args=["--epochs", "3", "--steps", "3"]),
    dict(name="leak 8 MiB per epoch", args=["--epochs", "4", "--steps", "2", "--leak", "8"]),
    # an epoch per step as well: allocated memory grows at one boundary in three, which is not
    # the "grew at every epoch" of a leak
    dict(name="leak 8 MiB, an epoch every step", env={"MEMSHIM_EPOCH": "steps", "MEMSHIM_EPOCH_STEPS": "1"},
         args=["--epochs", "3", "--steps", "2", "--leak", "8"]),
    dict(name="python workload (allocation sites)", python="sites_workload.py", env={"MEMSHIM_EPOCH": "manual"},
         args=[]),
]


# A launcher's variables in this script's own environment (a CI runner inside Slurm or mpirun) would
# give the demo another identity than its RANK (docs/reports.md, "Who wrote a report")
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|TORCHELASTIC_.*|SLURM_.*|"
                           r"OMPI_.*|PMI_.*|MPI_LOCAL.*|CROSS_RANK)$")


def build_spy():
    if os.path.exists(SPY) and os.path.getmtime(SPY) >= max(os.path.getmtime(SPY_SRC), os.path.getmtime(
            os.path.join(ROOT, "tests", "cudadouble", "cudbl.h"))):
        return None
    os.makedirs(os.path.dirname(SPY), exist_ok=True)
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    p = subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-g", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra",
                        "-fPIC", "-shared", "-I" + os.path.join(ROOT, "tests", "cudadouble"),
                        "-I" + os.path.join(cuda, "include"), "-o", SPY, SPY_SRC,
                        "-L" + os.path.join(BUILD, "double"), "-Wl,-rpath,$ORIGIN/../double", "-lcuda", "-ldl"],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else p.stderr[-600:]


# ---- one run: the demo, its reports, its trace, the driver's figures ------------------------------

def run_demo(cfg, tmp):
    d = tempfile.mkdtemp(prefix=re.sub(r"\W+", "-", cfg["name"])[:40] + "-", dir=tmp)
    rdir, trace, spylog = os.path.join(d, "reports"), os.path.join(d, "trace.txt"), os.path.join(d, "spy.log")
    cap = cfg.get("cap", 2048 * MiB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_", "RANK", "LOCAL_RANK"))
           and not LAUNCHER_VARS.match(k)}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": SPY + ":" + LIB,
                "CUDBL_CAPACITY": str(cap), "CUDBL_GRANULARITY": str(GRAN), "MEMSHIM_REPORT_DIR": rdir,
                "MEMSHIM_TRACE_FILE": trace, "REPORT_SPY_LOG": spylog, "MEMSHIM_LOG": "error",
                "MEMSHIM_FRONT": "1" if cfg.get("front") else "0"})
    if cfg.get("limit"):
        env["MEMSHIM_LIMIT"] = str(cfg["limit"])
    env.update(cfg.get("env", {}))
    unix0, t0 = time.time(), time.monotonic()
    argv = [DEMO, "--scale", "0.25", *cfg["args"]]
    if cfg.get("python"):
        script, sitelog = os.path.join(os.path.dirname(os.path.abspath(__file__)), cfg["python"]), os.path.join(d, "sites")
        argv = [sys.executable, script, sitelog]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if cfg.get("signals"):
        while p.poll() is None:
            time.sleep(cfg["signals"])
            try:
                p.send_signal(signal.SIGUSR2)
            except ProcessLookupError:
                break
    out, err = p.communicate(timeout=60)
    run = dict(cfg=cfg, pid=p.pid, rc=p.returncode, stdout=out, stderr=err, cap=cap, unix0=unix0,
               unix1=time.time(), wall=time.monotonic() - t0, limit=cfg.get("limit") or 0,
               rank=int(cfg.get("env", {}).get("RANK", "-1")), ec=cfg.get("env", {}).get("MEMSHIM_EMPTY_CACHE", "oom"))
    run["reports"] = {}
    for f in sorted(glob.glob(os.path.join(rdir, "*.json"))):
        with open(f) as fh:
            run["reports"][os.path.basename(f)] = json.load(fh)
    run["spy"] = {}
    if os.path.exists(spylog):
        for line in open(spylog):
            name, *kv = line.split()
            d = {}
            for k, v in (x.split("=", 1) for x in kv):
                # maps: the double's mappings now, "va:size,..." in hex:decimal ("-" when none)
                d[k] = [] if v == "-" else [(int(a, 16), int(n)) for a, n in (m.split(":") for m in v.split(","))] \
                    if k == "maps" else int(v)
            run["spy"][name] = d
    run["site_seq"], run["site_where"] = None, {}
    if cfg.get("python"):
        run["site_seq"] = open(sitelog).read().split() if os.path.exists(sitelog) else []
        func = None
        for n, line in enumerate(open(script), 1):
            m = re.match(r"^def (\w+)\(", line)
            if m:
                func = m.group(1)
            elif not line.startswith((" ", "\t")) and line.strip():
                func = "<module>"
            m = re.search(r"# SITE (\w+)", line)
            if m:
                run["site_where"][m.group(1)] = (script, n, func)
    run["events"] = []
    if os.path.exists(trace):
        for line in open(trace):
            f = line.split()
            if f and f[0] in ("a", "f"):
                run["events"].append((f[0], int(f[3], 16), int(f[4]), int(f[5])))
    return run


def rsize(n):
    return max((max(n, 1) + 511) // 512 * 512, 512)


def bucket(n):
    b, s = 0, n >> 9
    while s and b < 23:
        s >>= 1
        b += 1
    return b


class Truth:
    """The state after a prefix of the trace, advanced event by event."""

    def __init__(self, site_seq=None, where=None):
        self.site_seq, self.where, self.nalloc = site_seq, where or {}, 0
        self.site_of, self.peak_sites = {}, {}
        self.live, self.pages = {}, {}
        self.alloc_bytes = self.allocs = self.frees = self.rsum = 0
        self.hist = [0] * 24
        self.run_peak = 0
        self.win_peak = self.win_touched_peak = 0

    def touched(self):
        return len(self.pages) * GRAN

    def _pages(self, addr, size):
        return range(addr // GRAN, (addr + rsize(size) - 1) // GRAN + 1)

    def apply(self, ev):
        op, addr, size, _ = ev
        if op == "a":
            if self.site_seq is not None:
                name = self.site_seq[self.nalloc] if self.nalloc < len(self.site_seq) else "?"
                self.site_of[addr] = self.where.get(name, ("?", 0, name))
            self.nalloc += 1
            self.live[addr] = size
            self.alloc_bytes += size
            self.allocs += 1
            self.rsum += rsize(size)
            self.hist[bucket(size)] += 1
            for pg in self._pages(addr, size):
                self.pages[pg] = self.pages.get(pg, 0) + 1
        else:
            size = self.live.pop(addr)
            self.alloc_bytes -= size
            self.frees += 1
            self.rsum -= rsize(size)
            for pg in self._pages(addr, size):
                self.pages[pg] -= 1
                if not self.pages[pg]:
                    del self.pages[pg]
        self.run_peak = max(self.run_peak, self.alloc_bytes)
        if self.alloc_bytes > self.win_peak and self.site_seq is not None:
            self.peak_sites = self.sites()
        self.win_peak = max(self.win_peak, self.alloc_bytes)
        self.win_touched_peak = max(self.win_touched_peak, self.touched())

    def new_window(self):
        self.win_peak, self.win_touched_peak = self.alloc_bytes, self.touched()
        if self.site_seq is not None:
            self.peak_sites = self.sites()

    def sites(self):
        """(file, line, function) -> [live bytes, blocks], now."""
        out = {}
        for a, n in self.live.items():
            e = out.setdefault(self.site_of.get(a, ("?", 0, "?")), [0, 0])
            e[0] += n
            e[1] += 1
        return out

    def top(self, n=5):
        return sorted(self.live.items(), key=lambda kv: -kv[1])[:n]

    def free_run_lower_bound(self):
        """The longest run of bytes no live block covers inside consecutive touched pages: such
        bytes are free and mapped, so memshim's largest free extent is at least this."""
        best, prev_end = 0, None
        for addr in sorted(self.live):
            a0 = addr
            if prev_end is not None and all(pg in self.pages for pg in range(prev_end // GRAN, a0 // GRAN + 1)):
                best = max(best, a0 - prev_end)
            elif prev_end is not None:  # the run stops at the end of the touched pages / starts at theirs
                best = max(best, (prev_end + GRAN - 1) // GRAN * GRAN - prev_end, a0 - a0 // GRAN * GRAN)
            else:
                best = max(best, a0 - a0 // GRAN * GRAN)
            prev_end = a0 + rsize(self.live[addr])
        if prev_end is not None:
            best = max(best, (prev_end + GRAN - 1) // GRAN * GRAN - prev_end)
        return best


def ground_truth(run):
    """For every report (ordered by t_end_s): the trace state at that moment, the driver's figures,
    and what came before it."""
    reps = sorted(run["reports"].items(), key=lambda kv: kv[1]["t_end_s"])
    tr, i, evs = Truth(run["site_seq"], run["site_where"]), 0, run["events"]
    out, epoch_ends, site_ends = [], [], []
    allocs0 = frees0 = 0  # at the last epoch report
    for name, rep in reps:
        t_end_us = rep["t_end_s"] * 1e6
        while i < len(evs) and evs[i][3] < t_end_us:
            tr.apply(evs[i])
            i += 1
        g = dict(alloc=tr.alloc_bytes, alloc_peak=tr.win_peak, run_peak=tr.run_peak, blocks=len(tr.live),
                 allocs=tr.allocs, frees=tr.frees, hist=list(tr.hist), touched=tr.touched(),
                 touched_peak=tr.win_touched_peak, rsum=tr.rsum, top=tr.top(), free_lb=tr.free_run_lower_bound(),
                 events_before=i, addrs_by_size={})
        for a, sz in tr.live.items():
            g["addrs_by_size"].setdefault(sz, set()).add(a)
        g["peak_sites"] = dict(tr.peak_sites)
        # The driver's mappings (each a whole handle) against the live blocks: a handle no live
        # block touches could go back to the driver; free pages in a handle that still holds a live
        # block cannot (a handle is released whole).
        spy = run["spy"].get(name)
        if spy is not None and "maps" in spy:
            g["idle_handle_bytes"] = sum(n for va, n in spy["maps"]
                                         if not any(pg in tr.pages for pg in range(va // GRAN, (va + n) // GRAN)))
        g["allocs_epoch"], g["frees_epoch"] = tr.allocs - allocs0, tr.frees - frees0
        if rep["kind"] == "epoch":
            epoch_ends.append(tr.alloc_bytes)
            site_ends.append(tr.sites() if run["site_seq"] is not None else {})
            g["epoch_ends"] = list(epoch_ends)
            g["site_ends"] = list(site_ends)
            tr.new_window()
            allocs0, frees0 = tr.allocs, tr.frees
        else:
            g["epoch_ends"] = list(epoch_ends)
            g["site_ends"] = list(site_ends)
        out.append((name, rep, g, run["spy"].get(name)))
    run["trailing_events"] = len(evs) - i
    return out


# ---- the field table --------------------------------------------------------------------------
# Each entry: path -> (how, check). how is "truth" (an independent recomputation) or "relation"
# (what must hold between figures). check(c, v, idx) returns None when v is right, else why.
# c: the report and its context (c.r report, c.g trace truth, c.s driver figures, c.run, c.prev).


def need(cond, why):
    return None if cond else why


def eq(v, want, what):
    return None if v == want else f"{v} != {want} ({what})"


def close(v, want, what, tol=1e-9):
    return None if abs(v - want) <= tol * max(1.0, abs(want)) else f"{v} != {want} ({what})"


def mem(c, k):
    return c.r["memory"][k]


def ops(c, k):
    return c.r["operations"][k]


def check_front(k):
    def check(c, v, idx):
        f, seg = c.r["front"], c.r["mode"] == "segment"
        if k in ("hits", "misses", "puts", "binned_bytes", "binned_blocks", "peak_binned_bytes", "drained_blocks",
                 "grown_instead_of_draining", "grown_instead_of_draining_bytes") and seg:
            return eq(v, 0, "segment mode: cudaMalloc's blocks never go to a bin")
        if k == "hits":
            return need(v + f["misses"] <= ops(c, "allocs"), f"hits {v} + misses {f['misses']} > allocs")
        if k == "puts":
            return need(v <= ops(c, "frees"), f"{v} puts > {ops(c, 'frees')} frees")
        if k == "drained_blocks":
            return need(v <= f["puts"] and f["binned_blocks"] + v <= f["puts"], f"{v} drained of {f['puts']} put")
        if k == "drains":
            return need(v <= max(f["drained_blocks"], 0) or v == 0, f"{v} drains gave back {f['drained_blocks']} blocks")
        if k == "binned_bytes":
            return need(v <= mem(c, "reserved_bytes") and v <= f["peak_binned_bytes"], f"{v} binned")
        if k == "binned_blocks":
            return need((v == 0) == (f["binned_bytes"] == 0) and v <= f["puts"], f"{v} binned blocks")
        if k == "peak_binned_bytes":
            return need(v <= mem(c, "reserved_peak_bytes"), f"{v} above the reserved peak")
        if k == "grown_instead_of_draining_bytes":
            return need(v <= mem(c, "reserved_bytes") // 16 + 40 * MiB + GRAN, f"{v} above 1/16 of reserved and two chunks")
        if k == "grown_instead_of_draining":
            return need(v <= f["misses"], f"{v} > misses")
        if k == "double_frees":
            return eq(v, 0, "the workloads free each block once")
        return need(v >= 0, "negative")
    return check


def oom_of(c):
    """The OOM report that a report's last_oom must repeat: the last one written at or before it
    (None when OOMs went past the report cap, after which last_oom has no report to match)."""
    if c.r["kind"] == "oom":
        return c.r
    n = ops(c, "alloc_failures")
    if n > OOM_REPORTS_MAX:
        return None
    prior = [p for p in c.prev if p["kind"] == "oom"]
    return prior[-1] if len(prior) == n and prior else None


def last_oom_same(c, v, idx, key):
    o = oom_of(c)
    if o is None:
        return None  # the relations below still apply
    return eq(v, o["last_oom"][key], f"last_oom.{key} of the OOM report it describes")


def epoch_reports(c):
    return [p for p in c.prev if p["kind"] == "epoch"] + ([c.r] if c.r["kind"] == "epoch" else [])


def check_epoch_index(c, v, idx):
    """The epoch under way: as many as the epoch reports before it (epoch, OOM and summary)."""
    return eq(v, len([p for p in c.prev if p["kind"] == "epoch"]), "epoch reports before it")


def check_oom_index(c, v, idx):
    return eq(v, len([p for p in c.prev if p["kind"] == "oom"]), "OOM reports before it (the file's NNNN)") or \
        need(c.name.endswith(f"-oom{v:04d}.json"), f"the file is {c.name}")


def check_t_start(c, v, idx):
    eps = [p for p in c.prev if p["kind"] == "epoch"]
    if not eps:
        return eq(v, 0.0, "the first epoch starts at 0")
    last = eps[-1]["t_end_s"]
    return need(last <= v <= last + 1.0 and v <= c.r["t_end_s"],
                f"{v}: not between the previous epoch's end {last} and this report's end {c.r['t_end_s']}")


def check_t_end(c, v, idx):
    if not (c.r["t_start_s"] <= v <= c.run["wall"]):
        return f"{v}: outside [t_start_s {c.r['t_start_s']}, the process's wall time {c.run['wall']:.3f}]"
    return None


def check_steps(c, v, idx):
    cfg, reason = c.run["cfg"], c.r["reason"]
    if cfg.get("python"):
        return eq(v, 0, "the Python workload never calls memshim_step")
    args = cfg["args"]
    per_epoch = int(args[args.index("--steps") + 1])
    if reason == "steps":
        return eq(v, int(cfg["env"]["MEMSHIM_EPOCH_STEPS"]), "MEMSHIM_EPOCH_STEPS")
    if c.r["kind"] == "summary":  # what every epoch report and the summary counted adds up
        total = per_epoch * int(args[args.index("--epochs") + 1])
        counted = sum(p["steps"] for p in c.prev if p["kind"] == "epoch") + v
        return eq(counted, total, "steps over all epoch reports and the summary vs the demo's steps")
    if reason == "manual" and not any(p["kind"] == "epoch" and p["reason"] != "manual" for p in c.prev) \
            and cfg.get("env", {}).get("MEMSHIM_EPOCH") is None and "MEMSHIM_EPOCH_SECONDS" not in cfg.get("env", {}):
        return eq(v, per_epoch, "the demo's --steps per epoch")
    return need(0 <= v <= per_epoch * 4, f"{v} steps")


def trend_verdict(ends, growing):
    """report.c's rule, restated: growth by more than 1 MiB at every boundary of at least three,
    naming the fastest-growing site when one grew."""
    if len(ends) < 3:
        return "too few epochs"
    grew = sum(1 for a, b in zip(ends, ends[1:]) if b > a + MiB)
    if grew != len(ends) - 1:
        return "flat"
    extra = ""
    if growing:
        g = growing[0]
        extra = (f" (fastest-growing site: {os.path.basename(g['file'])}:{g['line']} {g['function']}, "
                 f"+{g['growth_bytes_per_epoch'] / MiB:.1f} MiB per epoch)")
    return "possible leak: allocated memory grew at every epoch" + extra


def check_trend(c, v, idx):
    want = c.g["epoch_ends"]
    verdict = trend_verdict(want[-64:], growing_truth(c))
    if idx[0] == 0 and c.r["trend"]["verdict"] != verdict:
        return f"verdict '{c.r['trend']['verdict']}', the epoch ends {want[-64:]} say '{verdict}'"
    if idx[0] == 0 and len(c.r["trend"]["epoch_end_allocated_bytes"]) != len(want[-64:]):
        return f"{len(c.r['trend']['epoch_end_allocated_bytes'])} entries, {len(want[-64:])} epochs closed"
    return eq(v, want[-64:][idx[0]] if idx[0] < len(want[-64:]) else None, "allocated bytes at that epoch's end (trace)")


def check_free_in_mapped(c, v, idx):
    # Blocks tile the pool's VA and every page a live block touches is mapped, so the mapped bytes
    # are the live extents (requests rounded to 512) plus the free bytes inside mapped pages, and
    # the front end's binned blocks (freed in the trace, in no free extent).
    return eq(v + c.r["front"]["binned_bytes"], c.s["mapped"] - c.g["rsum"],
              "driver's mapped bytes - live extents from the trace - binned bytes")


def check_largest_free(c, v, idx):
    f = mem(c, "free_in_mapped_bytes")
    return need(c.g["free_lb"] <= v <= f and v % 512 == 0 and (v > 0) == (f > 0),
                f"{v}: not within [{c.g['free_lb']} (free run inside touched pages, trace), free_in_mapped {f}]")


def check_released_pages(c, v, idx):
    # a handle spans one page or more and is released whole: pages given back are at most the
    # bytes whose memory the driver got back, and at least one page per empty-cache release
    if (why := need(v * GRAN <= c.s["released_total"], f"{v} pages > {c.s['released_total']} bytes the driver got back")):
        return why
    ec = sum(p["policies"]["empty_cache_released_bytes"] for p in c.prev if p["kind"] == "epoch") \
        + c.r["policies"]["empty_cache_released_bytes"]
    if c.run["ec"] in ("never", "epoch", "idle", "threshold") and not c.run["cfg"].get("cap"):
        return eq(v * GRAN, ec, "bytes released by every empty-cache run so far (the only release path here)")
    return need(v * GRAN >= ec, f"{v} pages < {ec} bytes released by empty-cache runs")


def check_ec_runs(c, v, idx):
    ec = c.run["ec"]
    if ec in ("never", "oom"):
        return eq(v, 0, f"MEMSHIM_EMPTY_CACHE={ec} never runs the policy")
    if ec == "epoch":
        return eq(v, 1 if c.r["kind"] == "epoch" else 0, "one empty-cache run per epoch boundary")
    return need(v >= 0 and (v > 0 or c.r["policies"]["empty_cache_released_bytes"] == 0), f"{v} runs")


def check_ec_bytes(c, v, idx):
    if (why := need(v % GRAN == 0 and v <= c.s["handle_mark_peak"] and (v == 0 or c.r["policies"]["empty_cache_runs"]),
                    f"{v}: not whole pages, above the epoch's driver peak, or without a run")):
        return why
    if c.run["ec"] == "never":
        return eq(v, 0, "MEMSHIM_EMPTY_CACHE=never")
    return None


def check_failures(c, v, idx):
    if c.r["kind"] == "oom":
        return eq(v, c.r["oom_index"] + 1, "the OOM reports so far, this one included")
    n = len([p for p in c.prev if p["kind"] == "oom"])
    if n < OOM_REPORTS_MAX:
        return eq(v, n, "OOM reports written before it (each failure writes one)")
    return need(v >= n, f"{v} < {n} OOM reports")


def check_oom_case(c, v, idx):
    """Issue 25: the case follows from the request, the double's capacity and the limit in pages."""
    if c.r["kind"] != "oom":
        return last_oom_same(c, v, idx, "case")
    req, lim = c.r["last_oom"]["requested_bytes"], c.run["limit"] // GRAN * GRAN
    want = ("larger_than_device" if req > c.run["cap"] else "larger_than_limit" if lim and req > lim
            else "does_not_fit_now")
    return eq(v, want, f"a request of {req} bytes on a device of {c.run['cap']}, limit {lim}")


def check_oom_cached(c, v, idx):
    """Cached pages are whole pages no live block touches: beside the live bytes, inside what is reserved."""
    lo = c.r["last_oom"]
    if c.r["kind"] != "oom":
        return last_oom_same(c, v, idx, "cached_bytes")
    return need(v % GRAN == 0 and v + lo["live_bytes"] <= lo["reserved_bytes"],
                f"cached {v} + live {lo['live_bytes']} > reserved {lo['reserved_bytes']} (or not whole pages)")


def check_oom_requested(c, v, idx):
    lo = c.r["last_oom"]
    cap = lo["limit_bytes"] or (lo["reserved_bytes"] + lo["device_free_bytes"])
    if lo["cause"] == "capacity":
        return need(lo["live_bytes"] + v > cap, f"cause 'capacity' but live {lo['live_bytes']} + {v} <= {cap}")
    return need(lo["live_bytes"] + v <= cap, f"cause '{lo['cause']}' but live {lo['live_bytes']} + {v} > {cap}")


def check_top_bytes(c, v, idx):
    blocks = c.r["last_oom"]["largest_live_blocks"]
    if c.r["kind"] == "oom":
        top = c.g["top"]
        if len(blocks) != len(top):
            return f"{len(blocks)} blocks listed, {len(top)} live in the trace"
        want_addr, want = top[idx[0]]
        if v != want:
            return f"{v} != {want} (the {idx[0] + 1}th largest live block in the trace)"
        return need(int(blocks[idx[0]]["addr"], 16) in c.g["addrs_by_size"].get(v, ()),
                    f"address {blocks[idx[0]]['addr']} holds no live block of {v} bytes in the trace")
    return last_oom_same_list(c, v, idx)


def last_oom_same_list(c, v, idx):
    o = oom_of(c)
    if o is None:
        return need(v <= mem(c, "allocated_run_peak_bytes"), f"{v} > allocated run peak")
    return eq(v, o["last_oom"]["largest_live_blocks"][idx[0]]["bytes"], "the OOM report it describes")


def cost_table():
    """The driver cost table in force (memshim-replay --show-driver-costs): kind -> (s per call,
    s per MiB, s per mapping). Read once; the formula is restated here."""
    if "table" in COSTS:
        return COSTS["table"]
    unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}
    table = {}
    p = subprocess.run([os.path.join(BUILD, "memshim-replay"), "--show-driver-costs"], capture_output=True,
                       text=True, timeout=30)
    for line in p.stdout.splitlines():
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        vals = []
        for x in f[1:4]:
            m = re.match(r"^([0-9.eE+-]+)([a-z]*)$", x)
            vals.append(float(m.group(1)) * unit[m.group(2)] if m else float("nan"))
        table[f[0]] = (vals[0], vals[1] if len(vals) > 1 else 0.0, vals[2] if len(vals) > 2 else 0.0)
    COSTS["table"] = table
    return table


COSTS = {}
# driver.calls kind -> (the double's function counting the same calls, exact: the pool is its only
# caller in these workloads; else the double's count is an upper bound)
DRIVER_CALLS = {"create": ("cuMemCreate", True), "release": ("cuMemRelease", True), "map": ("cuMemMap", True),
                "unmap": ("cuMemUnmap", True), "set_access": ("cuMemSetAccess", True),
                "event_record": ("cuEventRecord", True), "stream_wait": ("cuStreamWaitEvent", True),
                "synchronize": ("cuCtxSynchronize", False), "malloc": ("cuMemAlloc", False),
                "free": ("cuMemFree", False), "reserve": ("cuMemAddressReserve", True),
                "unreserve": ("cuMemAddressFree", True),
                # issue 31: the pool's asks; the double also counts memshim's other cuMemGetInfo
                # calls (start-up, "other" memory, cudaMemGetInfo): an upper bound
                "mem_info": ("cuMemGetInfo", False)}


def check_driver_calls(kind):
    fn, exact = DRIVER_CALLS[kind]

    def check(c, v, idx):
        n = c.s[f"calls_{fn}"]  # the double counts refused calls too, as memshim does
        if exact:
            why = eq(v, n, f"driver: {fn} calls")
        else:
            why = need(v <= n, f"{v} > the driver's {n} {fn} calls")
        if why:
            return why
        ops_of = {"create": "create_ops", "release": "release_ops", "map": "map_ops", "unmap": "unmap_ops",
                  "stream_wait": "cross_stream_waits"}
        if kind == "set_access":  # one grant over each request's mapped span, one per run after a failure
            return need(v <= c.s["calls_cuMemMap"], f"{v} access grants > {c.s['calls_cuMemMap']} cuMemMap calls")
        if kind == "create" and c.run["cfg"].get("cap"):  # creates the driver refused are calls, not ops
            return need(v >= ops(c, "create_ops"), f"{v} calls < {ops(c, 'create_ops')} handles created")
        if kind in ops_of:
            return eq(v, ops(c, ops_of[kind]), f"operations.{ops_of[kind]}")
        if kind in ("malloc", "free"):
            return eq(v, 0, "memshim's pool never calls cuMemAlloc/cuMemFree (only the models do)")
        return None
    return check


def check_modelled_seconds(c, v, idx):
    # the report's calls, with the bytes and the mappings they covered as the DRIVER saw them (the
    # pool is the only VMM caller here; its cuMemSetAccess mappings are the double's grants)
    table, calls = cost_table(), c.r["driver"]["calls"]
    total = 0.0
    for k, n in calls.items():
        if k not in table:
            return f"driver kind '{k}' is not in the cost table"
        fn = DRIVER_CALLS.get(k, (None,))[0]
        nbytes = c.s.get(f"bytes_{fn}", 0) if fn in VMM_FNS else 0
        maps = c.s["access_grants"] if k == "set_access" else n
        total += n * table[k][0] + nbytes / MiB * table[k][1] + maps * table[k][2]
    return close(v, total, "calls x the cost table (memshim-replay --show-driver-costs)", tol=1e-6)


VMM_FNS = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemAddressReserve",
           "cuMemAddressFree")


def check_latency(which):
    def check(c, v, idx, field):
        lat = c.r["latency"][which]
        covers = c.r["latency"]["covers"]
        if covers != ("epoch" if c.r["kind"] == "epoch" else "run"):
            return f"covers '{covers}' in a {c.r['kind']} report"
        n = (c.g["allocs_epoch"] if which == "alloc_ns" else c.g["frees_epoch"]) if covers == "epoch" else \
            (c.g["allocs"] if which == "alloc_ns" else c.g["frees"])
        if field == "count":
            return eq(v, n, f"{'allocations' if which == 'alloc_ns' else 'frees'} the trace shows for the {covers}")
        order = [lat[k] for k in ("p50", "p90", "p99", "max")]
        if any(x is None for x in order) or order != sorted(order):
            return f"p50 <= p90 <= p99 <= max does not hold: {order}"
        if field != "max":  # a bucket's upper bound (4 per power of two), or the max when lower
            bounds = {b if b < 4 else ((5 + b % 4) << (b // 4 - 1)) - 1 for b in range(144)}
            return need(v in bounds or v == lat["max"], f"{v} is neither a histogram bound nor the max")
        if covers == "run":  # max exact: the mean cannot exceed it
            mean = ops(c, "alloc_mean_ns" if which == "alloc_ns" else "free_mean_ns")
            return need(v >= mean - 1, f"max {v} below the mean {mean}")
        return None
    return {f: (T if f == "count" else R, (lambda f: lambda c, v, i: check(c, v, i, f))(f))
            for f in ("count", "p50", "p90", "p99", "max")}


# memshim_overhead (issue 24): the ledger of memshim's own driver calls against the double's counts
# (the pool is the only caller of the VMM functions here), the rest by the relations that define it.
# The synchronizes (issue 31): each kind is a function of the ledger (device: the runtime's
# cudaDeviceSynchronize, which reaches the driver as one cuCtxSynchronize), and over the run they
# are every synchronize the double received less the demo's own (it prints how many it made).
SYNC_FN = {"device": "cudaDeviceSynchronize", "context": "cuCtxSynchronize", "stream": "cuStreamSynchronize",
           "event": "cuEventSynchronize"}
SYNC_DRIVER = {"device": "cuCtxSynchronize", "context": "cuCtxSynchronize", "stream": "cuStreamSynchronize",
               "event": "cuEventSynchronize"}


def overhead_wall(c):
    o = c.r["memshim_overhead"]
    return c.r["t_end_s"] - (c.r["t_start_s"] if o["covers"] == "epoch" else 0.0)


def check_overhead_call(field):
    def check(c, v, idx, path):
        o = c.r["memshim_overhead"]
        if o["covers"] != ("epoch" if c.r["kind"] == "epoch" else "run") or o["scope"] != "process":
            return f"covers '{o['covers']}', scope '{o['scope']}' in a {c.r['kind']} report"
        fn = path.split(".")[2]
        if field == "count":
            if fn in VMM_FNS:
                n = c.s[f"calls_{fn}"]
                if o["covers"] == "run":
                    return eq(v, n, f"the driver double's own count of {fn} calls")
                return need(v <= n, f"{v} {fn} calls in the epoch > the double's {n} since start")
            return need(v >= 1, "a function listed was called")
        # one thread calls the driver in the demo: its time in the driver fits in the wall time
        return need(0 <= v <= overhead_wall(c) + 1e-3, f"{v} s in {fn} beyond the {overhead_wall(c)} s covered")
    return check  # called with the field's path: the function's name is part of it (run_report)


def own_synchronizes(run):
    """The demo's own device synchronizes (its last line says), 0 for the Python workload."""
    m = re.search(r"finished, \d+ failed allocations, (\d+) device synchronizes of its own", run["stdout"])
    return int(m.group(1)) if m else 0 if run["cfg"].get("python") else None


def check_overhead_sync(kind, field):
    def check(c, v, idx):
        o = c.r["memshim_overhead"]
        calls = o["driver_calls"]
        why = close(v, calls.get(SYNC_FN[kind], {}).get(field, 0), f"synchronizes.{kind} is {SYNC_FN[kind]}",
                    tol=1e-12)
        if why or field != "count" or c.r["kind"] != "summary":
            return why
        # the run's synchronizes against the driver's: what it received less the demo's own
        fn, own = SYNC_DRIVER[kind], own_synchronizes(c.run)
        if own is None:
            return "the demo did not say how many synchronizes it made itself"
        same = [k for k in SYNC_DRIVER if SYNC_DRIVER[k] == fn]
        ours = sum(o["synchronizes"][k]["count"] for k in same)
        want = c.s[f"calls_{fn}"] - (own if fn == "cuCtxSynchronize" else 0)
        return eq(ours, want, f"the double's {fn} calls less the demo's own {own} ({' + '.join(same)})")
    return check


def check_overhead_path(c, v, idx):
    if c.r["memshim_overhead"]["covers"] == "epoch":
        return need(v >= 0, "negative")
    want = (ops(c, "alloc_mean_ns") * ops(c, "allocs") + ops(c, "free_mean_ns") * ops(c, "frees")) / 1e9
    return need(abs(v - want) <= 0.02 * want + 1e-6, f"{v} s, the mean times the count {want} s")




def sites_truth(c):
    """The top 10 sites at the epoch's peak, from the trace and the workload's own site log."""
    rows = sorted(((b, n, k) for k, (b, n) in c.g["peak_sites"].items()), key=lambda r: -r[0])[:10]
    return [{"file": k[0], "line": k[1], "function": k[2], "bytes": b, "count": n} for b, n, k in rows]


def check_site(field):
    def check(c, v, idx):
        if c.run["site_seq"] is None:
            return "sites in a process that runs no Python"
        want, got = sites_truth(c), c.r["sites"]
        if len(got) != len(want):
            return f"{len(got)} sites, the trace gives {len(want)}: {want}"
        e = got[idx[0]]
        match = [w for w in want if (w["file"], w["line"], w["function"]) == (e["file"], e["line"], e["function"])]
        if not match:
            return f"site {e['file']}:{e['line']} {e['function']} is not one the workload allocated from"
        if idx[0] and got[idx[0] - 1]["bytes"] < e["bytes"]:
            return "sites are not largest first"
        return eq(v, match[0][field], f"{field} of that site at the epoch's peak (trace + the workload's log)")
    return check


def growing_truth(c):
    ends = c.g["site_ends"][-8:]
    out = []
    if len(ends) >= 3:
        for k in set().union(*ends):
            series = [e.get(k, [0, 0])[0] for e in ends]
            if all(b - a >= 4096 for a, b in zip(series, series[1:])):
                out.append({"file": k[0], "line": k[1], "function": k[2],
                            "growth_bytes_per_epoch": (series[-1] - series[0]) / (len(series) - 1)})
    return sorted(out, key=lambda r: -r["growth_bytes_per_epoch"])[:10]


def check_growing(field):
    def check(c, v, idx):
        want, got = growing_truth(c), c.r["trend"]["growing_sites"]
        if len(got) != len(want):
            return f"{len(got)} growing sites, the trace gives {len(want)}: {want}"
        e = got[idx[0]]
        match = [w for w in want if (w["file"], w["line"], w["function"]) == (e["file"], e["line"], e["function"])]
        if not match:
            return f"{e['file']}:{e['line']} {e['function']} did not grow at every epoch end"
        if field == "growth_bytes_per_epoch":
            return close(v, match[0][field], "mean growth of its live bytes over the recorded epoch ends", tol=1e-6)
        return eq(v, match[0][field], field)
    return check


def check_torch_stat(c, v, idx, path):
    """PyTorch's own figures (segment mode on a GPU): counts and bytes are never negative; a
    peak is at least the current figure beside it."""
    if v < 0:
        return f"{v} < 0"
    key = path.split(".", 1)[1]
    if key.endswith(".peak"):
        cur = c.r["torch_memory_stats"].get(key[:-5] + ".current")
        return need(cur is None or v >= cur, f"peak {v} below the current {cur}")
    return None


T, R = "truth", "relation"
FIELDS = {
    "schema_version": (R, lambda c, v, i: eq(v, 2, "schema 2 (a new schema needs its fields declared here)")),
    "pid": (T, lambda c, v, i: eq(v, c.run["pid"], "the demo's process id")),
    "rank": (T, lambda c, v, i: eq(v, c.run["rank"], "the RANK variable of the run (-1: none)")),
    # the runs set RANK alone (launcher row "env"): no launcher says more (tests/report_tool/
    # test_launchers.py holds these per launcher)
    "local_rank": (T, lambda c, v, i: eq(v, None, "the runs set no LOCAL_RANK")),
    "world_size": (T, lambda c, v, i: eq(v, None, "the runs set no WORLD_SIZE")),
    "node_rank": (T, lambda c, v, i: eq(v, None, "the runs set no GROUP_RANK")),
    "restart": (T, lambda c, v, i: eq(v, None, "the runs set no restart count")),
    # the wall clock at the report less t_end_s: whole seconds in wall_time_unix bound it
    "start_unix": (R, lambda c, v, i: need(c.r["wall_time_unix"] - 0.05 <= v + c.r["t_end_s"] <= c.r["wall_time_unix"] + 1.05
                                           and c.run["unix0"] - 1 <= v <= c.run["unix1"],
                                           f"{v} + t_end_s {c.r['t_end_s']} is not the report's time "
                                           f"{c.r['wall_time_unix']} (whole seconds), or outside the run")),
    "device": (T, lambda c, v, i: eq(v, 0, "the demo uses device 0")),
    "epoch": (T, check_epoch_index),
    "oom_index": (T, check_oom_index),
    "t_start_s": (R, check_t_start),
    "t_end_s": (R, check_t_end),
    "steps": (T, check_steps),
    # whole seconds from time(), whose coarse clock may trail Python's time.time() by a tick
    "wall_time_unix": (T, lambda c, v, i: need(int(c.run["unix0"]) - 1 <= v <= c.run["unix1"] + 1,
                                               f"{v}: outside the run [{c.run['unix0']:.0f}, {c.run['unix1']:.0f}]")),
    # memory: allocated from the trace, reserved from the driver
    "memory.allocated_bytes": (T, lambda c, v, i: eq(v, c.g["alloc"], "live requested bytes in the trace")),
    "memory.allocated_peak_bytes": (T, lambda c, v, i: eq(v, c.g["alloc_peak"], "trace peak since the epoch began")),
    "memory.allocated_run_peak_bytes": (T, lambda c, v, i: eq(v, c.g["run_peak"], "trace peak since the start")),
    "memory.reserved_bytes": (T, lambda c, v, i: eq(v, c.s["handle"], "driver: bytes of handles held")),
    "memory.reserved_peak_bytes": (T, lambda c, v, i: eq(v, c.s["handle_mark_peak"], "driver: handle bytes peak over this epoch")
                                   or need(v >= mem(c, "allocated_peak_bytes") and v >= mem(c, "reserved_bytes"),
                                           "below peak allocated or current reserved")),
    "memory.reserved_run_peak_bytes": (T, lambda c, v, i: eq(v, c.s["handle_peak"], "driver: handle bytes peak since start")
                                       or need(all(v >= p["memory"]["reserved_peak_bytes"] for p in epoch_reports(c)),
                                               "below an epoch's peak")),
    # binned blocks keep their pages touched: with the front end on, at least what live blocks touch
    "memory.touched_bytes": (T, lambda c, v, i: eq(v, c.g["touched"], "pages live blocks touch, from the trace")
                             if not c.run["cfg"].get("front") else
                             need(c.g["touched"] <= v <= c.s["mapped"], f"{v}: below the trace's {c.g['touched']} "
                                  f"pages live blocks touch, or above the {c.s['mapped']} mapped")),
    "memory.touched_peak_bytes": (T, lambda c, v, i: eq(v, c.g["touched_peak"], "trace: most touched pages this epoch")
                                  if not c.run["cfg"].get("front") else
                                  need(v >= c.g["touched_peak"], f"{v} below the trace's {c.g['touched_peak']}")),
    "memory.physical_mapped_bytes": (T, lambda c, v, i: eq(v, c.s["mapped"], "driver: bytes covered by cuMemMap")),
    "memory.virtual_reserved_bytes": (T, lambda c, v, i: eq(v, c.s["va"], "driver: cuMemAddressReserve bytes")),
    "memory.free_in_mapped_bytes": (T, check_free_in_mapped),
    "memory.largest_free_extent_bytes": (R, check_largest_free),
    "memory.live_blocks": (T, lambda c, v, i: eq(v, c.g["blocks"], "live blocks in the trace")),
    "memory.device_total_bytes": (T, lambda c, v, i: eq(v, c.run["cap"], "CUDBL_CAPACITY")),
    "memory.device_free_bytes": (T, lambda c, v, i: eq(v, c.run["cap"] - c.s["bytes_in_use"], "capacity - driver bytes in use")),
    "memory.not_served_by_memshim.cuda_malloc_passthrough_bytes": (
        T, lambda c, v, i: eq(v, 0, "no cuMemAlloc block in the driver") if c.s["allocs"] == 0 else
        need(0 <= v <= c.s["bytes_in_use"] - c.s["handle"], f"{v}")),
    "memory.not_served_by_memshim.async_pool_bytes": (
        T, lambda c, v, i: eq(v, 0, "no cuMemAllocAsync block in the driver") if c.s["allocs"] == 0 else None),
    "memory.not_served_by_memshim.vmm_by_others_bytes": (
        T, lambda c, v, i: eq(v, c.s["handle"] - mem(c, "reserved_bytes"), "driver handle bytes - memshim's")),
    "memory.not_served_by_memshim.other_bytes_on_device": (
        T, lambda c, v, i: eq(v, max(0, c.s["bytes_in_use"] - mem(c, "reserved_bytes")), "driver bytes in use - memshim's")),
    # fragmentation: derived figures, recomputed from their inputs
    "fragmentation.free_extent_fragmentation": (R, lambda c, v, i: close(
        v, 1 - mem(c, "largest_free_extent_bytes") / mem(c, "free_in_mapped_bytes") if mem(c, "free_in_mapped_bytes") else 0.0,
        "1 - largest free extent / free bytes")),
    "fragmentation.peak_allocated_over_peak_reserved": (R, lambda c, v, i: close(
        v, mem(c, "allocated_peak_bytes") / mem(c, "reserved_peak_bytes") if mem(c, "reserved_peak_bytes") else 1.0,
        "peak allocated / peak reserved") or need(v <= 1.0, f"{v} > 1: reserved peak below allocated peak")),
    # issue 26: each step's peaks over its own (a step of the demo always holds its weights, so every
    # step is measured); the reserve at its peak: at most the reserved peak, at least what the
    # allocated peak leaves of it (the first allocation that saw the peak was at most that live)
    "fragmentation.step_allocated_over_reserved.steps": (T, lambda c, v, i: eq(v, c.r["steps"], "the epoch's steps")),
    "fragmentation.step_allocated_over_reserved.min": (R, lambda c, v, i: need(
        0 < v <= c.r["fragmentation"]["step_allocated_over_reserved"]["median"], f"{v}: not in (0, median]")),
    "fragmentation.step_allocated_over_reserved.median": (R, lambda c, v, i: need(
        v <= c.r["fragmentation"]["step_allocated_over_reserved"]["max"], f"{v} above the max")),
    "fragmentation.step_allocated_over_reserved.max": (R, lambda c, v, i: need(v <= 1.0, f"{v} > 1: a step's "
                                                                                    "allocated peak above its reserved")),
    "fragmentation.reserved_minus_allocated_at_peak_bytes": (R, lambda c, v, i: need(
        max(0, mem(c, "reserved_peak_bytes") - mem(c, "allocated_peak_bytes")) <= v <= mem(c, "reserved_peak_bytes"),
        f"not in [reserved peak - allocated peak, reserved peak] = [{mem(c, 'reserved_peak_bytes')} - "
        f"{mem(c, 'allocated_peak_bytes')}, {mem(c, 'reserved_peak_bytes')}]")),
    # operations (cumulative): counts from the trace, driver work from the driver's call counters
    "operations.allocs": (T, lambda c, v, i: eq(v, c.g["allocs"], "allocations in the trace")),
    "operations.frees": (T, lambda c, v, i: eq(v, c.g["frees"], "frees in the trace")
                         or eq(ops(c, "allocs") - v, mem(c, "live_blocks"), "allocs - frees vs live blocks")),
    "operations.alloc_failures": (T, check_failures),
    "operations.map_ops": (T, lambda c, v, i: eq(v, c.s["calls_cuMemMap"], "driver: cuMemMap calls")),
    # one cuMemUnmap per handle (a handle is one page or more): pages counted by the pool as
    # reclaimed or released are at most the bytes the driver unmapped (the rest were re-partitioned)
    "operations.unmap_ops": (T, lambda c, v, i: eq(v, c.s["calls_cuMemUnmap"], "driver: cuMemUnmap calls")
                             or need((ops(c, "reclaimed_pages") + ops(c, "released_pages")) * GRAN <= c.s["unmapped_total"],
                                     f"reclaimed + released pages > {c.s['unmapped_total']} bytes the driver unmapped")
                             or need(v <= c.s["unmapped_total"] // GRAN, "more unmaps than pages unmapped")),
    "operations.create_ops": (T, lambda c, v, i: (eq(v, c.s["calls_cuMemCreate"], "driver: cuMemCreate calls")
                                                  if not c.run["cfg"].get("cap") else
                                                  need(v <= c.s["calls_cuMemCreate"], "more than the driver's calls"))
                              or eq(v - ops(c, "release_ops"), c.s["handles"], "creates - releases vs driver handles")),
    "operations.release_ops": (T, lambda c, v, i: eq(v, c.s["calls_cuMemRelease"], "driver: cuMemRelease calls")),
    # reclaim unmaps handles under pressure; without a limit or a small device there is none
    "operations.reclaimed_pages": (T, lambda c, v, i: need(v * GRAN <= c.s["unmapped_total"], "more than the driver unmapped")
                                   or (eq(v, 0, "no limit and a large device: nothing to reclaim for")
                                       if not c.run["limit"] and not c.run["cfg"].get("cap") else None)),
    "operations.released_pages": (R, check_released_pages),
    "operations.cross_stream_waits": (T, lambda c, v, i: eq(v, c.s["calls_cuStreamWaitEvent"], "driver: cuStreamWaitEvent calls")),
    # the pool's streams, learned step and threads (issue 10)
    # a reuse on another stream waits for 1 to 4 old streams, or for none when a query found
    # their events complete (issue 15)
    "operations.cross_stream_reuses": (R, lambda c, v, i: need(
        ops(c, "cross_stream_waits") <= 4 * v, f"{v} reuses on another stream but {ops(c, 'cross_stream_waits')} "
        "stream waits (each waits for at most 4 old streams)") or need(v <= ops(c, "allocs"), f"{v} > allocs")),
    "operations.free_event_records": (T, lambda c, v, i: eq(v + ops(c, "reuse_event_records"), c.s["calls_cuEventRecord"],
                                                            "free + reuse event records vs driver: cuEventRecord calls")),
    # issue 15: nothing is recorded at reuse time any more
    "operations.reuse_event_records": (R, lambda c, v, i: eq(v, 0, "events recorded at reuse time")),
    "operations.event_queries": (T, lambda c, v, i: eq(v, c.s["calls_cuEventQuery"], "driver: cuEventQuery calls")),
    "operations.demand_records": (R, lambda c, v, i: need(v <= ops(c, "free_event_records"),
                                                          f"{v} > free_event_records {ops(c, 'free_event_records')}")),
    "operations.fresh_placements": (R, lambda c, v, i: need(v <= ops(c, "allocs"), f"{v} > allocs")),
    # no workload here captures a CUDA graph
    "operations.capture_deferrals": (R, lambda c, v, i: eq(v, 0, "no capture in these runs")),
    "operations.parked_frees": (R, lambda c, v, i: eq(v, 0, "no capture in these runs")),
    "operations.plans_built": (R, lambda c, v, i: need(16 * v <= ops(c, "allocs"), f"{v} plans of 16+ allocations each "
                                                       f"from {ops(c, 'allocs')} allocations")),
    "operations.plan_placed": (R, lambda c, v, i: need(v <= ops(c, "allocs"), f"{v} > allocs")
                               or need(v == 0 or ops(c, "plans_built") > 0, f"{v} placed by a plan, but no plan built")),
    "operations.plan_dropped": (R, lambda c, v, i: need(v <= ops(c, "plans_built"), f"{v} plans dropped of {ops(c, 'plans_built')} built")),
    # the front end (issue 30): in segment mode every block is cudaMalloc's, host-synchronous, never
    # binned; otherwise the relations that define the figures
    **{f"front.{k}": (R, check_front(k)) for k in (
        "hits", "misses", "puts", "drains", "drained_blocks", "grown_instead_of_draining",
        "grown_instead_of_draining_bytes", "double_frees", "binned_bytes", "binned_blocks", "peak_binned_bytes")},
    "operations.lock_waits": (T, lambda c, v, i: eq(v, 0, "one thread allocates: it never waits for another's mapping")),
    "operations.handles": (T, lambda c, v, i: eq(v, c.s["handles"], "driver: live handles")
                           or eq(v, ops(c, "create_ops") - ops(c, "release_ops"), "creates - releases")),
    "operations.alloc_mean_ns": (R, lambda c, v, i: need(
        (v > 0) == (ops(c, "allocs") > 0) and v * ops(c, "allocs") <= c.r["t_end_s"] * 1e9,
        f"{v} ns x {ops(c, 'allocs')} allocs: not positive or longer than the run so far")),
    "operations.free_mean_ns": (R, lambda c, v, i: need(
        (v > 0) == (ops(c, "frees") > 0) and v * ops(c, "frees") <= c.r["t_end_s"] * 1e9,
        f"{v} ns x {ops(c, 'frees')} frees: not positive or longer than the run so far")),
    "size_histogram[].lt_bytes": (T, lambda c, v, i: eq(v, 512 << i[0], "bucket i ends at 512 << i")
                                  or eq(len(c.r["size_histogram"]), 24, "24 buckets")),
    "size_histogram[].count": (T, lambda c, v, i: eq(v, c.g["hist"][i[0]], "allocations of that size in the trace")),
    "oom.oom_events": (R, lambda c, v, i: eq(v, ops(c, "alloc_failures"), "each failed request is one OOM event")),
    "oom.rescued_by_reclaim": (R, lambda c, v, i: need(v <= min(ops(c, "allocs"), ops(c, "reclaimed_pages")),
                                                       f"{v} > allocs or reclaimed pages")
                               or (eq(v, 0, "no limit, no reclaim") if not c.run["limit"] and not c.run["cfg"].get("cap") else None)),
    "oom.rescued_by_gc": (T, lambda c, v, i: eq(v, 0, "a C program: no GC callback, no Python")),
    "oom.rescued_by_empty_cache": (R, lambda c, v, i: need(v <= ops(c, "allocs"), f"{v} > allocs")
                                   or (eq(v, 0, "the driver never refused memory and reclaim is on")
                                       if not c.run["cfg"].get("cap") and c.run["cfg"].get("env", {}).get("MEMSHIM_DEFRAG") != "0"
                                       else eq(v, 0, "MEMSHIM_EMPTY_CACHE=never") if c.run["ec"] == "never" else None)),
    "last_oom.requested_bytes": (R, lambda c, v, i: check_oom_requested(c, v, i) or last_oom_same(c, v, i, "requested_bytes")),
    "last_oom.device_total_bytes": (T, lambda c, v, i: eq(v, c.run["cap"], "CUDBL_CAPACITY")),
    "last_oom.device_free_bytes": (T, lambda c, v, i: eq(v, mem(c, "device_free_bytes"), "same moment as the report")
                                   if c.r["kind"] == "oom" else last_oom_same(c, v, i, "device_free_bytes")),
    "last_oom.live_bytes": (T, lambda c, v, i: eq(v, c.g["alloc"], "trace at the failure") if c.r["kind"] == "oom"
                            else (last_oom_same(c, v, i, "live_bytes") or need(v <= mem(c, "allocated_run_peak_bytes"), "> run peak"))),
    "last_oom.reserved_bytes": (T, lambda c, v, i: eq(v, c.s["handle"], "driver handle bytes at the failure")
                                if c.r["kind"] == "oom" else
                                (last_oom_same(c, v, i, "reserved_bytes") or need(v <= mem(c, "reserved_run_peak_bytes"), "> run peak"))),
    "last_oom.limit_bytes": (T, lambda c, v, i: eq(v, c.run["limit"] // GRAN * GRAN, "MEMSHIM_LIMIT in whole pages")),
    "last_oom.largest_free_extent_bytes": (T, lambda c, v, i: eq(v, mem(c, "largest_free_extent_bytes"), "same moment")
                                           if c.r["kind"] == "oom" else last_oom_same(c, v, i, "largest_free_extent_bytes")),
    "last_oom.largest_live_blocks[].bytes": (T, check_top_bytes),
    "last_oom.cached_bytes": (R, check_oom_cached),
    "policies.empty_cache_runs": (T, check_ec_runs),
    "policies.empty_cache_released_bytes": (R, check_ec_bytes),
    "policies.gc_runs": (T, lambda c, v, i: eq(v, 0, "a C program: no GC callback, no Python")),
    "policies.gc_skipped_no_gil": (T, lambda c, v, i: eq(v, 0, "a C program: no Python")),
    "trend.epoch_end_allocated_bytes[]": (T, check_trend),
    # schema 2
    **{f"driver.calls.{k}": (T, check_driver_calls(k)) for k in DRIVER_CALLS},
    # MEMSHIM_SPILL is off in these runs (its figures against the double: tests/unit/test_spill.c,
    # tests/replay/test_spill_replay.py): nothing may have moved
    **{f"driver.calls.{k}": (T, lambda c, v, i, k=k: eq(v, 0, f"{k}: MEMSHIM_SPILL is off"))
       for k in ("host_create", "copy_to_host", "copy_to_device")},
    "oom.rescued_by_spill": (T, lambda c, v, i: eq(v, 0, "MEMSHIM_SPILL is off")),
    **{f"spill.{k}": (T, lambda c, v, i, k=k: eq(v, 0, f"{k}: MEMSHIM_SPILL is off"))
       for k in ("spilled_bytes", "spilled_peak_bytes", "spilled_run_peak_bytes", "pages_to_host", "pages_to_device",
                 "bytes_to_host", "bytes_to_device", "seconds_moving", "requests_refused", "unattributed_host_bytes")},
    **{f"spill.sites[].{k}": (T, lambda c, v, i, k=k: f"spill.sites[].{k}: {v}, but nothing is spilled")
       for k in ("line", "host_bytes", "blocks")},
    "driver.modelled_seconds": (R, check_modelled_seconds),
    **{f"latency.alloc_ns.{f}": e for f, e in check_latency("alloc_ns").items()},
    **{f"latency.free_ns.{f}": e for f, e in check_latency("free_ns").items()},
    "sites[].bytes": (T, check_site("bytes")),
    "sites[].count": (T, check_site("count")),
    "sites[].line": (T, check_site("line")),
    "trend.growing_sites[].growth_bytes_per_epoch": (T, check_growing("growth_bytes_per_epoch")),
    "trend.growing_sites[].line": (T, check_growing("line")),
    "torch_memory_stats.*": (R, check_torch_stat),
    # issue 24: memshim_overhead (the function's name is part of a driver_calls path: run_report
    # hands it to the check)
    "memshim_overhead.driver_calls.*.count": (T, check_overhead_call("count")),
    "memshim_overhead.driver_calls.*.seconds": (R, check_overhead_call("seconds")),
    "memshim_overhead.driver_seconds": (R, lambda c, v, i: close(
        v, sum(x["seconds"] for x in c.r["memshim_overhead"]["driver_calls"].values()), "the calls' seconds added up",
        tol=1e-9)),
    **{f"memshim_overhead.synchronizes.{k}.{f}": (R, check_overhead_sync(k, f))
       for k in ("device", "context", "stream", "event") for f in ("count", "seconds")},
    **{f"memshim_overhead.alloc_path_ns.{f}": (R, lambda c, v, i, f=f: eq(v, c.r["latency"]["alloc_ns"][f],
                                                                          f"latency.alloc_ns.{f}"))
       for f in ("count", "p50", "p90", "p99", "max")},
    **{f"memshim_overhead.free_path_ns.{f}": (R, lambda c, v, i, f=f: eq(v, c.r["latency"]["free_ns"][f],
                                                                         f"latency.free_ns.{f}"))
       for f in ("count", "p50", "p90", "p99", "max")},
    "memshim_overhead.path_seconds": (R, check_overhead_path),
    # the share of the allocating threads' wall time (issue 30): the demo allocates on one thread
    "memshim_overhead.threads": (R, lambda c, v, i: eq(v, 1 if c.r["latency"]["alloc_ns"]["count"] else 0,
                                                       "one thread (the demo's) timed, when any call was")),
    "memshim_overhead.share_of_wall": (R, lambda c, v, i: close(
        v, c.r["memshim_overhead"]["path_seconds"] / overhead_wall(c) / max(1, c.r["memshim_overhead"]["threads"]),
        "path_seconds / (the wall time covered x the threads timed)", tol=1e-9)),
}
# Declared fields that these runs cannot produce (no failure when never seen): PyTorch's own
# memory_stats() exist only in segment mode once PyTorch initialized CUDA (a GPU).
OPTIONAL = {"local_rank", "world_size", "node_rank", "restart",  # null unless a launcher sets them (above)
            "torch_memory_stats.*", "spill.sites[].line", "spill.sites[].host_bytes", "spill.sites[].blocks"}  # spill.sites: only with spill on (test_spill_job.py)


def numeric_leaves(obj, path="", idx=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if path == "" and k == "config":
                continue  # option values are strings (the effective configuration), not figures
            yield from numeric_leaves(v, f"{path}.{k}" if path else k, idx)
    elif isinstance(obj, list):
        for n, v in enumerate(obj):
            yield from numeric_leaves(v, path + "[]", idx + (n,))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, idx, obj


class Ctx:
    pass


DEMO_LINE = re.compile(r"^epoch (\d+): peak live +([\d.]+) MiB, reserved +([\d.]+) MiB \(peak +([\d.]+) MiB, "
                       r"[\d.]+x live\), maps (\d+), unmaps (\d+), reclaimed pages (\d+), OOMs (\d+)$", re.M)


def check_demo_lines(run, rows):
    """The demo prints memshim_get_stats() (the public C API) just before it closes each epoch;
    where every epoch is closed by the demo (manual epochs), line k and epoch report k describe
    the same moment."""
    eps = [r for _, r, _, _ in rows if r["kind"] == "epoch"]
    lines = DEMO_LINE.findall(run["stdout"])
    if not lines or any(r["reason"] != "manual" for r in eps) or len(lines) != len(eps):
        return None
    bad = []
    # MEMSHIM_EMPTY_CACHE=epoch releases pages between the print and the report: the current
    # reserved bytes and the unmaps differ there by design, the peaks do not.
    released_between = run["ec"] == "epoch"
    for (k, pl, res, pres, maps, unmaps, recl, ooms), r in zip(lines, eps):
        m, o = r["memory"], r["operations"]
        for what, printed, want in (("peak live", float(pl), m["allocated_peak_bytes"] / MiB),
                                    ("reserved", float(res), None if released_between else m["reserved_bytes"] / MiB),
                                    ("peak reserved", float(pres), m["reserved_peak_bytes"] / MiB)):
            if want is not None and abs(printed - want) > 0.051:
                bad.append(f"epoch {k} {what}: memshim_get_stats {printed} MiB, report {want:.2f} MiB")
        for what, printed, want in (("maps", maps, o["map_ops"]),
                                    ("unmaps", unmaps, None if released_between else o["unmap_ops"]),
                                    ("reclaimed pages", recl, o["reclaimed_pages"]),
                                    ("OOMs", ooms, r["oom"]["oom_events"])):
            if want is not None and int(printed) != want:
                bad.append(f"epoch {k} {what}: memshim_get_stats {printed}, report {want}")
    return bad


def check_policy(run, rows):
    """What each empty-cache policy promises, on the driver's own figures at every report."""
    ec, env, bad = run["ec"], run["cfg"].get("env", {}), []
    for name, r, g, s in rows:
        if s is None:
            continue
        cached = s["mapped"] - g["touched"]  # mapped pages no live block touches
        idle = g["idle_handle_bytes"]  # of those, the ones in handles no live block touches
        # Every policy but never: when the driver itself refuses memory, or reclaim is off
        # (MEMSHIM_DEFRAG=0), cached pages go back to the driver and the request is retried before
        # it fails, so no request fails beside cached pages.
        full = run["cap"] - s["bytes_in_use"] < GRAN or env.get("MEMSHIM_DEFRAG") == "0"
        if ec != "never" and r["kind"] == "oom" and full and cached:
            bad.append(f"{name}: a request failed ({'reclaim off' if env.get('MEMSHIM_DEFRAG') == '0' else 'driver full'})"
                       f" with {cached} cached bytes not given back")
        if env.get("MEMSHIM_DEFRAG") == "0" and (r["operations"]["reclaimed_pages"] or r["oom"]["rescued_by_reclaim"]):
            bad.append(f"{name}: pages reclaimed with MEMSHIM_DEFRAG=0")
        # threshold: the run is quiet for longer than the policy's quiet period (1 s) before each
        # epoch report, so the handles no live block touches must be down to the threshold by then
        # (a handle goes back whole: free pages of one that still holds a live block stay).
        # The summary comes right after the last frees, before any quiet period: not checked.
        thr = int(env.get("MEMSHIM_EMPTY_CACHE_THRESHOLD", "0").rstrip("M")) * MiB
        if ec == "threshold" and r["kind"] == "epoch" and idle > thr:
            bad.append(f"{name}: {idle} bytes in handles no live block touches, above the threshold after a "
                       f"quiet period ({cached} free bytes in mapped pages in all)")
        if ec == "epoch" and r["kind"] == "epoch" and idle:
            bad.append(f"{name}: {idle} bytes in handles no live block touches right after the epoch's empty-cache")
        if ec == "never" and s["calls_cuMemRelease"]:
            bad.append(f"{name}: {s['calls_cuMemRelease']} handles released under MEMSHIM_EMPTY_CACHE=never")
    return bad


def check_run(run, seen, differ):
    cfg = run["cfg"]["name"]
    ok = run["rc"] == 0 and "finished" in run["stdout"] and run["reports"] and run["events"]
    case(f"{cfg}: the demo ran under memshim ({len(run['reports'])} reports, {len(run['events'])} trace events)",
         ok, (run["stdout"] + run["stderr"])[-400:])
    if not ok:
        return
    rows = ground_truth(run)
    kinds = [r["kind"] for _, r, _, _ in rows]
    case(f"{cfg}: the last report is the summary and no trace event comes after it",
         kinds[-1] == "summary" and run["trailing_events"] == 0, (kinds, run["trailing_events"]))
    failures = rows[-1][1]["operations"]["alloc_failures"]
    case(f"{cfg}: one OOM report per failed request, at most {OOM_REPORTS_MAX} ({failures} failures)",
         kinds.count("oom") == min(failures, OOM_REPORTS_MAX), f"{kinds.count('oom')} OOM reports")
    if run["site_seq"] is None:
        bad = [n for n, r, _, _ in rows if r.get("sites") != [] or not r.get("sites_note")]
        case(f"{cfg}: no allocation sites in a process without Python, and a note that says why", not bad, bad[:3])
    bad = check_demo_lines(run, rows)
    if bad is not None:
        case(f"{cfg}: memshim_get_stats as the demo prints it matches each epoch report", not bad, "; ".join(bad[:6]))
    bad = check_policy(run, rows)
    case(f"{cfg}: MEMSHIM_EMPTY_CACHE={run['ec']} keeps its promise at every report", not bad, "; ".join(bad[:6]))
    # MEMSHIM_FRONT (issue 30): 0 keeps every block out of the bins; on, the demo's pluggable
    # allocations (activations freed on their own stream, steps repeating) are served from them
    fronts = [(r["front"]["state"], r["front"]["hits"], r["front"]["puts"]) for _, r, _, _ in rows]
    if run["cfg"].get("front"):
        case(f"{cfg}: MEMSHIM_FRONT on: the front end serves the repeated steps (hits and puts in the summary)",
             fronts[-1][0] == "on" and fronts[-1][1] > 0 and fronts[-1][2] > 0, fronts[-1])
    else:
        case(f"{cfg}: MEMSHIM_FRONT=0: the front end is off in every report, nothing binned",
             all(f == ("off", 0, 0) for f in fronts), fronts[:3])
    if "rescue" in cfg:  # the run is sized so that giving cached pages back saves requests
        case(f"{cfg}: the empty-cache rescue ran and saved requests",
             rows[-1][1]["oom"]["rescued_by_empty_cache"] > 0, rows[-1][1]["oom"])
    prev = []
    for name, rep, g, s in rows:
        if rep["kind"] == "epoch":
            m = rep["memory"]
            differ["epochs"] += 1
            differ["reserved"] += m["reserved_peak_bytes"] != m["reserved_bytes"]
            differ["allocated"] += m["allocated_peak_bytes"] != m["allocated_bytes"]
        label = f"{cfg}: {rep['kind']} {rep.get('oom_index', rep['epoch'])} ({name.split('-dev0-')[-1]})"
        if s is None:
            case(label, False, "libreport-spy.so recorded nothing when this report was renamed into place")
            prev.append(rep)
            continue
        c = Ctx()
        c.r, c.g, c.s, c.run, c.prev, c.name = rep, g, s, run, list(prev), name
        bad, n = [], 0
        for path, idx, v in numeric_leaves(rep):
            n += 1
            entry = FIELDS.get(path)
            if entry is None and path.startswith("torch_memory_stats."):
                entry = FIELDS["torch_memory_stats.*"]
                path_for = path
                entry = (entry[0], lambda c, v, i, _p=path_for: check_torch_stat(c, v, i, _p))
                seen.add("torch_memory_stats.*")
            if entry is None and path.startswith("memshim_overhead.driver_calls."):
                star = "memshim_overhead.driver_calls.*." + path.rsplit(".", 1)[1]
                entry = FIELDS.get(star)
                if entry is not None:  # the function's name is part of the path: the check reads it
                    seen.add(star)
                    entry = (entry[0], lambda c, v, i, _e=entry[1], _p=path: _e(c, v, i, _p))
            if entry is None:
                bad.append(f"{path}: a numeric field with no declared check (add it to FIELDS in "
                           f"tests/reports/test_report_truth.py)")
                continue
            if path in FIELDS:  # a wildcard's concrete paths were counted under the wildcard
                seen.add(path)
            try:
                why = entry[1](c, v, idx)
            except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
                why = f"the check could not be evaluated: {type(e).__name__}: {e}"
            if why:
                bad.append(f"{path}{list(idx) if idx else ''} = {v}: {why}")
        if "last_oom" in rep:  # a string, beside the numbers it follows from (issue 25)
            why = check_oom_case(c, rep["last_oom"].get("case"), ())
            if why:
                bad.append(f"last_oom.case = {rep['last_oom'].get('case')}: {why}")
        case(f"{label}: all {n} numeric fields match", not bad, "; ".join(bad[:8]) + (
            f"; and {len(bad) - 8} more" if len(bad) > 8 else ""))
        prev.append(rep)


def main():
    for exe in (DEMO, LIB):
        if not os.path.exists(exe):
            case("built", False, f"{exe} missing (make)")
            finish()
    err = build_spy()
    case("libreport-spy.so builds", err is None, err)
    if err:
        finish()
    seen, differ = set(), {"epochs": 0, "reserved": 0, "allocated": 0}
    with tempfile.TemporaryDirectory(prefix="memshim-truth-") as tmp:
        for cfg in RUNS:
            step(f"demo run '{cfg['name']}' and its reports")
            check_run(run_demo(cfg, tmp), seen, differ)
    # A peak that reads the current figure hides where peak == current: the runs must give plenty
    # of epochs where they differ, or the checks above prove nothing about peaks.
    case(f"peaks differ from currents in the runs: reserved in {differ['reserved']}, allocated in "
         f"{differ['allocated']} of {differ['epochs']} epoch reports",
         differ["reserved"] >= 5 and differ["allocated"] >= 5, differ)
    missing = sorted(set(FIELDS) - seen - OPTIONAL)
    case(f"every declared field appeared in some report ({len(seen)} of {len(FIELDS)} fields; "
         f"{sum(1 for k in seen if FIELDS[k][0] == 'truth')} against ground truth, "
         f"{sum(1 for k in seen if FIELDS[k][0] == 'relation')} by relations)", not missing, missing)
    finish()


main()
