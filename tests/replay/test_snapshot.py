#!/usr/bin/env python3
"""PyTorch memory snapshots written by memshim (MEMSHIM_SNAPSHOT, and torch.cuda.memory's history
API through hooks/python/memshim/_history.py), in real CPython processes over the CUDA driver
double. The file is read the way users read it: with an unpickler that refuses every class, by
torch.cuda._memory_viz's own functions (segsum, trace, trace_plot, segment_plot; pure Python,
run on CPU), by a port of the replay that pytorch.org/memory_viz's JavaScript performs (every
event index must leave each live block inside a segment, or the viewer fails), and by
memshim-replay; figures are compared with memshim's own reports. Ends with
"N passed, N failed, N skipped"."""
import base64
import glob
import io
import json
import os
import pickle
import re
import stat
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyharness import BUILD, ROOT, TRACES, case, finish, skip  # noqa: E402
from schema_check import report_problems  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
HISTORY_PY = os.path.join(ROOT, "hooks", "python", "memshim", "_history.py")
MiB = 1 << 20

# What PyTorch 2.15 writes (torch/csrc/cuda/Module.cpp, memory_snapshot.cpp; the strings in
# libtorch_python.so): the keys every snapshot dict carries.
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
EVENT_KEYS = {"action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata", "frames"}
SETTINGS_KEYS = {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold", "expandable_segments",
                 "pinned_num_register_threads", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                 "graph_capture_record_stream_reuse", "roundup_power2_divisions"}


class Refuse(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def load(path):
    with open(path, "rb") as f:
        return Refuse(f).load()


PRELUDE = r"""
import ctypes, os, sys
lib = (ctypes.PyDLL if os.environ.get("GIL", "held") == "held" else ctypes.CDLL)(os.environ["LIB"])
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
MiB = 1 << 20
"""

# Three epochs of a training-like pattern: weights kept, activations allocated and freed, a
# growing cache; blocks still live at exit.
JOB = PRELUDE + r"""
def weights():
    return [(lib.memshim_malloc(n, 0, None), n) for n in (6 * MiB, 6 * MiB, 300 * 1024)]  # SITE-W
def forward(n):
    return [(lib.memshim_malloc((i % 5 + 1) * 384 * 1024 + i * 512, 0, None), (i % 5 + 1) * 384 * 1024 + i * 512)
            for i in range(n)]  # SITE-ACT
w = weights()
cache = []
for epoch in range(3):
    acts = forward(30)
    cache.append(lib.memshim_malloc(2 * MiB + 4096, 0, None))
    for p, n in reversed(acts[10:]):
        lib.memshim_free(p, n, 0, None)
    more = forward(6)
    for p, n in acts[:10] + more:
        lib.memshim_free(p, n, 0, None)
    lib.memshim_epoch()
"""


def run(src, tmp, name, env_extra=None, timeout=180):
    rdir = os.path.join(tmp, name + "-rep")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and k not in ("RANK", "LOCAL_RANK")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "8G", "MEMSHIM_REPORT_DIR": rdir,
                "MEMSHIM_LOG": "warn", "LIB": LIB, "HISTORY_PY": HISTORY_PY, "MEMSHIM_SITES_SAMPLE": "0"})
    env.update(env_extra or {})
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(src)
    p = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    p.reports = []
    for fn in sorted(glob.glob(os.path.join(rdir, "*.json"))):
        with open(fn) as fh:
            p.reports.append(json.load(fh))
    p.summary = next((r for r in p.reports if r["kind"] == "summary"), None)
    p.path = path
    return p


# ---- a port of what pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js) does with a snapshot ----

def viewer_annotate(trace):
    out = []
    for t in trace:
        t = dict(t)
        if t["action"] == "free_completed" and out and out[-1]["action"] == "free_requested" \
                and out[-1]["addr"] == t["addr"]:
            out[-1]["action"] = "free"
            continue
        out.append(t)
    return out


