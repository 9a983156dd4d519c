#!/usr/bin/env python3
"""Write a SYNTHETIC memshim text trace (docs/trace-format.md, version 1) of a training job that
offloads its weights to the host and reloads them layer by layer (ZeRO-Offload / FSDP-CPU-offload
style). No real trace of such a workload exists in ../shared/traces; this one is made up, from the
model below, to measure the pool's steady state when the working set moves by design (issue 10).

The model (every size and every choice comes from a seeded random.Random: the same arguments
always write the same bytes):

- N layers (default 24) with mixed weight sizes, drawn uniformly between --min-mib and --max-mib
  (default 50 to 400 MiB), each a multiple of 4 KiB (fp16 matrices are not page multiples). The
  weights live on the host. Each layer also has an activation size (what its forward saves for
  backward), 10% to 30% of its weights, a multiple of 512 bytes.
- Resident on the device for the whole job (prefix blocks, `p` lines): an embedding and a head
  kept on the device (64 and 96 MiB) and a few small buffers (RNG state, loss scaler).
- Two streams: the compute stream (0, the default stream) and a copy stream (--copy-stream).
  Weight reloads are allocated on the copy stream (and freed there, as PyTorch's caching allocator
  frees a block on the stream it was allocated on); everything else on the compute stream.
- One training step:
  * the input batch (8 MiB) and its attention mask (a small block) are allocated;
  * forward, layer i = 0..N-1: W_i is reloaded (allocated) before its use; with prefetch (the
    default) W_{i+1} is reloaded while layer i computes, so two weight buffers are live at once.
    Layer i allocates a transient workspace (20% to 60% of its activation), its saved activation
    A_i and two small saved tensors (layer-norm statistics, 16 to 64 KiB, kept for backward),
    frees the workspace, and W_i is offloaded (freed);
  * loss: logits (a 64 MiB block) and the loss (a small block), the gradient of the logits
    (64 MiB); the logits and the loss are freed;
  * backward, layer i = N-1..0: W_i is reloaded again (prefetch of W_{i-1} while i computes), then
    the input gradient dX_i (the size of A_{i-1}, or of the batch for layer 0), a workspace, and
    the weight gradient dW_i (the size of W_i) are allocated; the workspace, A_i, its small saved
    tensors and the output gradient of layer i+1 are freed; dW_i is copied to the host and freed
    (offloaded), and W_i is freed;
  * end of step: the last input gradient, the batch and the mask are freed. The optimizer runs on
    the host (it touches no device memory).
- --steps steps (default 3) in a row, so the steady state is visible inside one trace as well as
  across `memshim-replay --passes`.
- Addresses follow a caching allocator that reuses, per stream, a freed block of the same rounded
  size (512 bytes) last in first out, and otherwise takes new address space; so every step after
  the first names the same addresses, as a real training trace does. Times (microseconds) advance
  with the bytes each layer moves and computes; they are informative only.

Many streams (--streams N, N >= 3; issue 15: a held-out real trace of this kind ran on 10
streams), the same step with the traffic of a ZeRO-Infinity / FSDP-offload job spread over the
streams such a job uses (the default, --streams 2, writes exactly the trace above):

- stream roles: 0 computes; of the other N-1, about 40% are host-to-device copy streams (reloads),
  30% device-to-host streams (offloads) and the rest collective streams (NCCL-like); each has its
  own raw value, and a block is freed on the stream it was allocated on, as PyTorch does;
- reloads of layer i go to copy stream i mod (copy streams), --prefetch-depth layers ahead
  (default 2), so several weight buffers from several streams are live at once;
- saved activations are offloaded after the forward of their layer with probability
  --offload-fraction (default 0.75, drawn per layer): the device copy is freed one or two layers
  later, when its device-to-host copy is done, and reloaded (allocated on a copy stream, prefetched
  like the weights) before the backward of that layer; the others stay on the device;
- each weight gradient is reduced on a collective stream: a flat bucket of its size is allocated
  there and freed one layer later (a reduce-scatter still running), then dW_i is offloaded: cast
  to half its size in a buffer of an offload stream (dW_i is freed at once), and that buffer is
  freed when its copy is done, one or two layers later;
- when each offloaded block is freed (one or two layers after its copy started) and the order of
  the frees that come due together are drawn from the seed once, for the whole job: the program
  frees at the same points every step, as a snapshot's free_requested events do; with
  --free-jitter they are drawn again every step (the order in which copies complete, as
  free_completed events would give it: a harder case, where no two steps free alike).

Usage: scripts/gen_offload_trace.py [-o FILE] [--layers N] [--steps S] [--seed K] [--no-prefetch]
                                    [--streams N] [--prefetch-depth D] [--offload-fraction F]
                                    [--free-jitter]
The trace is synthetic: it says so in its header comment and is never committed as data
(`make bench` writes it under build/).
"""
import argparse
import random
import sys

