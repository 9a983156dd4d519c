#!/usr/bin/env python3
"""Allocation sites in real CPython processes over the CUDA driver double (no GPU, no PyTorch
needed): memshim_malloc driven through ctypes the way PyTorch's pluggable allocator calls it.
Checks the per-epoch `sites` (file, line, function, live bytes and count at the epoch's peak),
`trend.growing_sites` and the verdict naming them; the three ways a stack is read (GIL held; GIL
released and re-taken, as inside a PyTorch operator; no Python state: `<backward>`); that torch's
and memshim's own frames are never the site; sampling; the GIL back-off under contention; and
every report against docs/report.schema.json. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyharness import BUILD, case, finish, skip  # noqa: E402
from schema_check import report_problems  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
MiB = 1 << 20

PRELUDE = r"""
import ctypes, os, sys
lib = (ctypes.PyDLL if os.environ["GIL"] == "held" else ctypes.CDLL)(os.environ["LIB"])
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_sites_library_path.argtypes = [ctypes.c_char_p]
MiB = 1 << 20
"""

# Four epochs: 20 activations (0.25 .. 5 MiB, 52.5 MiB) live at once, then freed; a 3 MiB block
# kept every epoch (the leak), allocated while the activations are live.
TRAIN = PRELUDE + r"""
def make_activation(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-ACT
def layer(keep, n):
    keep.append((make_activation(n), n))
leak = []
for epoch in range(4):
    acts = []
    for i in range(20):
        layer(acts, (i + 1) * 256 * 1024)
    leak.append(lib.memshim_malloc(3 * MiB, 0, None))  # SITE-LEAK
    for p, n in acts:
        lib.memshim_free(p, n, 0, None)
    lib.memshim_epoch()
"""


def line_of(src, marker):
    return next(i + 1 for i, l in enumerate(src.splitlines()) if marker in l)


def run(src, tmp, name, gil="held", env_extra=None, timeout=120):
    rdir = os.path.join(tmp, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "8G", "MEMSHIM_REPORT_DIR": rdir,
                "MEMSHIM_LOG": "error", "LIB": LIB, "GIL": gil, "MEMSHIM_SITES_SAMPLE": "0"})
    env.update(env_extra or {})
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(src)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    p.elapsed = time.monotonic() - t0
    reps = []
    for fn in sorted(glob.glob(os.path.join(rdir, "*.json"))):
        with open(fn) as fh:
            reps.append(json.load(fh))
    p.path = path
    p.epochs = [r for r in reps if r["kind"] == "epoch"]
    p.summary = next((r for r in reps if r["kind"] == "summary"), None)
    p.reports = reps
    return p


all_reports = []


def site(r, func):
    return next((s for s in r["sites"] if s["function"] == func), None)


with tempfile.TemporaryDirectory(prefix="memshim-sites-") as tmp:
    act_line, leak_line = line_of(TRAIN, "SITE-ACT"), line_of(TRAIN, "SITE-LEAK")
    for gil in ("held", "released"):
        p = run(TRAIN, tmp, "train-" + gil, gil)
        all_reports += p.reports
        ok = p.returncode == 0 and len(p.epochs) == 4 and p.summary
        label = "GIL held (ctypes.PyDLL)" if gil == "held" else "GIL released and re-taken (ctypes.CDLL, as in a PyTorch op)"
        case(f"{label}: the job runs, 4 epoch reports and a summary", ok, (p.stdout + p.stderr)[-400:])
        if not ok:
            continue
        e3 = p.epochs[3]
        act, leak = site(e3, "make_activation"), site(e3, "<module>")
        case(f"{label}: the top site is make_activation at its malloc line with the 20 activations' 52.5 MiB",
             act and e3["sites"][0] is act and act["file"] == p.path and act["line"] == act_line
             and act["bytes"] == 210 * 256 * 1024 and act["count"] == 20, e3["sites"])
        case(f"{label}: the leak site holds 4 x 3 MiB at epoch 3's peak (allocated while the activations live)",
             leak and leak["line"] == leak_line and leak["bytes"] == 12 * MiB and leak["count"] == 4, e3["sites"])
        case(f"{label}: epoch 0's peak has 1 x 3 MiB at the leak site",
             (site(p.epochs[0], "<module>") or {}).get("bytes") == 3 * MiB, p.epochs[0]["sites"])
        g = e3["trend"]["growing_sites"]
        case(f"{label}: growing_sites names the leak site with +3 MiB per epoch, and only it",
             len(g) == 1 and g[0]["line"] == leak_line and g[0]["function"] == "<module>"
             and g[0]["growth_bytes_per_epoch"] == 3 * MiB, g)
        v = e3["trend"]["verdict"]
        case(f"{label}: the verdict names the fastest-growing site",
             v.startswith("possible leak") and f"{os.path.basename(p.path)}:{leak_line}" in v and "+3.0 MiB" in v, v)
        s = p.summary
        case(f"{label}: the summary keeps the sites and their growth",
             site(s, "<module>") and s["trend"]["growing_sites"] and s["sites_note"] is None, s["sites"])

    # MEMSHIM_SITES=held: never re-takes the GIL; =off: no sites at all
    p = run(TRAIN, tmp, "held-only", "released", {"MEMSHIM_SITES": "held"})
    all_reports += p.reports
    e = p.epochs[-1] if p.epochs else {"sites": []}
    case("MEMSHIM_SITES=held with the GIL released: allocations count as '<python> unattributed'",
         p.returncode == 0 and [(s["file"], s["function"]) for s in e["sites"]] == [("<python>", "unattributed")],
         e["sites"])
    p = run(TRAIN, tmp, "off", "held", {"MEMSHIM_SITES": "off"})
    all_reports += p.reports
    e = p.epochs[-1] if p.epochs else {}
    case("MEMSHIM_SITES=off: sites [] and a note saying why",
         p.returncode == 0 and e.get("sites") == [] and e.get("sites_note") == "MEMSHIM_SITES=off", e.get("sites_note"))

    # torch's frames (anything under .../site-packages/torch/) and registered library paths are never the site
    pkg = os.path.join(tmp, "venv", "lib", "site-packages", "torch")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("import os\nfrom . import nn\n")
    with open(os.path.join(pkg, "nn.py"), "w") as f:
        f.write("LIB = None\ndef empty(n):\n    return LIB.memshim_malloc(n, 0, None)\n"
                "def linear(n):\n    return empty(n)\ndef call(fn, *a):\n    return fn(*a)\n")
    mylib = os.path.join(tmp, "mylib")
    os.makedirs(mylib)
    with open(os.path.join(mylib, "wrap.py"), "w") as f:
        f.write("def through(fn, n):\n    return fn(n)\n")
    LIBFRAMES = PRELUDE + f"""
sys.path[:0] = [{os.path.dirname(pkg)!r}, {mylib!r}]
import torch, wrap
torch.nn.LIB = lib
lib.memshim_sites_library_path({(mylib + os.sep)!r}.encode())
def forward():
    return torch.nn.call(torch.nn.linear, 5 * MiB)  # SITE-FWD
def via_library():
    return wrap.through(torch.nn.linear, 7 * MiB)  # SITE-VIA
keep = [forward(), via_library()]
lib.memshim_epoch()
"""
    p = run(LIBFRAMES, tmp, "libframes")
    all_reports += p.reports
    e = p.epochs[0]["sites"] if p.epochs else []
    fwd = next((s for s in e if s["function"] == "forward"), None)
    via = next((s for s in e if s["function"] == "via_library"), None)
    case("frames under site-packages/torch/ are skipped: the site is the user's forward() line",
         fwd and fwd["line"] == line_of(LIBFRAMES, "SITE-FWD") and fwd["bytes"] == 5 * MiB, e)
    case("a path registered with memshim_sites_library_path is skipped too",
         via and via["line"] == line_of(LIBFRAMES, "SITE-VIA") and via["bytes"] == 7 * MiB
         and not any("torch" in s["file"] or "mylib" in s["file"] for s in e), e)

    # A walk reuses what the thread's previous walk read wherever the frames are the same: the same
    # library frames reached from another user line, one call after the other, are another site.
    ALTERNATE = PRELUDE + f"""
sys.path[:0] = [{os.path.dirname(pkg)!r}]
import torch
torch.nn.LIB = lib
def user_a():
    return torch.nn.call(torch.nn.linear, 1 * MiB)  # SITE-A
def user_b():
    return torch.nn.call(torch.nn.linear, 2 * MiB)  # SITE-B
def two_lines(i):
    if i % 2:
        return torch.nn.linear(3 * MiB)  # SITE-C1
    return torch.nn.linear(4 * MiB)  # SITE-C2
def deeper():
    return user_a()  # not the site: user_a is
keep = []
for i in range(40):
    keep += [user_a(), user_b(), two_lines(i), two_lines(i + 1), user_a(), deeper()]
lib.memshim_epoch()
"""
    for gil in ("held", "released"):
        p = run(ALTERNATE, tmp, "alternate-" + gil, gil)
        all_reports += p.reports
        e = p.epochs[0]["sites"] if p.epochs else []
        got = {(s["function"], s["line"]): (s["bytes"], s["count"]) for s in e}
        want = {("user_a", line_of(ALTERNATE, "SITE-A")): (120 * MiB, 120),
                ("user_b", line_of(ALTERNATE, "SITE-B")): (80 * MiB, 40),
                ("two_lines", line_of(ALTERNATE, "SITE-C1")): (120 * MiB, 40),
                ("two_lines", line_of(ALTERNATE, "SITE-C2")): (160 * MiB, 40)}
        case(f"GIL {gil}: the same library frames from alternating user lines: each line keeps its own bytes",
             p.returncode == 0 and got == want, (got, (p.stdout + p.stderr)[-300:]))

    # Names are read from CPython's own string objects when the GIL is released (a PyTorch op): a
    # script and functions named outside ASCII (1-, 2- and 4-byte string kinds; 2-, 3- and 4-byte
    # UTF-8) get their sites under their own names, and code compiled with an empty file name on
    # the stack does not turn the frame reader off for the run (every later site unattributed).
    UNICODE = PRELUDE + """
def größe(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-2B
def 数据(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-3B
def 𠀀x(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-4B
keep = [größe(3 * MiB), 数据(5 * MiB), 𠀀x(7 * MiB)]
lib.memshim_epoch()
"""
    p = run(UNICODE, tmp, "zähler-🚀", "released")
    all_reports += p.reports
    e = p.epochs[0]["sites"] if p.epochs else []
    got = {(s["function"], s["line"], s["bytes"]) for s in e if s["file"] == p.path}
    want = {("größe", line_of(UNICODE, "SITE-2B"), 3 * MiB), ("数据", line_of(UNICODE, "SITE-3B"), 5 * MiB),
            ("𠀀x", line_of(UNICODE, "SITE-4B"), 7 * MiB)}
    case("GIL released: a script named zähler-🚀.py and functions größe, 数据, 𠀀x get their sites by those names",
         p.returncode == 0 and got == want, (e, (p.stdout + p.stderr)[-300:]))
    NONAME = PRELUDE + """
exec(compile("def from_exec(n):\\n    return lib.memshim_malloc(n, 0, None)\\n", "", "exec"))
def caller():
    return from_exec(6 * MiB)  # SITE-CALLER
keep = [caller()]
def later():
    return lib.memshim_malloc(4 * MiB, 0, None)  # SITE-LATER
keep.append(later())
lib.memshim_epoch()
"""
    for gil, how, extra in (("released", "frames read raw", {}), ("held", "MEMSHIM_SITES=acquire, read through the API",
                                                                   {"MEMSHIM_SITES": "acquire"})):
        p = run(NONAME, tmp, "noname-" + gil, gil, extra)
        all_reports += p.reports
        e = p.epochs[0]["sites"] if p.epochs else []
        got = {(s["file"], s["function"], s["line"], s["bytes"]) for s in e}
        case(f"GIL {gil}, {how}: code compiled with an empty file name is a site ('?' line 2), later sites still count",
             p.returncode == 0 and got == {("?", "from_exec", 2, 6 * MiB),
                                           (p.path, "later", line_of(NONAME, "SITE-LATER"), 4 * MiB)},
             (e, (p.stdout + p.stderr)[-300:]))

    # Interned names are told apart by length too: "forward_avz" and "forward" share a slot of the
    # string table (FNV-1a, 17 bits: shim/sites.c, str_hash), and the longer begins with the
    # shorter; each function keeps its own name.
    PREFIX = PRELUDE + """
def forward_avz(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-LONG
def forward(n):
    return lib.memshim_malloc(n, 0, None)  # SITE-SHORT
keep = [forward_avz(5 * MiB), forward(3 * MiB)]
lib.memshim_epoch()
"""
    p = run(PREFIX, tmp, "prefix")
    all_reports += p.reports
    e = p.epochs[0]["sites"] if p.epochs else []
    got = {(s["function"], s["line"], s["bytes"]) for s in e}
    case("two function names in one slot of the string table, one the other's prefix: each site keeps its own",
         p.returncode == 0 and got == {("forward_avz", line_of(PREFIX, "SITE-LONG"), 5 * MiB),
                                       ("forward", line_of(PREFIX, "SITE-SHORT"), 3 * MiB)},
         (e, (p.stdout + p.stderr)[-300:]))

    # a thread without Python state (autograd's backward workers): the pseudo site <backward>
    helper = os.path.join(tmp, "bwthread.so")
    csrc = os.path.join(tmp, "bwthread.c")
    with open(csrc, "w") as f:
        f.write(r"""
#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>
typedef void *(*mf)(ssize_t, int, void *);
struct job { mf m; ssize_t n; int count; void **out; };
static void *worker(void *a) { struct job *j = a; for (int i = 0; i < j->count; i++) j->out[i] = j->m(j->n, 0, 0); return 0; }
int run_thread(void *m, ssize_t n, int count, void **out) {
    struct job j = {(mf)m, n, count, out}; pthread_t t;
    if (pthread_create(&t, 0, worker, &j)) return -1;
    return pthread_join(t, 0);
}
""")
    cc = subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-pthread", "-o", helper, csrc], capture_output=True,
                        text=True)
    if cc.returncode:
        skip("a thread without Python state allocates: site <backward>", "gcc failed: " + cc.stderr[-200:])
    else:
        BACKWARD = PRELUDE + f"""
h = ctypes.CDLL({helper!r})
out = (ctypes.c_void_p * 6)()
assert h.run_thread(ctypes.cast(lib.memshim_malloc, ctypes.c_void_p), ctypes.c_ssize_t(2 * MiB), 6, out) == 0
fwd = lib.memshim_malloc(MiB, 0, None)
lib.memshim_epoch()
for p in out[:3]:
    lib.memshim_free(p, 2 * MiB, 0, None)
more = lib.memshim_malloc(8 * MiB, 0, None)  # this epoch's peak comes after the frees
lib.memshim_epoch()
"""
        p = run(BACKWARD, tmp, "backward")
        all_reports += p.reports
        e = p.epochs
        bw = [site(r, "backward") for r in e]
        case("a thread without Python state allocates: site <backward> with its 6 x 2 MiB, line 0",
             p.returncode == 0 and len(e) == 2 and bw[0] and bw[0]["file"] == "<backward>" and bw[0]["line"] == 0
             and bw[0]["bytes"] == 12 * MiB and bw[0]["count"] == 6 and site(e[0], "<module>")["bytes"] == MiB,
             [r["sites"] for r in e] + [p.stderr[-300:]])
        case("frees of <backward> blocks (from a Python thread) are accounted: 3 left at the next epoch's peak",
             len(e) == 2 and bw[1] and bw[1]["bytes"] == 6 * MiB and bw[1]["count"] == 3, [r["sites"] for r in e])

    # sampling below MEMSHIM_SITES_SAMPLE: small allocations estimated, large ones exact
    SAMPLED = PRELUDE + r"""
def small(n):
    return [lib.memshim_malloc(16384, 0, None) for _ in range(n)]  # SITE-SMALL
def big(n):
    return [lib.memshim_malloc(2 * MiB, 0, None) for _ in range(n)]  # SITE-BIG
def mid(n):
    return [lib.memshim_malloc(768 * 1024, 0, None) for _ in range(n)]  # SITE-MID
a, b, c = small(40000), big(10), mid(4000)
lib.memshim_epoch()
"""
    p = run(SAMPLED, tmp, "sampled", env_extra={"MEMSHIM_SITES_SAMPLE": "1M", "CUDBL_CAPACITY": "16G"}, timeout=300)
    all_reports += p.reports
    e = p.epochs[0] if p.epochs else {"sites": [], "sites_note": None}
    sm = next((s for s in e["sites"] if s["line"] == line_of(SAMPLED, "SITE-SMALL")), None)
    bg = next((s for s in e["sites"] if s["line"] == line_of(SAMPLED, "SITE-BIG")), None)
    true_small = 40000 * 16384
    case("MEMSHIM_SITES_SAMPLE=1M: 2 MiB blocks are exact (10 x 2 MiB)", bg and bg["bytes"] == 20 * MiB
         and bg["count"] == 10, e["sites"])
    case("MEMSHIM_SITES_SAMPLE=1M: 40000 x 16 KiB estimated within 20% (about 625 samples), note says so",
         sm and abs(sm["bytes"] - true_small) < 0.2 * true_small and abs(sm["count"] - 40000) < 8000
         and "sampled" in (e["sites_note"] or ""), (sm, e["sites_note"]))
    # near the threshold the weight must be 1 / (1 - exp(-size/T)): 768 KiB blocks are sampled with
    # a chance of 0.53 (about 2100 samples, 1.5% error); a linear chance (0.75) would read 30% low
    md = next((s for s in e["sites"] if s["line"] == line_of(SAMPLED, "SITE-MID")), None)
    true_mid = 4000 * 768 * 1024
    case("MEMSHIM_SITES_SAMPLE=1M: 4000 x 768 KiB (sampled with chance 0.53) estimated within 10%",
         md and abs(md["bytes"] - true_mid) < 0.1 * true_mid and abs(md["count"] - 4000) < 400, md)

    # contention: another thread holds the GIL (200 ms at a time) while a C loop under a Python frame
    # allocates with the GIL released; memshim must not wait for it at every allocation
    loopc, loopso = os.path.join(tmp, "cloop.c"), os.path.join(tmp, "cloop.so")
    with open(loopc, "w") as f:
        # 1 ms between allocations: time for the holder to take the GIL back each time
        f.write("#include <sys/types.h>\n#include <unistd.h>\ntypedef void *(*mf)(ssize_t, int, void *);\n"
                "void run(void *m, int n, void **out) { for (int i = 0; i < n; i++) { usleep(1000); "
                "out[i] = ((mf)m)(1 << 20, 0, 0); } }\n")
    cc = subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", loopso, loopc], capture_output=True, text=True)
    CONTENDED = PRELUDE + f"""
import threading, time
libc = ctypes.PyDLL(None)  # PyDLL: usleep keeps the GIL for its 200 ms
stop = False
def hold():
    while not stop:
        libc.usleep(200000)
t = threading.Thread(target=hold)
t.start()
time.sleep(0.05)
loop = ctypes.CDLL({loopso!r})  # CDLL: the loop runs with the GIL released, like a PyTorch operator
out = (ctypes.c_void_p * 300)()
def forward():
    loop.run(ctypes.cast(lib.memshim_malloc, ctypes.c_void_p), 300, out)  # SITE-LOOP
t0 = time.monotonic()
forward()
dt = time.monotonic() - t0
stop = True
t.join()
print("ELAPSED", dt)
lib.memshim_epoch()
"""
    if cc.returncode:
        skip("GIL contention back-off", "gcc failed: " + cc.stderr[-200:])
    else:
        # issue 16: by default (MEMSHIM_SITES=frames) the thread's own frames are read without the
        # GIL: nothing waits (but for the one probe of a process the memshim package did not start:
        # this script loads the library itself) and every allocation keeps its site.
        p = run(CONTENDED, tmp, "contended", "released", timeout=200)
        all_reports += p.reports
        dt = next((float(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("ELAPSED")), 99.0)
        e = p.epochs[0]["sites"] if p.epochs else []
        case("GIL held 200 ms at a time by another thread, default sites: 300 allocations take < 2 s (1 ms "
             "apart; at most one wait, for the probe) and all 300 MiB keep their site, read without the GIL",
             p.returncode == 0 and dt < 2.0 and [(s["function"], s["bytes"]) for s in e] == [("forward", 300 * MiB)],
             (dt, e, p.stderr[-300:]))
        p = run(CONTENDED, tmp, "contended-acquire", "released", {"MEMSHIM_SITES": "acquire"}, timeout=200)
        all_reports += p.reports
        dt = next((float(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("ELAPSED")), 99.0)
        e = p.epochs[0]["sites"] if p.epochs else []
        case("MEMSHIM_SITES=acquire, GIL held 200 ms at a time by another thread: 300 allocations take < 5 s, not "
             "300 waits of up to 200 ms (memshim backs off)",
             p.returncode == 0 and dt < 5.0, (dt, p.stderr[-300:]))
        case("... the allocations not read count as '<python> unattributed'; all 300 MiB accounted",
             sum(s["bytes"] for s in e) == 300 * MiB and any(s["function"] == "unattributed" for s in e)
             and {s["function"] for s in e} <= {"forward", "unattributed"}, e)

        # issue 16: a C thread that holds a Python thread state for life and runs no Python (what
        # autograd's device threads do: PythonEngine::thread_init takes and releases the GIL once)
        # allocates while another Python thread keeps the GIL busy. Its allocations are backward
        # allocations: the backward label, and no wait for the GIL (before: PyGILState_Ensure at
        # every allocation and '<python> unattributed').
        statec, stateso = os.path.join(tmp, "tstate.c"), os.path.join(tmp, "tstate.so")
        with open(statec, "w") as f:
            f.write("#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <pthread.h>\n#include <sys/types.h>\n"
                    "#include <time.h>\ntypedef void *(*mf)(ssize_t, int, void *);\n"
                    "static void *m; static int n; static void **out; static double worst, total;\n"
                    "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); "
                    "return t.tv_sec + t.tv_nsec / 1e9; }\n"
                    "static void *body(void *a) { (void)a; int (*en)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "
                    "\"PyGILState_Ensure\"); void (*re)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "
                    "\"PyGILState_Release\"); int g = en(); re(g); g = en(); (void)g; "
                    "void *(*save)(void) = (void *(*)(void))dlsym(RTLD_DEFAULT, \"PyEval_SaveThread\"); save();\n"
                    "  for (int i = 0; i < n; i++) { double t = now(); out[i] = ((mf)m)(1 << 20, 0, 0); "
                    "t = now() - t; total += t; if (t > worst) worst = t; } return 0; }\n"
                    "double run(void *mm, int nn, void **oo) { m = mm; n = nn; out = oo; pthread_t th; "
                    "pthread_create(&th, 0, body, 0); pthread_join(th, 0); return total; }\n")
        cc2 = subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", stateso, statec, "-lpthread"],
                             capture_output=True, text=True)
        TSTATE = PRELUDE + f"""
import threading, time
ctypes.PyDLL(os.environ["LIB"]).memshim_sites_probe()  # what the memshim package does at start-up
stop = False
def spin():
    x = 0
    while not stop:
        x += 1
t = threading.Thread(target=spin)
t.start()
th = ctypes.CDLL({stateso!r})
th.run.restype = ctypes.c_double
out = (ctypes.c_void_p * 200)()
worst = th.run(ctypes.cast(lib.memshim_malloc, ctypes.c_void_p), 200, out)
stop = True
t.join()
print("TOTAL", worst)
lib.memshim_epoch()
"""
        for mode in ("frames", "acquire"):
            if cc2.returncode:
                skip(f"MEMSHIM_SITES={mode}: a thread with an idle thread state", "gcc failed: " + cc2.stderr[-200:])
                break
            p = run(TSTATE, tmp, "tstate-" + mode, "held", {"MEMSHIM_SITES": mode}, timeout=200)
            all_reports += p.reports
            total = next((float(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("TOTAL")), 99.0)
            e = p.epochs[0]["sites"] if p.epochs else []
            case(f"MEMSHIM_SITES={mode}: a C thread with an idle Python thread state (autograd's device threads) "
                 "allocates while a Python thread spins: site <backward> with all 200 MiB"
                 + (", in < 0.2 s together (it never waits for the GIL: 200 waits of up to 5 ms would be 1 s)"
                    if mode == "frames" else
                    " (recognised once: the GIL is taken for one allocation, not 200)"),
                 p.returncode == 0 and [(s["file"], s["function"], s["bytes"]) for s in e]
                 == [("<backward>", "backward", 200 * MiB)] and (mode != "frames" or total < 0.2),
                 (total, e, p.stderr[-300:]))

        # One slow acquisition is not a busy GIL (a preempted thread looks the same): the GIL held
        # once for 50 ms while the loop allocates, then free again: every allocation keeps its site.
        ONCE = PRELUDE + f"""
import threading, time
libc = ctypes.PyDLL(None)
def hold_once():
    time.sleep(0.03)
    libc.usleep(50000)  # PyDLL: the GIL stays held for these 50 ms
t = threading.Thread(target=hold_once)
loop = ctypes.CDLL({loopso!r})
out = (ctypes.c_void_p * 300)()
def forward():
    loop.run(ctypes.cast(lib.memshim_malloc, ctypes.c_void_p), 300, out)  # SITE-LOOP
t.start()
forward()
t.join()
lib.memshim_epoch()
"""
        p = run(ONCE, tmp, "once", "released", {"MEMSHIM_SITES": "acquire"}, timeout=200)
        all_reports += p.reports
        e = p.epochs[0]["sites"] if p.epochs else []
        case("MEMSHIM_SITES=acquire, the GIL held once for 50 ms by another thread: one slow wait, no back-off; all "
             "300 MiB keep their site",
             p.returncode == 0 and [(s["function"], s["bytes"]) for s in e] == [("forward", 300 * MiB)], e)

    bad = [(r["kind"], r["epoch"], pr) for r in all_reports for pr in [report_problems(r)] if pr]
    case(f"all {len(all_reports)} reports of these runs match docs/report.schema.json", all_reports and not bad, bad[:3])
finish()