def viewer_segment_view(snap, device):
    """Allocator State History: rewind from the snapshot to every event; each live block must lie in
    a segment (MemoryView.draw's find_segment) and every undo must find what it touches. Returns
    the first problem, or None."""
    segs = sorted(({"addr": s["address"], "size": s["total_size"], "stream": s["stream"]}
                   for s in snap["segments"] if s["device"] == device), key=lambda s: s["addr"])
    blocks = {}
    for s in snap["segments"]:
        if s["device"] != device:
            continue
        a = s["address"]
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[a] = {"size": b["size"], "free_requested": b["state"] == "active_pending_free"}
            a += b["size"]
    events = viewer_annotate(snap["device_traces"][device]) if device < len(snap["device_traces"]) else []

    def find(addr):
        for s in segs:
            if s["addr"] <= addr < s["addr"] + s["size"]:
                return s
        return None

    def check(idx):
        for a in blocks:
            if find(a) is None:
                return f"at event {idx}: block {a:#x} is in no segment"
        return None

    problem = check(len(events) - 1)
    for i in range(len(events) - 1, 0, -1):
        e = events[i]
        act, addr, size = e["action"], e.get("addr"), e.get("size")
        if act in ("free", "free_completed"):
            blocks[addr] = {"size": size, "free_requested": act == "free_completed"}
        elif act == "free_requested":
            if addr not in blocks:
                return f"at event {i}: free_requested of {addr:#x}, not a block"
            blocks[addr]["free_requested"] = False
        elif act == "alloc":
            blocks.pop(addr, None)
        elif act == "segment_unmap":  # undo: map it back, merging with neighbours
            j = next((k for k, s in enumerate(segs) if s["addr"] > addr), len(segs))
            segs.insert(j, {"addr": addr, "size": size, "stream": e["stream"]})
            if j + 1 < len(segs) and addr + size == segs[j + 1]["addr"] and segs[j + 1]["stream"] == e["stream"]:
                segs[j]["size"] += segs.pop(j + 1)["size"]
            if j > 0 and segs[j - 1]["addr"] + segs[j - 1]["size"] == addr and segs[j - 1]["stream"] == e["stream"]:
                segs[j - 1]["size"] += segs.pop(j)["size"]
        elif act == "segment_map":  # undo: cut it out of the segment that holds it
            end = addr + size
            k = next((k for k, s in enumerate(segs) if s["addr"] <= addr and end <= s["addr"] + s["size"]), None)
            if k is None:
                return f"at event {i}: segment_map of {addr:#x} is in no segment"
            ex = segs[k]
            ex_end = ex["addr"] + ex["size"]
            if ex["addr"] == addr:
                ex["addr"] += size
                ex["size"] -= size
                if ex["size"] == 0:
                    segs.pop(k)
            elif ex_end == end:
                ex["size"] -= size
            else:
                ex["size"] = addr - ex["addr"]
                segs.insert(k + 1, {"addr": end, "size": ex_end - end, "stream": ex["stream"]})
        problem = problem or check(i - 1)
        if problem:
            return problem
    return problem


