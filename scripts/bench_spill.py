#!/usr/bin/env python3
"""make bench, the section "Spill to host memory": every trace replayed below its live peak, at
0.95x and 0.9x (rounded down to a 2 MiB page), memshim's pool in tensor mode on the simulated
device, once without spill and once with `--spill host` (docs/pool.md "Spill"), first pass.
Per trace and capacity: OOMs without and with spill, the spilled peak and what moved to the host,
the modelled transfer seconds over PCIe Gen5 x16 and over Grace Hopper's NVLink-C2C (the cost
table's copy rows, docs/benchmarks.md), and the least a pass pays reading every spilled byte once
over each link. The replay is deterministic: every figure is the same at every run.

Usage: scripts/bench_spill.py REPLAY TRACE...
"""
import json
import subprocess
import sys

PAGE, MiB = 2 << 20, 1 << 20


def replay(exe, *args):
    p = subprocess.run([exe, "--json", *args], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.splitlines()[0])


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    exe, traces = argv[1], argv[2:]
    print("| trace | peak live (MiB) | capacity | OOMs without / with spill | spilled peak (MiB) | to host (MiB) "
          "| transfers s, PCIe5 / C2C | reading once per pass s, PCIe5 / C2C |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    served = total = refused = 0
    for t in traces:
        name = t.split("traces/")[-1]
        try:
            peak = replay(exe, t)["peak_live_bytes"]
        except subprocess.CalledProcessError as e:
            print(f"| {name} | (replay failed: {e.stderr.strip()[-120:]}) |||||||")
            continue
        for f in (0.95, 0.9):
            cap = int(peak * f) // PAGE * PAGE
            off = replay(exe, "--capacity", str(cap), t)
            on = replay(exe, "--spill", "host", "--capacity", str(cap), t)
            c2c = replay(exe, "--spill", "host", "--link", "c2c", "--capacity", str(cap), t)
            if not off["ooms"]:
                continue  # the trace's own peak was a moment: it fits without spilling
            total += 1
            served += on["ooms"] == 0
            refused += on["ooms"] > 0
            print(f"| {name} | {peak / MiB:.0f} | {f}x | {off['ooms']} / {on['ooms']} | "
                  f"{on['spilled_peak_bytes'] / MiB:.0f} | {on['spill_to_host_bytes'] / MiB:.0f} | "
                  f"{on['spill_transfer_seconds']:.3f} / {c2c['spill_transfer_seconds']:.3f} | "
                  f"{on['spill_read_seconds_per_pass_lower_bound']:.3f} / "
                  f"{c2c['spill_read_seconds_per_pass_lower_bound']:.3f} |")
    print()
    print(f"trace-capacity pairs that OOM without spill: {total}; served with spill: {served}; still refused: {refused} "
          "(what is missing is more than the memory allocated before the step: nothing of the current step spills)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