MiB = 1 << 20
KiB = 1 << 10


class Writer:
    """Gives out addresses as a caching allocator would and writes the trace's lines."""

    BASE = 0x7F0000000000

    def __init__(self, out):
        self.out = out
        self.next_addr = self.BASE
        self.cached = {}  # (stream, rounded size) -> [addresses], last freed last
        self.live = {}    # address -> (stream, size)
        self.t = 1_000_000
        self.nalloc = 0

    @staticmethod
    def rounded(size):
        return max(512, (size + 511) // 512 * 512)

    def _take(self, stream, size):
        key = (stream, self.rounded(size))
        lst = self.cached.get(key)
        if lst:
            return lst.pop()
        addr = self.next_addr
        # leave a 2 MiB aligned gap between new blocks, like separate segments
        self.next_addr += (self.rounded(size) + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
        return addr

    def prefix(self, stream, size):
        addr = self._take(stream, size)
        self.live[addr] = (stream, size)
        self.out.write(f"p 0 {stream:#x} {addr:#x} {size}\n")
        return addr

    def alloc(self, stream, size, dt=5):
        self.t += dt
        addr = self._take(stream, size)
        self.live[addr] = (stream, size)
        self.nalloc += 1
        self.out.write(f"a 0 {stream:#x} {addr:#x} {size} {self.t}\n")
        return addr

    def free(self, addr, dt=5):
        self.t += dt
        stream, size = self.live.pop(addr)
        self.cached.setdefault((stream, self.rounded(size)), []).append(addr)
        self.out.write(f"f 0 {stream:#x} {addr:#x} {size} {self.t}\n")

    def compute(self, nbytes):
        # ~ 200 GB/s of work: informative times only
        self.t += max(1, nbytes // (200 * KiB))


def model(args):
    rng = random.Random(args.seed)
    weights = [rng.randint(args.min_mib * MiB // (4 * KiB), args.max_mib * MiB // (4 * KiB)) * 4 * KiB
               for _ in range(args.layers)]
    acts = [int(w * rng.uniform(0.10, 0.30)) // 512 * 512 for w in weights]
    work = [int(a * rng.uniform(0.20, 0.60)) // 512 * 512 for a in acts]
    stats = [rng.randint(16, 64) * KiB for _ in weights]
    return weights, acts, work, stats


def write(args, out):
    weights, acts, work, stats = model(args)
    N = args.layers
    C, S = 0, args.copy_stream
    w = Writer(out)
    out.write("# memshim-trace 1\n")
    out.write(f"# SYNTHETIC offload/reload training trace from scripts/gen_offload_trace.py: layers={N} "
              f"steps={args.steps} seed={args.seed} weights {args.min_mib}-{args.max_mib} MiB "
              f"prefetch={'on' if args.prefetch else 'off'} copy_stream={S:#x}\n")
    out.write(f"# weights MiB: {' '.join(f'{x / MiB:.1f}' for x in weights)}\n")
    out.write(f"# total weights {sum(weights) / MiB:.0f} MiB, saved activations {sum(acts) / MiB:.0f} MiB\n")
    out.write("r 0 0 0\n")
    # resident on the device for the whole job
    for size in (64 * MiB, 96 * MiB, 5056, 4 * KiB, 512):
        w.prefix(C, size)

    batch, mask, logits_sz = 8 * MiB, 96 * KiB, 64 * MiB
    for step in range(args.steps):
        out.write(f"e {step}\n")
        x = w.alloc(C, batch)
        m = w.alloc(C, mask)
        # ---- forward
        W = {}
        saved = {}
        if args.prefetch:
            W[0] = w.alloc(S, weights[0], dt=weights[0] // (20 * KiB))
        for i in range(N):
            if not args.prefetch:
                W[i] = w.alloc(S, weights[i], dt=weights[i] // (20 * KiB))
            elif i + 1 < N:  # prefetch the next layer while this one computes
                W[i + 1] = w.alloc(S, weights[i + 1])
            ws = w.alloc(C, work[i])
            a = w.alloc(C, acts[i])
            s1 = w.alloc(C, stats[i])
            s2 = w.alloc(C, stats[i])
            w.compute(weights[i] + acts[i])
            w.free(ws)
            saved[i] = (a, s1, s2)
            w.free(W.pop(i))  # offload: the reloaded copy is dropped
        # ---- loss
        lg = w.alloc(C, logits_sz)
        loss = w.alloc(C, 512)
        g = w.alloc(C, logits_sz)
        w.free(lg)
        w.free(loss)
        # ---- backward
        if args.prefetch:
            W[N - 1] = w.alloc(S, weights[N - 1], dt=weights[N - 1] // (20 * KiB))
        for i in reversed(range(N)):
            if not args.prefetch:
                W[i] = w.alloc(S, weights[i], dt=weights[i] // (20 * KiB))
            elif i > 0:
                W[i - 1] = w.alloc(S, weights[i - 1])
            dx = w.alloc(C, acts[i - 1] if i > 0 else batch)
            ws = w.alloc(C, work[i])
            dw = w.alloc(C, weights[i])
            w.compute(2 * weights[i] + acts[i])
            w.free(ws)
            a, s1, s2 = saved.pop(i)
            w.free(s2)
            w.free(s1)
            w.free(a)
            w.free(g)  # the gradient of this layer's output
            g = dx
            w.compute(weights[i])  # dW_i copied to the host
            w.free(dw)
            w.free(W.pop(i))
        w.free(g)
        w.free(m)
        w.free(x)
        w.compute(sum(weights))  # the optimizer step on the host
    return w.nalloc


def stream_roles(n):
    """Raw stream values for the compute stream and the copy, offload and collective streams."""
    rest = n - 1
    h2d = max(1, (rest * 4 + 9) // 10)
    d2h = max(1, (rest * 3 + 9) // 10) if rest > 1 else 0
    coll = rest - h2d - d2h
    ids = [0x55D0C0DE0000 + 0x100 * k for k in range(rest)]
    return 0, ids[:h2d], ids[h2d:h2d + d2h] or ids[:h2d], ids[h2d + d2h:] or ids[:h2d]


def write_multi(args, out):
    """The step of write() over many streams (the module docstring's second model)."""
    weights, acts, work, stats = model(args)
    rng = random.Random(args.seed * 7919 + args.streams)
    N, D = args.layers, args.prefetch_depth
    C, H2D, D2H, COLL = stream_roles(args.streams)
    offl = [rng.random() < args.offload_fraction for _ in range(N)]
    w = Writer(out)
    out.write("# memshim-trace 1\n")
    out.write(f"# SYNTHETIC offload/reload training trace from scripts/gen_offload_trace.py: layers={N} "
              f"steps={args.steps} seed={args.seed} weights {args.min_mib}-{args.max_mib} MiB "
              f"streams={args.streams} (copy {len(H2D)}, offload {len(D2H)}, collective {len(COLL)}) "
              f"prefetch_depth={D} offload_fraction={args.offload_fraction}"
              f"{' free_jitter' if args.free_jitter else ''}\n")
    out.write(f"# weights MiB: {' '.join(f'{x / MiB:.1f}' for x in weights)}\n")
    out.write(f"# activations offloaded: {' '.join(str(i) for i in range(N) if offl[i])}\n")
    out.write("r 0 0 0\n")
    for size in (64 * MiB, 96 * MiB, 5056, 4 * KiB, 512):
        w.prefix(C, size)
    batch, mask, logits_sz = 8 * MiB, 96 * KiB, 64 * MiB
    pending = []  # [layers left, address]: frees that wait for a copy or a collective to finish
    # when the frees come: the job's own generator, which goes on from step to step, with
    # --free-jitter; else one restarted at every step, so that every step frees alike
    frng = [rng]

    def later(addr, lo=1, hi=2):
        pending.append([frng[0].randint(lo, hi), addr])

    def tick():  # one layer has passed: the copies and collectives due now complete
        due = [p for p in pending if p[0] <= 1]
        for p in pending:
            p[0] -= 1
        frng[0].shuffle(due)
        for p in due:
            pending.remove(p)
            w.free(p[1])

    for step in range(args.steps):
        if not args.free_jitter:
            frng[0] = random.Random(args.seed * 7919 + args.streams + 1)
        out.write(f"e {step}\n")
        x = w.alloc(C, batch)
        m = w.alloc(C, mask)
        W, saved, back = {}, {}, {}
        # ---- forward: weights reloaded D layers ahead on the copy streams
        for i in range(min(D, N)):
            W[i] = w.alloc(H2D[i % len(H2D)], weights[i], dt=weights[i] // (20 * KiB))
        for i in range(N):
            if i + D < N:
                W[i + D] = w.alloc(H2D[(i + D) % len(H2D)], weights[i + D])
            ws = w.alloc(C, work[i])
            a = w.alloc(C, acts[i])
            s1 = w.alloc(C, stats[i])
            s2 = w.alloc(C, stats[i])
            w.compute(weights[i] + acts[i])
            w.free(ws)
            w.free(W.pop(i))
            if offl[i]:  # the activation goes to the host; its device copy is freed when that is done
                later(a)
                saved[i] = (None, s1, s2)
            else:
                saved[i] = (a, s1, s2)
            tick()
        lg = w.alloc(C, logits_sz)
        loss = w.alloc(C, 512)
        g = w.alloc(C, logits_sz)
        w.free(lg)
        w.free(loss)
        # ---- backward: weights (and offloaded activations) reloaded D layers ahead
        order = list(reversed(range(N)))

        def reload(i):
            st = H2D[i % len(H2D)]
            W[i] = w.alloc(st, weights[i])
            if offl[i]:
                back[i] = w.alloc(H2D[(i + 1) % len(H2D)], acts[i])

        for i in order[:D]:
            reload(i)
        for k, i in enumerate(order):
            if k + D < N:
                reload(order[k + D])
            dx = w.alloc(C, acts[i - 1] if i > 0 else batch)
            ws = w.alloc(C, work[i])
            dw = w.alloc(C, weights[i])
            w.compute(2 * weights[i] + acts[i])
            w.free(ws)
            a, s1, s2 = saved.pop(i)
            w.free(s2)
            w.free(s1)
            w.free(back.pop(i) if a is None else a)
            w.free(g)
            g = dx
            bucket = w.alloc(COLL[i % len(COLL)], weights[i])  # the gradient's reduce-scatter
            later(bucket, 1, 1)
            w.free(W.pop(i))
            # dW_i goes to the host as bf16: the cast is made on an offload stream and freed when
            # its copy is done; dW_i itself is freed at once
            half = w.alloc(D2H[i % len(D2H)], weights[i] // 2)
            w.free(dw)
            later(half)
            tick()
        while pending:
            tick()
        w.free(g)
        w.free(m)
        w.free(x)
        w.compute(sum(weights))
    return w.nalloc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", help="file to write (default: stdout)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-mib", type=int, default=50)
    ap.add_argument("--max-mib", type=int, default=400)
    ap.add_argument("--copy-stream", type=lambda s: int(s, 0), default=0x55D0C0DE0000)
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                    help="reload each layer just before its use (one weight buffer live at a time)")
    ap.add_argument("--streams", type=int, default=2,
                    help="streams of the job: 2 (compute and one copy stream, the first model) or 3 to 64 "
                         "(copy, offload and collective streams: the second model)")
    ap.add_argument("--prefetch-depth", type=int, default=2, help="with --streams >= 3: layers reloaded ahead")
    ap.add_argument("--offload-fraction", type=float, default=0.75,
                    help="with --streams >= 3: the chance that a layer's saved activation is offloaded")
    ap.add_argument("--free-jitter", action="store_true",
                    help="with --streams >= 3: when offloaded blocks are freed is drawn again every step")
    args = ap.parse_args()
    if args.layers < 1 or args.steps < 1 or not 1 <= args.min_mib <= args.max_mib:
        ap.error("need --layers >= 1, --steps >= 1 and 1 <= --min-mib <= --max-mib")
    if not 2 <= args.streams <= 64 or args.prefetch_depth < 1 or not 0 <= args.offload_fraction <= 1:
        ap.error("need 2 <= --streams <= 64, --prefetch-depth >= 1 and 0 <= --offload-fraction <= 1")
    gen = write if args.streams == 2 else write_multi
    if args.output:
        with open(args.output, "w") as f:
            gen(args, f)
    else:
        gen(args, sys.stdout)


if __name__ == "__main__":
    main()