def viewer_timeline(snap, device):
    """Active Memory Timeline (process_alloc_data): (bytes live at the end, the largest total)."""
    elements, initially, actions, addr_to = [], [], [], {}
    for e in viewer_annotate(snap["device_traces"][device]):
        if e["action"] == "alloc":
            elements.append(e["size"])
            addr_to[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif e["action"] in ("free", "free_completed"):
            if e["addr"] in addr_to:
                actions.append(addr_to.pop(e["addr"]))
            else:
                elements.append(e["size"])
                initially.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for s in snap["segments"]:
        if s["device"] != device:
            continue
        a = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated" and a not in addr_to:
                elements.append(b["requested_size"])
                initially.append(len(elements) - 1)
            a += b["size"]
    current = set(initially)
    total = sum(elements[i] for i in current)
    peak = total
    for el in actions:
        if el in current:
            current.discard(el)
            total -= elements[el]
        else:
            current.add(el)
            total += elements[el]
        peak = max(peak, total)
    return total, peak


def html_snapshot(html):
    m = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', html)
    return Refuse(io.BytesIO(base64.b64decode(m.group(1)))).load() if m else None


try:
    from torch.cuda import _memory_viz as mv
except Exception as exc:  # noqa: BLE001
    mv = None
    mv_why = f"torch.cuda._memory_viz unavailable ({type(exc).__name__})"

with tempfile.TemporaryDirectory(prefix="memshim-snapshot-") as tmp:
    p = run(JOB, tmp, "job", {"MEMSHIM_SNAPSHOT": os.path.join(tmp, "snap-%p.pickle")})
    files = glob.glob(os.path.join(tmp, "snap-*.pickle"))
    case("MEMSHIM_SNAPSHOT=snap-%p.pickle: the job runs and writes one snapshot at exit (pid expanded)",
         p.returncode == 0 and len(files) == 1 and re.search(r"snap-\d+\.pickle$", files[0]), (files, p.stderr[-300:]))
    case("the snapshot file is mode 0600 (stack frames show the job's code paths) and no temp file is left",
         files and stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600 and not glob.glob(os.path.join(tmp, "*.tmp*")))
    snap = load(files[0]) if files else {}
    raw = open(files[0], "rb").read() if files else b""
    case("pickle protocol 4, loads with an unpickler that refuses every class", raw[:2] == b"\x80\x04" and snap)
    s = p.summary
    if not snap or not s:
        finish()
    case("top level as PyTorch writes it: segments, device_traces, allocator_settings, external_annotations",
         set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}, list(snap))
    segs, ev = snap["segments"], snap["device_traces"][0]
    case("every segment and block carries PyTorch's keys", segs and all(set(g) == SEGMENT_KEYS for g in segs)
         and all(set(b) == BLOCK_KEYS for g in segs for b in g["blocks"]), [set(g) for g in segs][:1])
    case("every event carries PyTorch's keys (oom: device_free instead of addr)", ev and all(
        set(e) == (EVENT_KEYS - {"addr"} | {"device_free"} if e["action"] == "oom" else EVENT_KEYS) for e in ev))
    case("allocator_settings has PyTorch's keys (and memshim's own settings under 'memshim')",
         SETTINGS_KEYS <= set(snap["allocator_settings"]) and
         snap["allocator_settings"]["memshim"]["MEMSHIM_SNAPSHOT"].endswith("snap-%p.pickle"),
         sorted(snap["allocator_settings"]))
    st = snap["allocator_settings"]
    want = {"max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": False,
            "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False}
    case("allocator_settings: PyTorch's defaults for what memshim does not change (False as a bool)",
         all(type(st.get(k)) is type(v) and st.get(k) == v for k, v in want.items()),
         {k: st.get(k) for k in want})
    acts = {e["action"] for e in ev}
    case("device_traces has alloc, free_requested, free_completed, segment_map and snapshot entries",
         {"alloc", "free_requested", "free_completed", "segment_map", "snapshot"} <= acts, acts)
    wline = next(i + 1 for i, l in enumerate(JOB.splitlines()) if "SITE-W" in l)
    first = next((e for e in ev if e["action"] == "alloc"), {})
    case("alloc frames come from the sites: innermost first, the weights() line",
         first.get("frames") and first["frames"][0]["filename"] == p.path and first["frames"][0]["line"] == wline
         and first["frames"][0]["name"] in ("weights", "<listcomp>", "weights.<locals>.<listcomp>"), first.get("frames"))
    live_blocks = [b for g in segs for b in g["blocks"] if b["state"] == "active_allocated"]
    case("live blocks at exit carry their allocation frames", live_blocks and all(b["frames"] for b in live_blocks))
    tiled = all(sum(b["size"] for b in g["blocks"]) == g["total_size"] and g["blocks"][0]["address"] == g["address"]
                for g in segs)
    case("blocks tile each segment exactly (what segsum asserts)", tiled)
    case("segments = memshim's mapped memory at exit, live blocks = its allocated bytes (summary report)",
         sum(g["total_size"] for g in segs) == s["memory"]["reserved_bytes"]
         and sum(b["requested_size"] for b in live_blocks) == s["memory"]["allocated_bytes"],
         (sum(g["total_size"] for g in segs), s["memory"]["reserved_bytes"]))

    if mv is None:
        skip("torch.cuda._memory_viz on memshim's snapshot", mv_why)
    else:
        out = mv.segsum(snap)
        case("_memory_viz.segsum accepts it; its total_reserved / total_allocated equal memshim's figures",
             f"total_reserved: {mv.Bytes(s['memory']['reserved_bytes'])}" in out
             and f"total_allocated: {mv.Bytes(s['memory']['allocated_bytes'])}" in out, out[-300:])
        out = mv.trace(snap)
        case("_memory_viz.trace accepts it (one entry per event)", f"{len(ev)} entries" in out, out[:200])
        h1, h2 = mv.trace_plot(snap), mv.segment_plot(snap)
        case("_memory_viz.trace_plot and segment_plot embed the snapshot unchanged",
             html_snapshot(h1) == snap and html_snapshot(h2) == snap)
        h3 = mv.trace_plot(load(files[0]), filter_freed=True)
        case("_memory_viz.trace_plot(filter_freed=True) pairs every free with a free_requested",
             html_snapshot(h3) is not None)
    prob = viewer_segment_view(snap, 0)
    case("memory_viz's Allocator State History replays back to every event (each live block in a segment)",
         prob is None, prob)
    end, peak = viewer_timeline(snap, 0)
    case("memory_viz's Active Memory Timeline: live at the end and the peak equal memshim's (summary report)",
         end == s["memory"]["allocated_bytes"] and peak == s["memory"]["allocated_run_peak_bytes"],
         (end, peak, s["memory"]["allocated_bytes"], s["memory"]["allocated_run_peak_bytes"]))
    r = subprocess.run([os.path.join(BUILD, "memshim-replay"), "--json", files[0]], capture_output=True, text=True,
                       timeout=120)
    rj = json.loads(r.stdout.splitlines()[0]) if r.returncode == 0 and r.stdout else {}
    case("memshim-replay reads it back: the same peak live bytes, and PyTorch's 'reserved' is memshim's peak mapped",
         rj.get("peak_live_bytes") == s["memory"]["allocated_run_peak_bytes"]
         and rj.get("recorded_peak_reserved_bytes") == s["memory"]["reserved_run_peak_bytes"]
         and rj.get("warnings") == 0, (rj, r.stderr[-300:]))
    bad = [(x["kind"], report_problems(x)) for x in p.reports if report_problems(x)]
    case("the job's reports match docs/report.schema.json", not bad, bad[:2])

    # a small ring: only the newest events; the window starts where the viewer can replay it
    p = run(JOB, tmp, "ring", {"MEMSHIM_SNAPSHOT": os.path.join(tmp, "ring.pickle"), "MEMSHIM_SNAPSHOT_EVENTS": "40"})
    snap = load(os.path.join(tmp, "ring.pickle")) if os.path.exists(os.path.join(tmp, "ring.pickle")) else None
    ev = snap["device_traces"][0] if snap else []
    case("MEMSHIM_SNAPSHOT_EVENTS=40: at most the newest 40 events", snap and 0 < len(ev) <= 40, len(ev))
    case("... and the viewer still replays back to every event", snap and viewer_segment_view(snap, 0) is None,
         snap and viewer_segment_view(snap, 0))
    end, _ = viewer_timeline(snap, 0) if snap else (None, None)
    case("... and what is live at the end still equals memshim's allocated bytes",
         p.summary and end == p.summary["memory"]["allocated_bytes"], (end, p.summary and p.summary["memory"]))

    # out of memory: an `oom` event and a snapshot beside the exit one; rank in the names
    OOM = PRELUDE + r"""
a = lib.memshim_malloc(40 * MiB, 0, None)
b = lib.memshim_malloc(40 * MiB, 0, None)
print("SECOND", b)
"""
    p = run(OOM, tmp, "oom", {"MEMSHIM_SNAPSHOT": os.path.join(tmp, "oomjob.pickle"), "MEMSHIM_LIMIT": "64M",
                              "RANK": "3", "MEMSHIM_LOG": "error"})
    names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(tmp, "oomjob*")))
    case("an OOM writes NAME-rankR-oom0000.pickle, exit writes NAME-rankR.pickle (RANK=3)",
         p.returncode == 0 and "SECOND None" in p.stdout and names == ["oomjob-rank3-oom0000.pickle",
                                                                        "oomjob-rank3.pickle"], (names, p.stderr[-300:]))
    if "oomjob-rank3-oom0000.pickle" in names:
        o = load(os.path.join(tmp, "oomjob-rank3-oom0000.pickle"))
        oe = [e for e in o["device_traces"][0] if e["action"] == "oom"]
        oomrep = next((x for x in p.reports if x["kind"] == "oom"), None)
        case("the OOM snapshot ends with an `oom` event: size = the request, device_free = the device's free bytes",
             len(oe) == 1 and oe[0]["size"] == 40 * MiB and oomrep is not None
             and oe[0]["device_free"] == oomrep["last_oom"]["device_free_bytes"], (oe, oomrep and oomrep["last_oom"]))
        case("... and the 40 MiB block that did fit is live in it", sum(
            b["requested_size"] for g in o["segments"] for b in g["blocks"] if b["state"] == "active_allocated")
            == 40 * MiB)
    p = run(OOM.replace("40 * MiB, 0, None)\nprint", "4 * MiB, 0, None)\nprint"), tmp, "rankr",
            {"MEMSHIM_SNAPSHOT": os.path.join(tmp, "r%r-x.pickle"), "LOCAL_RANK": "5"})
    case("%r in MEMSHIM_SNAPSHOT is the rank (no -rankR added)", os.path.exists(os.path.join(tmp, "r5-x.pickle")),
         sorted(os.listdir(tmp)))
    p = run(OOM.replace("40 * MiB, 0, None)\nprint", "4 * MiB, 0, None)\nprint"), tmp, "rank0",
            {"MEMSHIM_SNAPSHOT": os.path.join(tmp, "q%r-x.pickle")})
    case("%r in MEMSHIM_SNAPSHOT without a rank is 0",
         os.path.exists(os.path.join(tmp, "q0-x.pickle")), sorted(f for f in os.listdir(tmp) if f.startswith("q")))
    ro = os.path.join(tmp, "notadir")
    open(ro, "w").close()
    p = run(OOM.replace("40 * MiB, 0, None)\nprint", "4 * MiB, 0, None)\nprint"), tmp, "unwritable",
            {"MEMSHIM_SNAPSHOT": os.path.join(ro, "x.pickle")})
    warns = [l for l in p.stderr.splitlines() if "MEMSHIM_SNAPSHOT" in l]
    case("an unwritable MEMSHIM_SNAPSHOT: one warning naming it, the job completes",
         p.returncode == 0 and len(warns) == 1 and "SECOND" in p.stdout, p.stderr[-400:])

    # concurrency: threads allocate and free while the main thread takes snapshots
    STRESS = PRELUDE + r"""
import threading, pickle, io, random
lib.memshim_snapshot.argtypes = [ctypes.POINTER(ctypes.POINTER(ctypes.c_ubyte)), ctypes.POINTER(ctypes.c_size_t)]
lib.memshim_snapshot_free.argtypes = [ctypes.POINTER(ctypes.c_ubyte)]
lib.memshim_history_record.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int]
cl = ctypes.CDLL(os.environ["LIB"])  # the workers release the GIL, as PyTorch's operators do
cl.memshim_malloc.restype = ctypes.c_void_p
cl.memshim_malloc.argtypes = lib.memshim_malloc.argtypes
cl.memshim_free.argtypes = lib.memshim_free.argtypes
assert lib.memshim_history_record(2, 5000, 0, 1) == 0
stop = False
def worker(seed):
    r = random.Random(seed); live = []
    while not stop:
        if len(live) < 40 and r.random() < 0.6:
            n = r.choice([4096, 300 * 1024, 3 * MiB, 5 * MiB + 512])
            live.append((cl.memshim_malloc(n, 0, None), n))
        elif live:
            q, n = live.pop(r.randrange(len(live)))
            cl.memshim_free(q, n, 0, None)
    for q, n in live:
        cl.memshim_free(q, n, 0, None)
ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
for t in ts: t.start()
snaps = []
for i in range(60):
    buf = ctypes.POINTER(ctypes.c_ubyte)(); n = ctypes.c_size_t()
    assert lib.memshim_snapshot(ctypes.byref(buf), ctypes.byref(n)) == 0
    snaps.append(ctypes.string_at(buf, n.value)); lib.memshim_snapshot_free(buf)
stop = True
for t in ts: t.join()
with open(os.environ["OUT"], "wb") as f:
    pickle.dump(snaps, f)
"""
    out = os.path.join(tmp, "stress.pickles")
    p = run(STRESS, tmp, "stress", {"OUT": out}, timeout=300)
    snaps = []
    if p.returncode == 0 and os.path.exists(out):
        with open(out, "rb") as f:
            snaps = [Refuse(io.BytesIO(b)).load() for b in pickle.load(f)]
    probs = [pr for sn in snaps for pr in [viewer_segment_view(sn, 0)] if pr]
    case("60 snapshots taken while 3 threads allocate and free: every one replays in the viewer",
         len(snaps) == 60 and not probs, (len(snaps), probs[:2], p.stderr[-300:]))
    tiled = all(sum(b["size"] for b in g["blocks"]) == g["total_size"] for sn in snaps for g in sn["segments"])
    case("... and in every one the blocks tile their segments", snaps and tiled)

    # the Python side: torch.cuda.memory's history API served by memshim
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:  # noqa: BLE001
        have_torch = False
    if not have_torch:
        skip("torch.cuda.memory._record_memory_history / _snapshot / memory_snapshot / _dump_snapshot", "no torch")
    else:
        HIST = PRELUDE + r"""
import importlib.util, json, pickle, torch
spec = importlib.util.spec_from_file_location("memshim_history", os.environ["HISTORY_PY"])
h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
res = {"replaced": h.install(torch, lib)}
res["again"] = h.install(torch, lib)
mem = torch.cuda.memory
try:
    mem._record_memory_history(enabled="bogus")
except RuntimeError as e:
    res["bad_enabled"] = str(e)
def model_step():
    return lib.memshim_malloc(3 * MiB, 0, None)  # SITE-STEP
before = lib.memshim_malloc(MiB, 0, None)  # not recorded: history is off
mem._record_memory_history(max_entries=1000)
x = model_step()
lib.memshim_free(before, MiB, 0, None)
s = mem._snapshot()
res["actions"] = [e["action"] for e in s["device_traces"][0]]
res["alloc_frames"] = [e["frames"][:1] for e in s["device_traces"][0] if e["action"] == "alloc"]
res["segments_equal"] = torch.cuda.memory_snapshot() == s["segments"] == mem.memory_snapshot()
mem._dump_snapshot(os.environ["DUMP"])
mem._record_memory_history(enabled=None)
y = lib.memshim_malloc(MiB, 0, None)
res["after_stop"] = len(mem._snapshot()["device_traces"][0])
mem._record_memory_history(True, trace_alloc_max_entries=50)  # the legacy boolean API
z = lib.memshim_malloc(MiB, 0, None)
res["legacy"] = [e["action"] for e in mem._snapshot()["device_traces"][0]][-2:]
mem._record_memory_history(context=None, max_entries=100, clear_history=True)
q = lib.memshim_malloc(MiB, 0, None)
res["no_context"] = [e["frames"] for e in mem._snapshot()["device_traces"][0] if e["action"] == "alloc"]
res["torch_version"] = torch.__version__
lib.memshim_epoch()
print("RESULT", json.dumps(res))
"""
        dump = os.path.join(tmp, "dump.pickle")
        p = run(HIST, tmp, "hist", {"DUMP": dump})
        res = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")), {})
        sline = next(i + 1 for i, l in enumerate(HIST.splitlines()) if "SITE-STEP" in l)
        case("install(torch, lib) replaces the history API (and again is harmless)",
             {"_record_memory_history", "_snapshot", "memory_snapshot", "_dump_snapshot"} <= set(res.get("replaced", []))
             and res.get("again") == res.get("replaced"), (res.get("replaced"), p.stderr[-400:]))
        case("bad arguments raise as PyTorch's do", "expected state" in res.get("bad_enabled", ""), res.get("bad_enabled"))
        case("_record_memory_history(max_entries=1000) then _snapshot(): the alloc and free since, with frames",
             res.get("actions", [])[:1] != [] and "alloc" in res["actions"] and "free_requested" in res["actions"]
             and res["alloc_frames"] and res["alloc_frames"][0][0]["line"] == sline, res)
        case("memory_snapshot() (torch.cuda and torch.cuda.memory) is _snapshot()['segments']",
             res.get("segments_equal") is True)
        d = load(dump) if os.path.exists(dump) else None
        case("_dump_snapshot(file) writes a snapshot memory_viz and memshim-replay read",
             d and viewer_segment_view(d, 0) is None and (mv is None or "total_reserved" in mv.segsum(d))
             and subprocess.run([os.path.join(BUILD, "memshim-replay"), dump], capture_output=True).returncode == 0)
        case("_record_memory_history(enabled=None) stops recording and drops the events, as PyTorch does",
             res.get("after_stop", -1) == 0, res.get("after_stop"))
        case("the legacy boolean form records too", res.get("legacy", [""])[-1] in ("alloc", "snapshot")
             and "alloc" in res.get("legacy", []), res.get("legacy"))
        case("context=None: events without frames; clear_history=True: only the new ones",
             res.get("no_context") == [[]], res.get("no_context"))
        vers = [x["versions"]["torch"] for x in p.reports]
        case("reports name the torch version install() was given", vers and all(v == res.get("torch_version")
                                                                                 for v in vers), vers)
finish()
