#!/usr/bin/env python3
"""Differential checks: memshim's answers in PyTorch's name against PyTorch's own rules (issue 18,
item 2; docs/testing.md).

The reference is tests/differential/torch_model.py, a model of PyTorch's caching allocator written
from PyTorch's source (each rule cites its file and function). memshim is driven through the entry
points PyTorch's pluggable allocator calls (tests/differential/drive_torch.py, under
LD_PRELOAD=libmemshim.so on the driver double), and every memory_stats() key is compared with the
model after every step of allocation sequences that cross every size class and boundary:

  - exact, as PyTorch: the key set; allocation.*, active.*, requested_bytes.* (every pool and
    field); allocated_bytes.small_pool.* and active_bytes.small_pool.* (PyTorch's small blocks are
    always split to the rounded size); num_ooms; max_split_size; oversize_*; sizes 0 (no
    allocation at all: NativeCachingAllocator::allocate skips malloc for size 0);
  - memshim's documented deviation (docs/pytorch.md, "The memory API in tensor mode"):
    allocated_bytes.{all,large_pool} count the rounded request (round_size) where PyTorch counts
    its block, which can be up to 1 MiB larger when should_split leaves the remainder; the test
    checks memshim = PyTorch's figure less exactly those remainders, so any other difference fails;
    reserved_bytes and segment count memshim's pages (all under large_pool, small_pool 0);
  - set_per_process_memory_fraction against MEMSHIM_LIMIT, every combination: the bytes that fit
    before the first failure are those of PyTorch's allowance (fraction x device memory), capped
    by MEMSHIM_LIMIT; get_per_process_memory_fraction as PyTorch answers it.

  - allocations while CUDA-graph pools are begun: routed by PyTorch's filters in get_pool's order
    (glue_routing.cpp drives the real glue with a recording stand-in for libmemshim.so)."""
