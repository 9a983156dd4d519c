#!/usr/bin/env python3
"""Write SYNTHETIC "held-out-like" traces: transformations of a real recording (a PyTorch snapshot or
a memshim text trace) that another author's script, recording the same kind of job, would
plausibly produce (issue 15, item 5: the learned step must be general, not fitted to the traces we
have). The output is memshim's text trace (docs/trace-format.md); it says SYNTHETIC in its header
and names the source and the transformation. Every choice comes from a seeded random.Random: the
same input and arguments always write the same bytes.

The input's events are taken as one training step (the recordings of ../shared/traces hold about
one step each). Its blocks fall in three kinds: prefix blocks (live when recording began: weights,
optimizer state), carried blocks (allocated in the step and still live at its end: new gradients,
optimizer state created lazily) and transient ones (allocated and freed in the step: activations,
workspaces). Transformations, combined with --steps and each one optional:

--steps K        K copies of the step in a row, as a longer recording holds. Copy k+1 frees, in
                 place of a prefix block that the step frees, the block of the same size that copy
                 k left live (the new gradient replaces the old one), the first of that size in
                 allocation order; what copy k leaves live that nothing takes over is freed at the
                 boundary (the step's outputs, dropped as the next step begins).
--rotate F       the recording starts at fraction F (0..1) of the first copy's events, as a ring
                 buffer that began mid-step does: the blocks live there become the prefix.
--warmup         a warm-up step first, of another shape: its transient sizes scaled by a factor in
                 [0.5, 0.8] (another batch or sequence length: compile, autotune, a first
                 evaluation), plus 1-3 one-off workspaces, one of which stays live for the rest of
                 the run (a cached cuDNN/cuBLAS workspace).
--jitter J       each copy's transient sizes scaled by a factor drawn in [1 - J, 1] (a sequence
                 length that varies per batch). Sizes that equal a prefix block's size (weight-shaped
                 buffers: gradients, casts) keep their size; sizes stay multiples of 16 bytes.
--last-batch     the last copy's transient sizes scaled by a factor in [0.3, 0.9] (a short last
                 batch).
--eval N         after every N copies, an evaluation step: the first --eval-fraction (default 0.4)
                 of the step's events (forward-like), restricted to blocks it allocates itself,
                 everything it leaves live freed at its end.
--micro M        gradient accumulation: each copy is M micro-steps (the step M times, chained as
                 copies are, each with its own size factor in [1 - J, 1], the same M factors in
                 every copy): a step M times longer than the recording, longer than the pool's step
                 log when M x events exceeds it.

Addresses are fresh for every allocation (the replay maps them to its pool's own), streams are the
recording's. Usage:

    scripts/gen_heldout_traces.py [--replay build/memshim-replay] INPUT -o OUT [--seed S]
        [--steps K] [--rotate F] [--warmup] [--jitter J] [--last-batch] [--eval N]
        [--eval-fraction F] [--micro M]

A snapshot (anything not in memshim's text format) is converted with `memshim-replay --to-text`
first; a file with several devices is refused (one device per output). Never commit the output
as data: tests and `make bench` write it under build/ or a temporary folder.
"""
import argparse
import random
import subprocess
import sys


def load(path, replay):
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"# memshim-trace"):
        text = open(path).read()
    else:
        p = subprocess.run([replay, "--to-text", path], capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"gen_heldout_traces: cannot read {path}: {p.stderr.strip()}")
        text = p.stdout
    prefix, events, devs = [], [], set()
    for line in text.splitlines():
        t = line.split("#", 1)[0].split()
        if not t or t[0] not in "pafr":
            continue
        if t[0] == "r":
            devs.add(int(t[1]))
            continue
        devs.add(int(t[1]))
        rec = (t[0], int(t[2], 16), int(t[3], 16), int(t[4]))
        (prefix if t[0] == "p" else events).append(rec)
    if len(devs) > 1:
        sys.exit(f"gen_heldout_traces: {path} holds {len(devs)} devices; one device per output")
    return prefix, events


class Step:
    """The recording as a step: its events with each block named by an index, and each block's kind."""

    def __init__(self, prefix, events):
        self.pre_sizes = [s for _, _, _, s in prefix]
        self.pre_stream = [st for _, st, _, _ in prefix]
        where = {a: ("p", i) for i, (_, _, a, _) in enumerate(prefix)}
        self.ev = []          # ("a", j, stream, size) | ("f", ("p", i) or ("a", j))
        self.sizes, self.streams = [], []
        live = set()
        for op, st, a, s in events:
            if op == "a":
                j = len(self.sizes)
                self.sizes.append(s)
                self.streams.append(st)
                where[a] = ("a", j)
                live.add(j)
                self.ev.append(("a", j))
            elif a in where:
                ref = where.pop(a)
                if ref[0] == "a":
                    live.discard(ref[1])
                self.ev.append(("f", ref))
        self.carried = sorted(live)           # allocated in the step, live at its end
        freed_pre = [e[1][1] for e in self.ev if e[0] == "f" and e[1][0] == "p"]
        # which carried block of copy k takes the place of each prefix block freed in copy k+1
        by_size = {}
        for j in self.carried:
            by_size.setdefault(self.sizes[j], []).append(j)
        self.takes = {}                        # prefix index -> carried index of the previous copy
        for i in freed_pre:
            lst = by_size.get(self.pre_sizes[i])
            if lst:
                self.takes[i] = lst.pop(0)
        taken = set(self.takes.values())
        self.dropped = [j for j in self.carried if j not in taken]  # freed at the boundary
        weight = set(self.pre_sizes)
        transient = set(range(len(self.sizes))) - set(self.carried)
        self.scalable = {j for j in transient if self.sizes[j] not in weight}


