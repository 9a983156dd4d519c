#!/usr/bin/env python3
"""Validation of the PyTorch allocator models against what PyTorch itself recorded, per snapshot in
../shared/traces (skipped with a message when that folder is absent), and the issue's targets for
`memshim-replay --compare`.

For each snapshot, independently of the C reader (a stdlib unpickler that refuses every global),
this reads the native allocator's own decisions: its segment_alloc / segment_free events in order,
the segments at dump time, reserved bytes at the end and at the peak of the window. It then replays
the snapshot with `memshim-replay --policy torch --validate --json` (the snapshot's recorded
allocator settings, the model seeded with the segments that existed when recording began) and
checks that the model makes the same decisions:
  - the same final reserved bytes and the same segments at the end (addresses and sizes);
  - the same sequence of segment sizes (cudaMalloc) and of freed segments (cudaFree);
  - peak reserved within 5% of the recorded one (it is in fact exact);
  - every allocation of the recorded window at the address PyTorch gave it.
Prints one line per case and ends with "N passed, N failed, N skipped"."""
import json
import os
import pickle
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, TRACES, case, finish, skip  # noqa: E402
REPLAY = os.path.join(BUILD, "memshim-replay")




class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")


def recorded(path):
    """What the native allocator did, per device: segment events, final segments, reserved."""
    with open(path, "rb") as f:
        snap = SafeUnpickler(f).load()
    segs = snap.get("segments") or []
    out = {}
    traces = snap.get("device_traces") or []
    devices = sorted({s["device"] for s in segs} | {d for d, t in enumerate(traces) if t})
    for dev in devices:
        evs = traces[dev] if dev < len(traces) else []
        final = sorted((s["address"], s["total_size"]) for s in segs if s["device"] == dev)
        final_reserved = sum(sz for _, sz in final)
        allocs = [e["size"] for e in evs if e["action"] == "segment_alloc"]
        frees = [e["size"] for e in evs if e["action"] == "segment_free"]
        net = peak_net = 0
        for e in evs:
            if e["action"] in ("segment_alloc", "segment_map"):
                net += e["size"]
            elif e["action"] in ("segment_free", "segment_unmap"):
                net -= e["size"]
            peak_net = max(peak_net, net)
        initial = final_reserved - net
        out[dev] = {"allocs": allocs, "frees": frees, "final": final, "final_reserved": final_reserved,
                    "peak_reserved": initial + peak_net, "initial_reserved": initial, "events": len(evs),
                    "expandable": any(s.get("is_expandable") for s in segs if s["device"] == dev)}
    return out


def run(*args):
    p = subprocess.run([REPLAY, *args], capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


if not os.path.isdir(TRACES):
    skip("model validation on real traces", f"{TRACES} not found")
    finish()

picks = sorted(os.path.relpath(os.path.join(dp, f), TRACES)
               for dp, _, fs in os.walk(TRACES) for f in fs if f.endswith(".pickle"))
case("traces found", len(picks) > 0, "no .pickle files")
for rel in picks:
    path = os.path.join(TRACES, rel)
    try:
        rec = recorded(path)
    except Exception as e:  # a snapshot the stdlib reader cannot take is not the model's fault
        skip(f"{rel}", f"unreadable by the reference reader: {e}")
        continue
    rc, out, err = run("--policy", "torch", "--validate", "--json", path)
    if rc != 0:
        case(f"{rel}: replays under the torch model", False, err.strip())
        continue
    for line in out.splitlines():
        d = json.loads(line)
        r = rec.get(d["device"])
        if r is None:
            case(f"{rel}: device {d['device']} known to the reference reader", False, "")
            continue
        tag = f"{rel} dev {d['device']}"
        if r["expandable"]:
            skip(tag, "recorded with expandable segments: the native model does not apply")
            continue
        start = "empty allocator" if r["initial_reserved"] == 0 else "mid-run"
        case(f"{tag}: final reserved {d['final_reserved_bytes']} == recorded",
             d["final_reserved_bytes"] == r["final_reserved"],
             f"model {d['final_reserved_bytes']} recorded {r['final_reserved']}")
        case(f"{tag}: same final segments",
             d["final_segments_missing"] == 0 and d["final_segments_extra"] == 0
             and d["final_segments"] == len(r["final"]),
             f"missing {d['final_segments_missing']} extra {d['final_segments_extra']}")
        same_allocs = d["model_segment_allocs"] == r["allocs"]
        case(f"{tag} ({start}): same sequence of {len(r['allocs'])} segment sizes", same_allocs,
             f"model {len(d['model_segment_allocs'])} {d['model_segment_allocs'][:8]} "
             f"recorded {len(r['allocs'])} {r['allocs'][:8]}")
        case(f"{tag}: same {len(r['frees'])} segment frees, in order", d["model_segment_frees"] == r["frees"],
             f"model {len(d['model_segment_frees'])} recorded {len(r['frees'])}")
        pk, rpk = d["unlimited_peak_reserved_bytes"], r["peak_reserved"]
        case(f"{tag}: peak reserved within 5% ({pk / rpk if rpk else 0:.4f})",
             rpk > 0 and abs(pk - rpk) <= 0.05 * rpk, f"model {pk} recorded {rpk}")
        if d["recorded_window_allocs"]:
            case(f"{tag}: {d['alloc_address_matches']}/{d['recorded_window_allocs']} allocations at the "
                 "recorded address", d["alloc_address_matches"] == d["recorded_window_allocs"],
                 f"{d['alloc_address_matches']} of {d['recorded_window_allocs']}")
        case(f"{tag}: the C reader's segment events match", d.get("recorded_segment_allocs") == r["allocs"]
             and d.get("recorded_segment_frees") == r["frees"], "reader disagrees with the reference")

# The targets on --compare: memshim's minimum capacity is no larger than either model's, and at
# least 10% below the native model's wherever that needs more than 1.15x peak live; all in < 60 s.
paths = [os.path.join(TRACES, p) for p in picks]
t0 = time.time()
rc, out, err = run("--compare", "--json", "--capacity", "A100-80GB", *paths)
wall = time.time() - t0
case(f"--compare over {len(paths)} snapshots runs in under a minute ({wall:.1f} s)", rc == 0 and wall < 60,
     f"rc={rc} {wall:.1f}s {err.strip()[:200]}")
rows = [json.loads(l) for l in out.splitlines()]
case("--compare gives one JSON line per device trace", len(rows) >= len(paths), len(rows))
for d in rows:
    rel = os.path.relpath(d["trace"], TRACES)
    pol = d["policies"]
    ms, tn, te = (pol[k]["min_capacity_bytes"] for k in ("memshim", "torch", "torch-expandable"))
    live = d["peak_live_bytes"] or 1
    case(f"{rel}: memshim min {ms / live:.4f} <= torch {tn / live:.4f} and expandable {te / live:.4f}",
         ms <= tn and ms <= te, f"{ms} {tn} {te}")
    if tn > 1.15 * live:
        case(f"{rel}: memshim at least 10% below the native model", ms <= 0.9 * tn, f"{ms} vs {tn}")
    for k, v in pol.items():
        fits = v["min_capacity_bytes"] <= d["capacity_bytes"]
        if v["fits"] != (fits and v["ooms_at_capacity"] == 0) or (not v["fits"] and v["short_bytes"] <= 0 and fits):
            case(f"{rel}: {k} fit verdict consistent", False, v)

finish()