import json
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pyharness import BUILD, case, finish, skip, step  # noqa: E402
import torch_model as tm  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
DOUBLE = os.path.join(BUILD, "double")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def drive(ops, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_", "PYTORCH_"))}
    env.update(LD_PRELOAD=LIB, LD_LIBRARY_PATH=DOUBLE, CUDBL_CAPACITY="8G")
    env.update(extra or {})
    p = subprocess.run([sys.executable, os.path.join(HERE, "drive_torch.py"), json.dumps(ops)], env=env,
                       capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise SystemExit(f"drive_torch.py failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")], p.stderr


class Rounded:
    """memshim's documented allocated_bytes: PyTorch's stat rules (increase_stat/decrease_stat)
    over round_size(request) instead of the block size."""

    def __init__(self):
        self.s = {t: tm.Stat() for t in tm.STAT_TYPES}

    def add(self, size, inc):
        r = tm.round_size(size)
        for t in ("all", "small_pool" if tm.is_small(r) else "large_pool"):
            (self.s[t].inc if inc else self.s[t].dec)(r)


EXACT = [f"{a}.{t}.{f}" for a in ("allocation", "active", "requested_bytes") for t in tm.STAT_TYPES
         for f in tm.STAT_FIELDS]
EXACT += [f"{a}.small_pool.{f}" for a in ("allocated_bytes", "active_bytes") for f in tm.STAT_FIELDS]
EXACT += [f"{s}.{f}" for s in tm.SINGLE_STATS for f in tm.STAT_FIELDS] + ["num_ooms", "max_split_size"]


def compare(title, ops, extra=None, capacity=8 * GiB):
    """Run ops through memshim and the model; compare every stats snapshot."""
    model = tm.CachingAllocator(capacity)
    rounded = Rounded()
    expect, live = [], {}
    for op in ops:
        if op[0] == "alloc":
            try:
                p = model.malloc(op[2])
            except MemoryError:
                continue
            live[op[1]] = (p, op[2])
            if p is not None:
                rounded.add(op[2], True)
        elif op[0] == "free":
            p, size = live.pop(op[1])
            if p is not None:
                model.free(p)
                rounded.add(size, False)
        elif op[0] == "reset_peak":
            model.reset_peak()
            for s in rounded.s.values():
                s.peak = s.current
        elif op[0] == "reset_accumulated":
            model.reset_accumulated()
            for s in rounded.s.values():
                s.allocated = s.freed = 0
        elif op[0] == "empty_cache":
            model.empty_cache()
        elif op[0] == "stats":
            ms = model.memory_stats()
            for t in ("all", "large_pool"):
                for f in tm.STAT_FIELDS:
                    ms[f"memshim.allocated_bytes.{t}.{f}"] = getattr(rounded.s[t], f)
            ms["remainders"] = model.split_remainders()
            expect.append(ms)
    got, err = drive(ops, extra)
    got = [g["stats"] for g in got if "stats" in g]
    keys_ok = all(sorted(g) == tm.memory_stats_keys() for g in got)
    case(f"{title}: memshim's memory_stats() has exactly PyTorch's {len(tm.memory_stats_keys())} keys",
         keys_ok and got, sorted(set(got[0]) ^ set(tm.memory_stats_keys())) if got else err[-800:])
    bad = []
    for i, (g, e) in enumerate(zip(got, expect)):
        for k in EXACT:
            if g.get(k) != e[k]:
                bad.append(f"step {i}: {k} = {g.get(k)}, PyTorch {e[k]}")
        for t in ("all", "large_pool"):
            for f in tm.STAT_FIELDS:
                k = f"allocated_bytes.{t}.{f}"
                if g.get(k) != e[f"memshim.{k}"] or g.get(f"active_bytes.{t}.{f}") != g.get(k):
                    bad.append(f"step {i}: {k} = {g.get(k)} (active {g.get('active_bytes.' + k[16:])}), "
                               f"PyTorch's rounded requests {e['memshim.' + k]} (its blocks {e[k]})")
            # the only difference left with PyTorch's block figure: the unsplit remainders
            if g.get(f"allocated_bytes.{t}.current") != e[f"allocated_bytes.{t}.current"] - e["remainders"]:
                bad.append(f"step {i}: allocated_bytes.{t}.current {g.get(f'allocated_bytes.{t}.current')} is not "
                           f"PyTorch's {e[f'allocated_bytes.{t}.current']} less its unsplit remainders {e['remainders']}")
    case(f"{title}: {len(got)} snapshots, {len(EXACT)} keys as PyTorch counts them, allocated_bytes as PyTorch's "
         f"less its unsplit remainders", len(got) == len(expect) and not bad,
         bad[:6] or f"{len(got)} snapshots for {len(expect)}")
    return got, expect


# Every size class and boundary of CUDACachingAllocator.cpp: below, at and above kMinBlockSize,
# kSmallSize, kSmallBuffer, kMinLargeAlloc, kLargeBuffer, and odd sizes between.
BOUNDARIES = [1, 511, 512, 513, 1000, KiB, 4095, 65536 + 1, MiB - 513, MiB - 512, MiB - 511, MiB - 1, MiB, MiB + 1,
              MiB + 512, MiB + 513, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 5 * MiB + 3, 10 * MiB - 1, 10 * MiB,
              10 * MiB + 1, 19 * MiB + 12345, 20 * MiB - 1, 20 * MiB, 20 * MiB + 1, 21 * MiB, 64 * MiB + 7]

step("every size class and boundary")
ops = []
for i, s in enumerate(BOUNDARIES):
    ops += [["alloc", f"b{i}", s], ["stats"]]
for i in range(0, len(BOUNDARIES), 2):
    ops += [["free", f"b{i}"], ["stats"]]
ops += [["reset_peak"], ["stats"], ["alloc", "x", 3 * MiB], ["stats"], ["reset_accumulated"], ["stats"]]
for i in range(1, len(BOUNDARIES), 2):
    ops += [["free", f"b{i}"], ["stats"]]
ops += [["free", "x"], ["stats"]]
compare("boundaries", ops)

step("size 0")
compare("size 0 (torch.empty(0) on the device)",
        [["alloc", "z0", 0], ["alloc", "z1", 0], ["alloc", "a", 4096], ["stats"], ["free", "z0"], ["stats"],
         ["reset_accumulated"], ["free", "z1"], ["free", "a"], ["stats"]])

step("random sequences")
for seed in (1, 2, 3):
    rnd = random.Random(seed)
    ops, names = [], []
    for n in range(160):
        if names and rnd.random() < 0.45:
            ops.append(["free", names.pop(rnd.randrange(len(names)))])
        else:
            cls = rnd.choice([(1, 512), (513, MiB), (MiB - 600, MiB + 600), (MiB + 1, 10 * MiB), (10 * MiB, 40 * MiB)])
            ops.append(["alloc", f"r{n}", rnd.randint(*cls)])
            names.append(f"r{n}")
        if n % 4 == 3:
            ops.append(["stats"])
        if n == 80:
            ops += [["reset_peak"], ["stats"]]
        if n == 120:
            ops += [["reset_accumulated"], ["stats"]]
    ops += [["free", x] for x in names] + [["stats"]]
    compare(f"random sequence {seed}", ops)

step("failed requests")
compare("requests past the limit are num_ooms, as PyTorch counts them",
        [["alloc", "a", 300 * MiB], ["alloc", "b", 300 * MiB], ["alloc", "c", 700 * MiB], ["stats"], ["free", "a"],
         ["alloc", "d", 700 * MiB], ["stats"], ["free", "b"], ["stats"]],
        {"MEMSHIM_LIMIT": "1G", "CUDBL_CAPACITY": "8G"}, capacity=GiB)

# ---- set_per_process_memory_fraction x MEMSHIM_LIMIT --------------------------------------------
step("fraction x limit")
TOTAL = 1 * GiB
LIMITS = [None, "512M", "0.25", "0.75", "2G"]
FRACTIONS = [None, 0.5, 1.0, 0.25, 0.6]


def limit_bytes(v):
    if v is None:
        return None
    return int(float(v) * TOTAL) if "." in v else int(v[:-1]) * {"M": MiB, "G": GiB}[v[-1]]


def fraction_run(lim, frac, order):
    """(problems, label): fill the device with 2 MiB blocks under MEMSHIM_LIMIT=lim after
    set_per_process_memory_fraction(frac), given before the pool starts or after."""
    # PyTorch: DeviceCachingAllocator::setMemoryFraction, allowed = fraction * device total;
    # alloc_block refuses a segment past it. memshim: the smaller of that and MEMSHIM_LIMIT.
    allow = [TOTAL]
    if frac is not None:
        allow.append(int(frac * TOTAL))
    if lim is not None:
        allow.append(limit_bytes(lim))
    want_fit = min(allow) // (2 * MiB)
    ops = []
    if order[0] == "fraction" and frac is not None:
        ops.append(["fraction", frac])
    ops.append(["alloc", "first", 0 if order[0] == "fraction" else 512])
    if order[0] == "start" and frac is not None:
        ops.append(["fraction", frac])
    ops += [["get_fraction"]]
    if order[0] == "start":
        ops.append(["free", "first"])
    ops += [["empty_cache"], ["fill", "f", 2 * MiB]]
    extra = {"CUDBL_CAPACITY": "1G"}
    if lim is not None:
        extra["MEMSHIM_LIMIT"] = lim
    out, err = drive(ops, extra)
    fit = next(o["fill"] for o in out if "fill" in o)
    got_frac = next(o["fraction"] for o in out if "fraction" in o)
    # get_per_process_memory_fraction: PyTorch's getMemoryFraction answers 1.0 until a fraction
    # is set, then allowed / total; memshim also counts MEMSHIM_LIMIT as a fraction
    pt_frac = (int(frac * TOTAL) / TOTAL) if frac is not None else 1.0
    want_frac = min(pt_frac, limit_bytes(lim) / TOTAL) if lim is not None else pt_frac
    label = f"MEMSHIM_LIMIT={lim} fraction={frac} ({' then '.join(order)})"
    bad = []
    if fit != want_fit:
        bad.append(f"{label}: {fit} blocks of 2 MiB fit, PyTorch's allowance {min(allow)} gives {want_fit}")
    if abs(got_frac - want_frac) > 1e-9:
        bad.append(f"{label}: get_per_process_memory_fraction {got_frac}, expected {want_frac}")
    return bad, label


bad = []
for lim in LIMITS:
    for frac in FRACTIONS:
        for order in (("fraction", "start"), ("start", "fraction")):
            bad += fraction_run(lim, frac, order)[0]
case(f"set_per_process_memory_fraction x MEMSHIM_LIMIT: {len(LIMITS) * len(FRACTIONS) * 2} combinations (limits, "
     f"fractions up to 1, set before and after the pool starts) give PyTorch's allowance capped by the limit",
     not bad, bad[:6])
# Known differences, reported (issue 18) and left to the pool's owners: PyTorch allows fraction 0
# (memory.py checks 0~1; no new segment fits), memshim refuses it with a warning; and an allowance
# below one page (fraction x total or MEMSHIM_LIMIT under 2 MiB) rounds down to 0 in the pool's
# shared limit (policy/pool.c, limit_now), which means no limit. Each passes once it matches.
for lim, frac in ((None, 0.0), (None, 0.001), ("1M", None)):
    kbad, label = fraction_run(lim, frac, ("start", "fraction"))
    if kbad:
        skip(f"{label} as PyTorch", f"known difference, reported: {kbad[0]}")
    else:
        case(f"{label} as PyTorch", True)
# ---- allocations inside begun pools: the glue's routing against get_pool ------------------------
step("capture-pool routing")
GLUE = os.path.join(BUILD, "libmemshim_torch.so")
ROUTING = os.path.join(BUILD, "tests", "differential", "glue_routing")
if not (os.path.exists(GLUE) and os.path.exists(ROUTING)):
    skip("capture-pool routing as PyTorch's get_pool", "the glue is not built here (no PyTorch): make tests builds it")
else:
    p = subprocess.run([ROUTING, GLUE], capture_output=True, text=True, timeout=60)
    for line in p.stdout.splitlines():
        if line.startswith(("ok   ", "FAIL ")):
            name, _, detail = line[5:].partition(": ")
            case(f"capture-pool routing: {name if line.startswith('ok') else name}", line.startswith("ok"),
                 detail[:600])
    case("capture-pool routing: the program ran to its end", p.returncode in (0, 1) and "passed," in p.stdout,
         p.stdout[-600:] + p.stderr[-600:])
finish()