def scale(size, f):
    return max(16, int(size * f) // 16 * 16) if f != 1.0 else size


class Out:
    def __init__(self):
        self.lines, self.next = [], 0x7E0000000000
        self.live = {}  # address -> (stream, size)

    def alloc(self, stream, size, kind="a"):
        addr = self.next
        self.next += (size + 2 * 1024 * 1024 - 1) // (1024 * 1024) * (1024 * 1024) + 1024 * 1024
        self.live[addr] = (stream, size)
        self.lines.append(f"{kind} 0 {stream:#x} {addr:#x} {size}")
        return addr

    def free(self, addr):
        stream, size = self.live.pop(addr)
        self.lines.append(f"f 0 {stream:#x} {addr:#x} {size}")


def run_step(step, out, names, factor, limit=None, own_only=False):
    """One copy of the step. names: prefix index -> address of the block in its role now (updated
    in place for the next copy). Returns the addresses of this copy's carried blocks. limit: only
    the first `limit` events; own_only: frees of blocks this copy did not allocate are skipped."""
    mine = {}
    for n, e in enumerate(step.ev):
        if limit is not None and n >= limit:
            break
        if e[0] == "a":
            j = e[1]
            f = factor if j in step.scalable else 1.0
            mine[j] = out.alloc(step.streams[j], scale(step.sizes[j], f))
        else:
            kind, idx = e[1]
            if kind == "a":
                if idx in mine:
                    out.free(mine.pop(idx))
            elif not own_only and idx in names:
                out.free(names.pop(idx))
    return mine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--replay", default="build/memshim-replay", help="memshim-replay, to convert snapshots")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rotate", type=float, default=0.0)
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--last-batch", action="store_true")
    ap.add_argument("--eval", type=int, default=0)
    ap.add_argument("--eval-fraction", type=float, default=0.4)
    ap.add_argument("--micro", type=int, default=1)
    a = ap.parse_args()
    if a.steps < 1 or a.micro < 1 or not 0 <= a.rotate < 1 or not 0 <= a.jitter < 1 or a.eval < 0 \
            or not 0 < a.eval_fraction <= 1:
        ap.error("need --steps >= 1, --micro >= 1, 0 <= --rotate < 1, 0 <= --jitter < 1, --eval >= 0, "
                 "0 < --eval-fraction <= 1")
    rng = random.Random(a.seed)
    prefix, events = load(a.input, a.replay)
    step = Step(prefix, events)
    out = Out()
    names = {i: out.alloc(step.pre_stream[i], s, "p") for i, s in enumerate(step.pre_sizes)}
    micro_f = [1.0 - rng.random() * a.jitter for _ in range(a.micro)] if a.jitter else [1.0] * a.micro
    what = [f"steps={a.steps}"]

    def copy(factors):
        """One copy (M micro-steps chained): the carried blocks take over the prefix roles."""
        for f in factors:
            mine = run_step(step, out, names, f)
            for i, j in step.takes.items():
                if j in mine:
                    names[i] = mine.pop(j)
            for addr in mine.values():  # outputs nothing takes over: dropped at the boundary
                out.free(addr)

    if a.warmup:
        what.append("warmup")
        f = 0.5 + 0.3 * rng.random()
        persistent = [out.alloc(0, rng.randint(8, 256) * 1024 * 1024) for _ in range(rng.randint(1, 3))]
        copy([f])
        for addr in persistent[1:]:  # the first workspace stays cached by the library: live
            out.free(addr)
    span = None  # lines of the first training copy
    for k in range(a.steps):
        if k == 1:
            span = (span0, len(out.lines))
        span0 = len(out.lines) if k == 0 else span0
        factors = list(micro_f)
        if a.jitter and a.micro == 1:
            factors = [1.0 - rng.random() * a.jitter]
        if a.last_batch and k == a.steps - 1:
            factors = [0.3 + 0.6 * rng.random()] * len(factors)
        copy(factors)
        if a.eval and (k + 1) % a.eval == 0 and k + 1 < a.steps:
            mine = run_step(step, out, names, 1.0, limit=max(1, int(len(step.ev) * a.eval_fraction)), own_only=True)
            for addr in mine.values():
                out.free(addr)
    if a.jitter:
        what.append(f"jitter={a.jitter}")
    if a.last_batch:
        what.append("last-batch")
    if a.eval:
        what.append(f"eval every {a.eval} (fraction {a.eval_fraction})")
    if a.micro > 1:
        what.append(f"micro={a.micro}")
    lines = out.lines
    if span is None:
        span = (span0, len(lines))
    if a.rotate:
        what.append(f"rotate={a.rotate}")
        # the recording begins at that point of the first training copy: what is live there is
        # the prefix (a warm-up before it is cut off with the rest)
        cut = span[0] + int((span[1] - span[0]) * a.rotate)
        live = {}
        for l in lines[:cut]:
            t = l.split()
            if t[0] in "pa":
                live[t[3]] = l
            else:
                live.pop(t[3], None)
        lines = ["p" + l[1:] for l in live.values()] + lines[cut:]
    with open(a.output, "w") as f:
        f.write("# memshim-trace 1\n")
        f.write(f"# SYNTHETIC held-out-like trace from scripts/gen_heldout_traces.py (seed {a.seed}): "
                f"{' '.join(what)}; source {a.input}\n")
        f.write("r 0 0 0\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
