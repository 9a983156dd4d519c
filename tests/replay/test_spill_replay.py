#!/usr/bin/env python3
"""memshim-replay --spill host (issue 20, docs/replay.md): a trace replayed below its live peak.

On a SYNTHETIC offload trace (always, at 0.95x) and a real recording (when ../shared/traces is
there, at 0.9x the live peak): without spill the replay OOMs, with it none, and what moved is at least what
the capacity lacks; --check holds the pool's invariants (host pages counted apart) through three
passes; --spill-max below what is needed refuses requests; --link c2c prices the same bytes at
Grace Hopper's rates; bad usage is refused with a message.
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pyharness import BUILD, ROOT, TRACES, case, finish, skip, step  # noqa: E402

REPLAY = os.path.join(BUILD, "memshim-replay")
OFFLOAD = os.path.join(ROOT, "scripts", "gen_offload_trace.py")
PAGE = 2 << 20
REAL = "cs336/notHanmin/memory_snapshot.pickle"


def run(*args):
    return subprocess.run([REPLAY, *args], capture_output=True, text=True, timeout=600)


def js(*args):
    p = run("--json", *args)
    if p.returncode:
        raise RuntimeError(f"memshim-replay {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout.splitlines()[0])


def cases_for(name, path, frac):
    peak = js(path)["peak_live_bytes"]
    cap = int(peak * frac) // PAGE * PAGE
    off = js("--capacity", str(cap), path)
    on = js("--spill", "host", "--capacity", str(cap), "--passes", "3", path)
    case(f"{name}: at {frac}x the live peak, OOMs without spill ({off['ooms']}), none with it",
         off["ooms"] > 0 and on["ooms"] == 0 and on["steady_ooms"] == 0, f"spill: {on['ooms']} / {on['steady_ooms']} OOMs")
    case(f"{name}: spilled at its peak ({on['spilled_peak_bytes'] >> 20} MiB) at least what the capacity lacks "
         f"({(peak - cap) >> 20} MiB)", on["spilled_peak_bytes"] >= peak - cap and on["spill_to_host_pages"] > 0,
         {k: v for k, v in on.items() if "spill" in k})
    case(f"{name}: every spill figure is in --json", all(k in on for k in (
        "spill", "spill_link", "spilled_peak_bytes", "spill_to_host_bytes", "spill_to_device_bytes",
        "spill_to_host_pages", "spill_to_device_pages", "spill_transfer_seconds",
        "spill_read_seconds_per_pass_lower_bound", "last_pass_spill_to_host_bytes")), sorted(on))
    case(f"{name}: transfers cost what the table says: {on['spill_transfer_seconds']:.3f} s for "
         f"{on['spill_to_host_bytes'] >> 20} MiB to the host",
         on["spill_transfer_seconds"] >= on["spill_to_host_bytes"] / 52.8e9
         and on["spill_read_seconds_per_pass_lower_bound"] > 0, on["spill_transfer_seconds"])
    c2c = js("--spill", "host", "--link", "c2c", "--capacity", str(cap), path)
    r = on["spill_read_seconds_per_pass_lower_bound"] / c2c["spill_read_seconds_per_pass_lower_bound"]
    case(f"{name}: --link c2c: the same bytes, read {r:.2f}x faster (335.3 / 57.0 GB/s)",
         c2c["spilled_peak_bytes"] == on["spilled_peak_bytes"] and abs(r - 335.3 / 57.0) < 0.01, r)
    p = run("--spill", "host", "--capacity", str(cap), "--passes", "3", "--check", path)
    case(f"{name}: --check through three passes with spill: the invariants hold", p.returncode == 0, p.stderr[-400:])
    lack = peak - cap
    capped = js("--spill", "host", "--spill-max", str(lack // 2 // PAGE * PAGE), "--capacity", str(cap), path)
    case(f"{name}: --spill-max half of what is needed: requests refused, never more spilled than the cap",
         capped["ooms"] > 0 and capped["spill_refused_requests"] > 0 and capped["spilled_peak_bytes"] <= lack // 2,
         {k: v for k, v in capped.items() if "spill" in k or k == "ooms"})


step("bad usage")
p = run("--spill", "host", "--capacity", "auto", "x.txt")
case("--spill host with --capacity auto is refused with the reason", p.returncode == 2 and "needs --capacity" in p.stderr,
     p.stderr)
p = run("--spill", "disk", "--capacity", "1G", "x.txt")
case("--spill disk is refused", p.returncode == 2 and "expected host or off" in p.stderr, p.stderr)
p = run("--link", "nvlink5", "--capacity", "1G", "x.txt")
case("--link nvlink5 is refused", p.returncode == 2 and "expected pcie5 or c2c" in p.stderr, p.stderr)

with tempfile.TemporaryDirectory() as tmp:
    step("SYNTHETIC offload trace, seed 1", timeout=240)
    path = os.path.join(tmp, "offload.txt")
    subprocess.run([sys.executable, OFFLOAD, "-o", path, "--seed", "1"], check=True, capture_output=True, timeout=60)
    cases_for("SYNTHETIC offload seed 1", path, 0.95)
    # what no spill can serve: its own step needs more than the capacity (weights are reloaded per
    # layer: only about 180 MiB is cold), refused with PyTorch's OOM, nothing of the step spilled
    peak = js(path)["peak_live_bytes"]
    cap = int(peak * 0.85) // PAGE * PAGE
    d = js("--spill", "host", "--capacity", str(cap), path)
    case("SYNTHETIC offload seed 1 at 0.85x: more than what is cold is missing: refused, not served",
         d["ooms"] > 0 and d["spill_refused_requests"] > 0 and d["spilled_peak_bytes"] <= 200 << 20,
         {k: v for k, v in d.items() if "spill" in k or k == "ooms"})
real = os.path.join(TRACES, REAL)
if os.path.exists(real):
    step(f"{REAL}", timeout=300)
    cases_for(REAL, real, 0.9)
else:
    skip(REAL, f"not in {TRACES}")
finish()
