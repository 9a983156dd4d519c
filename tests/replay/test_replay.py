#!/usr/bin/env python3
"""Tests of build/memshim-replay: its CLI contract, bad input, and the pool's targets on the real
PyTorch snapshots in ../shared/traces (skipped with a message when that folder is absent).
Prints one line per case and ends with "N passed, N failed, N skipped"."""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, TRACES, case, finish, skip  # noqa: E402
REPLAY = os.path.join(BUILD, "memshim-replay")




def run(*args):
    p = subprocess.run([REPLAY, *args], capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


REQUIRED = ["trace", "device", "policy", "events", "allocs", "peak_live_bytes", "peak_reserved_bytes",
            "capacity_bytes", "min_capacity_bytes", "ooms", "map_ops", "unmap_ops", "wall_seconds",
            "events_per_second"]

with tempfile.TemporaryDirectory() as tmp:
    rc, out, err = run()
    case("no arguments is a usage error", rc == 2 and "usage" in err, f"rc={rc}")
    rc, out, err = run(os.path.join(tmp, "missing.pickle"))
    case("missing file: exit 2 with the reason", rc == 2 and "missing.pickle" in err, f"rc={rc} err={err!r}")
    junk = os.path.join(tmp, "junk.bin")
    open(junk, "wb").write(b"\x00\x01garbage" * 10)
    rc, out, err = run(junk)
    case("unrecognised format: exit 2", rc == 2 and err.strip() != "", f"rc={rc} err={err!r}")
    evil = os.path.join(tmp, "evil.pickle")
    # protocol 2: GLOBAL 'os system' then REDUCE: must be refused, never executed
    open(evil, "wb").write(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    rc, out, err = run(evil)
    case("pickle with a global is refused", rc == 2 and ("GLOBAL" in err or "subset" in err), f"rc={rc} err={err!r}")
    bad = os.path.join(tmp, "bad.txt")
    open(bad, "w").write("# memshim-trace 1\na 0 0x0 0x1000 zz\n")
    rc, out, err = run(bad)
    case("malformed text trace names the line", rc == 2 and ":2" in err, f"rc={rc} err={err!r}")
    good = os.path.join(tmp, "good.txt")
    lines = ["# memshim-trace 1"]
    for i in range(200):
        lines.append(f"a 0 0x0 {0x10000 + i * 0x1000000:#x} {(i % 7 + 1) * 3 * 1024 * 1024}")
        if i >= 10:
            j = i - 10
            lines.append(f"f 0 0x0 {0x10000 + j * 0x1000000:#x} {(j % 7 + 1) * 3 * 1024 * 1024}")
    open(good, "w").write("\n".join(lines) + "\n")
    rc, out, err = run("--json", "--capacity", "auto", "--passes", "2", good)
    try:
        d = json.loads(out.splitlines()[0])
        missing = [k for k in REQUIRED if k not in d]
        case("--json carries every documented field", rc == 0 and not missing, f"missing {missing}")
        case("auto capacity is at least peak live and within 3%",
             d["peak_live_bytes"] <= d["min_capacity_bytes"] <= d["peak_live_bytes"] * 1.03 + 4 * 2**20,
             f"{d['min_capacity_bytes']} vs {d['peak_live_bytes']}")
        case("no OOM at the minimum capacity", d["ooms"] == 0, d["ooms"])
        d_auto_min = d["min_capacity_bytes"]
    except (ValueError, IndexError, KeyError) as e:
        case("--json output parses", False, f"{e}: {out!r} {err!r}")
    # the page model (--max-handle one page) and the pool agree under a limit (issue 15); no limit,
    # the pool's own handles cover a block's whole pages, the page model's one page each
    rc, out, err = run("--json", "--capacity", "auto", "--max-handle", "2MiB", good)
    rc2, out2, err2 = run("--json", "--max-handle", "2MiB", good)
    rc3, out3, err3 = run("--json", good)
    try:
        d, dn = json.loads(out.splitlines()[0]), json.loads(out2.splitlines()[0])
        d0 = json.loads(out3.splitlines()[0])
        case("--max-handle 2MiB: the page model's minimum capacity is the pool's, one create per page with no limit",
             rc == 0 and d["max_handle_bytes"] == 2 * 2**20 and d["min_capacity_bytes"] == d_auto_min
             and dn["driver_calls"]["create"] > d0["driver_calls"]["create"],
             f"{d.get('min_capacity_bytes')} vs {d_auto_min}; creates {dn['driver_calls']['create']} "
             f"vs {d0['driver_calls']['create']}")
    except (ValueError, IndexError, KeyError, NameError) as e:
        case("--max-handle output parses", False, f"{e}: {out[:200]!r} {err!r}")
    rc, out, err = run("--max-handle", "1MiB", good)
    case("--max-handle below a page is refused (exit 2)", rc == 2 and "--max-handle" in err, f"rc={rc} {err!r}")
    rc, out, err = run("--json", "--capacity", "8MiB", good)
    try:
        d = json.loads(out.splitlines()[0])
        case("an OOM during replay is a result (exit 0, ooms > 0)", rc == 0 and d["ooms"] > 0, f"rc={rc} {d['ooms']}")
    except (ValueError, IndexError, KeyError) as e:
        case("--json output parses at small capacity", False, str(e))
    # --device: the same pool through the real-driver backend, here on the driver double
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(BUILD, "double"), CUDBL_CAPACITY="2G")
    p = subprocess.run([REPLAY, "--device", "--json", good], capture_output=True, text=True, timeout=300, env=env)
    rc2, out2, err2 = run("--json", good)
    try:
        dd, ds = json.loads(p.stdout.splitlines()[0]), json.loads(out2.splitlines()[0])
        case("--device (driver double) reserves what the simulation reserves",
             p.returncode == 0 and dd["peak_reserved_bytes"] == ds["peak_reserved_bytes"] and dd["ooms"] == 0
             and dd["map_ops"] == ds["map_ops"], f"{dd['peak_reserved_bytes']} vs {ds['peak_reserved_bytes']}")
    except (ValueError, IndexError, KeyError) as e:
        case("--device output parses", False, f"{e}: {p.stdout!r} {p.stderr[-300:]!r}")
    # found by review: paths and sizes that broke the JSON or the arithmetic
    try:
        odd = os.path.join(tmp.encode(), b'q"d\\x\xff.txt')
        with open(odd, "wb") as f:
            f.write(open(good, "rb").read())
        p = subprocess.run([REPLAY.encode(), b"--json", odd], capture_output=True, timeout=300)
        lines = p.stdout.decode("utf-8").splitlines()
        case("--json stays valid JSON for a path with quotes, backslashes and non-UTF-8 bytes",
             p.returncode == 0 and lines and all(json.loads(l) for l in lines), p.stdout[:200])
    except (ValueError, UnicodeDecodeError) as e:
        case("--json stays valid JSON for an odd path", False, str(e))
    huge = os.path.join(tmp, "huge.txt")
    open(huge, "w").write("# memshim-trace 1\na 0 0 0x1000 18446744073709551615\n")
    rc, out, err = run("--compare", "--capacity", "T4", huge)
    case("a block larger than 2^48 bytes is refused with the line, not wrapped around",
         rc == 2 and "huge.txt:2" in err and "out of range" in err, f"rc={rc} {err!r}")
    for args, why in [(["--policy", "torch", "--torch-conf", "roundup_power2_divisions:[256:1]x"], "text after ']'"),
                      (["--policy", "torch", "--torch-conf", "roundup_power2_divisions:4294967296"], "huge divisions")]:
        rc, out, err = run(*args, good)
        case(f"usage error, not silently ignored: {why}", rc == 2 and err.strip() != "", f"rc={rc} {err!r}")
    rc, out, err = run("--capacity", "lots", good)
    case("bad --capacity is a usage error", rc == 2 and "capacity" in err, f"rc={rc}")

    # ---- peer allocator models and capacity planning (docs/models.md) ----
    for pol in ("torch", "torch-expandable"):
        rc, out, err = run("--policy", pol, "--json", "--capacity", "auto", good)
        try:
            d = json.loads(out.splitlines()[0])
            missing = [k for k in REQUIRED if k not in d]
            case(f"--policy {pol}: JSON with the documented fields", rc == 0 and d["policy"] == pol and not missing,
                 f"rc={rc} policy={d.get('policy')} missing={missing}")
            case(f"--policy {pol}: min capacity >= peak live, no OOM there",
                 d["min_capacity_bytes"] >= d["peak_live_bytes"] and d["ooms"] == 0,
                 f"{d['min_capacity_bytes']} vs {d['peak_live_bytes']}, ooms {d['ooms']}")
        except (ValueError, IndexError, KeyError) as e:
            case(f"--policy {pol} output parses", False, f"{e}: {out!r} {err!r}")
    rc, out, err = run("--policy", "tensorflow", good)
    case("unknown --policy is a usage error", rc == 2 and "policy" in err, f"rc={rc} {err!r}")
    rc, out, err = run("--policy", "torch", "--torch-conf", "max_split_size_mb:lots", good)
    case("bad --torch-conf is a usage error naming the key", rc == 2 and "max_split_size_mb" in err, f"rc={rc} {err!r}")
    rc, out, err = run("--policy", "torch", "--torch-conf", "no_such_option:1", good)
    case("unknown --torch-conf key is a usage error", rc == 2 and "no_such_option" in err, f"rc={rc} {err!r}")
    rc, out, err = run("--policy", "torch", "--json", "--torch-conf",
                       "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.8", good)
    try:
        d = json.loads(out.splitlines()[0])
        case("--torch-conf is applied and echoed", rc == 0 and "max_split_size_mb:64" in d["torch_conf"]
             and "garbage_collection_threshold:0.8" in d["torch_conf"], d.get("torch_conf"))
    except (ValueError, IndexError, KeyError) as e:
        case("--torch-conf output parses", False, f"{e}: {out!r} {err!r}")
    rc, out, err = run("--json", "--capacity", "A100-80GB", good)
    try:
        d = json.loads(out.splitlines()[0])
        case("--capacity takes a device name (A100-80GB: 81920 MiB less 512)",
             rc == 0 and d["capacity_bytes"] == (81920 - 512) * 2**20, d.get("capacity_bytes"))
    except (ValueError, IndexError, KeyError) as e:
        case("--capacity A100-80GB output parses", False, f"{e}: {out!r} {err!r}")
    rc, out, err = run("--capacity", "h100-80gb", "--policy", "torch", good)
    case("device names are case-insensitive", rc == 0, f"rc={rc} {err!r}")
    rc, out, err = run("--compare", "--json", "--capacity", "8MiB", good)
    try:
        d = json.loads(out.splitlines()[0])
        pol = d["policies"]
        case("--compare --json: one object with the three policies",
             rc == 0 and sorted(pol) == ["memshim", "torch", "torch-expandable"], sorted(pol))
        ok = all(v["min_capacity_bytes"] >= d["peak_live_bytes"] and v["fits"] is False and v["short_bytes"] > 0
                 and v["ooms_at_capacity"] > 0 and "ratio_to_peak_live" in v for v in pol.values())
        case("--compare at a too-small capacity: no policy fits, each says by how much", ok, pol)
        case("--compare: memshim's map/unmap work is reported", pol["memshim"]["map_ops"] > 0, pol["memshim"])
    except (ValueError, IndexError, KeyError) as e:
        case("--compare --json output parses", False, f"{e}: {out!r} {err!r}")
    rc, out, err = run("--compare", "--capacity", "RTX4090", good)
    case("--compare table answers fit per policy", rc == 0 and "memshim fits" in out and "torch fits" in out
         and "torch-expandable fits" in out, out[-400:])
    rc, out, err = run("--compare", "--device", good)
    case("--compare with --device is a usage error", rc == 2, f"rc={rc}")

    # ---- driver calls and modelled driver seconds (issue 10; docs/replay.md) ----
    KINDS = ["create", "release", "map", "unmap", "set_access", "event_record", "stream_wait", "synchronize",
             "malloc", "free", "reserve", "unreserve",
             "host_create", "copy_to_host", "copy_to_device",  # spill to host (issue 20)
             "mem_info"]  # cuMemGetInfo before creates (issue 31)
    rc, out, err = run("--show-driver-costs")
    table = {}
    for line in out.splitlines():
        f = line.split("#")[0].split()
        if f:
            table[f[0]] = f[1:]
    case("--show-driver-costs prints every kind in the --driver-costs format", rc == 0 and sorted(table) == sorted(KINDS),
         out[:300])

    def secs(tok):
        for suf, mul in (("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
            if tok.endswith(suf):
                return float(tok[:-len(suf)]) * mul
        return float(tok)

    def modelled(calls, nbytes, maps, tab):
        return sum(calls[k] * secs(tab[k][0]) + nbytes[k] / 2**20 * (secs(tab[k][1]) if len(tab[k]) > 1 else 0)
                   + maps[k] * (secs(tab[k][2]) if len(tab[k]) > 2 else 0) for k in KINDS)

    # --print-driver-costs: the table as JSON, checked against the H200's measured points it was
    # fitted to (scripts/drvcost_h200.json; docs/benchmarks.md gives the fit and its residuals):
    # every point within 30%, the 2 MiB handles (the pool's page) and the 8-mapping grants within 20%
    rc, out, err = run("--print-driver-costs")
    try:
        pj = json.loads(out)
        by_kind = {v["kind"]: v for v in pj.values()}
        case("--print-driver-costs: every kind, keyed by driver function, three terms each",
             rc == 0 and sorted(by_kind) == sorted(KINDS) and "cuMemCreate" in pj and "cuMemSetAccess" in pj
             and all(sorted(v) == ["kind", "per_call_us", "per_mapping_us", "per_mib_us"] for v in pj.values()), out[:300])
        case("--print-driver-costs is the table --show-driver-costs prints",
             all(abs(by_kind[k]["per_call_us"] * 1e-6 - secs(table[k][0])) <= 1e-6 * secs(table[k][0]) + 1e-15 and
                 abs(by_kind[k]["per_mib_us"] * 1e-6 - secs(table[k][1])) <= 1e-6 * secs(table[k][1]) + 1e-15 and
                 abs(by_kind[k]["per_mapping_us"] * 1e-6 - secs(table[k][2])) <= 1e-6 * secs(table[k][2]) + 1e-15
                 for k in KINDS), (by_kind.get("create"), table.get("create")))
        h200 = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                                           "drvcost_h200.json")))
        bad = []
        for kind, pts in h200["points"].items():
            v = by_kind[kind]
            for maps, mib, us in pts:
                model = v["per_call_us"] + v["per_mib_us"] * mib + v["per_mapping_us"] * maps
                tol = 0.2 if (mib == 2 or maps > 1) else 0.3
                if abs(model - us) > tol * us:
                    bad.append((kind, maps, mib, us, round(model, 2)))
        case("the default table is within 30% of every H200 point (20% at 2 MiB and over 8 mappings)", not bad, bad)
        one, eight = (by_kind["set_access"]["per_call_us"] + by_kind["set_access"]["per_mib_us"] * m * 2
                      + by_kind["set_access"]["per_mapping_us"] * m for m in (1, 8))
        case("an access grant over 8 mappings costs about 8 of one (per mapping, not per call)", 6 < eight / one <= 8,
             (one, eight))
    except (ValueError, KeyError, OSError) as e:
        case("--print-driver-costs parses", False, f"{e}: {out[:300]!r} {err!r}")
    rc2, out2, err2 = run("--print-driver-costs", "--driver-costs", os.path.join(tmp, "none.txt"))
    case("--print-driver-costs with a bad --driver-costs: exit 2", rc2 == 2 and out2 == "", err2)

    rc, out, err = run("--json", "--passes", "3", good)
    try:
        d = json.loads(out.splitlines()[0])
        dc = d["driver_calls"]
        case("--json: driver_calls has every kind", sorted(dc) == sorted(KINDS), sorted(dc))
        # the pool maps runs of pages (one handle for the pages a block covers whole, 20 MiB
        # chunks at the open end of the line with no limit) and grants access once per block
        case("--json: memshim maps whole handles, one access grant per block mapped, in its first pass",
             dc["create"] == dc["map"] == d["map_ops"] > 0 and 0 < dc["set_access"] <= dc["map"]
             and dc["reserve"] >= 1 and dc["malloc"] == 0
             and d["driver_bytes"]["create"] % (2 * 2**20) == 0
             and d["driver_bytes"]["create"] >= 2 * 2**20 * dc["create"], dc)
        dm = d["driver_mappings"]
        case("--json: driver_seconds is the cost table applied to the counts",
             abs(d["driver_seconds"] - modelled(dc, d["driver_bytes"], dm, table)) < 1e-5 and d["driver_seconds"] > 0,
             f"{d['driver_seconds']} vs {modelled(dc, d['driver_bytes'], dm, table)}")
        # one mapping per call, but a grant covers every handle of its span (at least one each)
        case("--json: driver_mappings, one per call but an access grant's span",
             all(dm[k] == dc[k] for k in KINDS if k != "set_access")
             and dc["set_access"] <= dm["set_access"] <= dc["map"], (dc, dm))
        case("--json: unlimited_driver_seconds (no capacity given: the same run)",
             abs(d["unlimited_driver_seconds"] - d["driver_seconds"]) < 1e-9, d.get("unlimited_driver_seconds"))
        case("--json --passes 3: the last pass's driver work (steady state)",
             sorted(d["steady_driver_calls"]) == sorted(KINDS) and d["steady_driver_seconds"] >= 0
             and d["last_pass_map_ops"] == d["steady_driver_calls"]["map"], {k: v for k, v in d.items() if "steady" in k})
        # with no capacity the passes still run (the first pass alone is not the steady state): the
        # third pass reuses the pages the first mapped
        case("--json --passes 3, no capacity: the steady pass creates and maps nothing, the first pass did",
             d["steady_driver_calls"]["create"] == 0 and d["steady_map_ops"] == 0 and dc["create"] > 0,
             (dc["create"], {k: v for k, v in d.items() if "steady" in k}))
    except (ValueError, IndexError, KeyError) as e:
        case("--json driver fields parse", False, f"{e}: {out[:300]!r} {err!r}")
    costs = os.path.join(tmp, "costs.txt")
    open(costs, "w").write("# every create costs a second\ncreate 1s\nmap 0 1ms  # and a millisecond per MiB mapped\n")
    rc2, out2, err2 = run("--json", "--driver-costs", costs, good)
    try:
        d2 = json.loads(out2.splitlines()[0])
        tab2 = dict(table, create=["1s", "0", "0"], map=["0", "1ms", "0"])
        want = modelled(d2["driver_calls"], d2["driver_bytes"], d2["driver_mappings"], tab2)
        case("--driver-costs FILE replaces the kinds it names, keeps the others",
             rc2 == 0 and abs(d2["driver_seconds"] - want) < 1e-5 and d2["driver_seconds"] > d2["driver_calls"]["create"],
             f"{d2['driver_seconds']} vs {want}")
    except (ValueError, IndexError, KeyError) as e:
        case("--driver-costs output parses", False, f"{e}: {out2[:300]!r} {err2!r}")
    open(costs, "w").write("create 1us\nmap 2 parsecs\n")
    rc2, out2, err2 = run("--driver-costs", costs, good)
    case("--driver-costs with a bad line: exit 2 naming file and line",
         rc2 == 2 and f"{costs}:2:" in err2 and out2 == "", f"rc={rc2} {err2!r}")
    rc2, out2, err2 = run("--driver-costs", os.path.join(tmp, "none.txt"), good)
    case("--driver-costs with a missing file: exit 2 naming it", rc2 == 2 and "none.txt" in err2, f"rc={rc2} {err2!r}")
    rc2, out2, err2 = run("--show-driver-costs")
    back = os.path.join(tmp, "back.txt")
    open(back, "w").write(out2)
    rc3, out3, err3 = run("--show-driver-costs", "--driver-costs", back)
    case("--show-driver-costs output reads back through --driver-costs", rc3 == 0 and out3 == out2, err3)
    rc2, out2, err2 = run("--passes", "2", good)
    case("the text output shows the modelled driver time and the last pass",
         rc2 == 0 and "driver time, first pass (modelled):" in out2 and "last pass:" in out2, out2[-500:])
    for pol in ("torch", "torch-expandable"):
        rc2, out2, err2 = run("--policy", pol, "--json", "--passes", "2", good)
        try:
            d2 = json.loads(out2.splitlines()[0])
            dc = d2["driver_calls"]
            if pol == "torch":
                ok = dc["malloc"] == d2["segments_created"] > 0 and dc["create"] == 0 and dc["map"] == 0
            else:
                ok = dc["create"] == dc["map"] > 0 and dc["set_access"] == d2["map_ops"] and dc["malloc"] == 0
            case(f"--policy {pol} --passes 2: driver fields, the calls PyTorch's allocator would make",
                 rc2 == 0 and ok and d2["driver_seconds"] > 0 and "steady_driver_seconds" in d2
                 and "unlimited_driver_seconds" in d2, dc)
            # no capacity, two passes: the second is replayed, and reuses what the first got
            sd = d2["steady_driver_calls"]
            case(f"--policy {pol} --passes 2, no capacity: the steady pass asks the driver for nothing new",
                 sd["malloc"] == sd["create"] == sd["map"] == 0 and (dc["malloc"] if pol == "torch" else dc["create"]) > 0,
                 (dc, sd))
        except (ValueError, IndexError, KeyError) as e:
            case(f"--policy {pol} driver fields parse", False, f"{e}: {out2[:300]!r} {err2!r}")
    # A snapshot written by Python code other than PyTorch's may hold a stream as a bool (an int in
    # Python: False is stream 0); it replays exactly as the same snapshot with ints.
    import pickle
    outs = []
    for st in (0, False):
        seg = {"device": 0, "address": 1 << 30, "total_size": 2 << 20, "stream": st, "segment_type": "small",
               "allocated_size": 0, "active_size": 0, "requested_size": 0,
               "blocks": [{"address": 1 << 30, "size": 2 << 20, "requested_size": 0, "state": "inactive"}]}
        evs = [{"action": a, "addr": 1 << 30, "size": n, "stream": st, "frames": []}
               for a, n in (("segment_alloc", 2 << 20), ("alloc", 512), ("free_requested", 512), ("free_completed", 512))]
        sp = os.path.join(tmp, f"stream-{type(st).__name__}.pickle")
        with open(sp, "wb") as f:
            pickle.dump({"segments": [seg], "device_traces": [evs]}, f, protocol=2)
        rc3, out3, err3 = run("--json", sp)
        outs.append((rc3, {k: v for k, v in json.loads(out3.splitlines()[0]).items()
                           if k not in ("trace",) and "second" not in k} if rc3 == 0 and out3 else err3))
    case("a snapshot whose streams are Python bools replays as the same one with ints",
         outs[0][0] == outs[1][0] == 0 and outs[0][1] == outs[1][1] and outs[0][1]["allocs"] == 1, outs)
    rc2, out2, err2 = run("--compare", "--json", "--passes", "2", good)
    try:
        d2 = json.loads(out2.splitlines()[0])
        pol = d2["policies"]
        need = ["driver_calls", "driver_seconds", "unlimited_driver_calls", "unlimited_driver_seconds",
                "steady_driver_calls", "steady_driver_seconds", "last_pass_map_ops", "steady_ooms"]
        case("--compare --json --passes 2: driver fields for memshim and both models",
             rc2 == 0 and all(all(k in v for k in need) for v in pol.values())
             and all(v["driver_seconds"] > 0 for v in pol.values()), {k: sorted(v) for k, v in pol.items()})
    except (ValueError, IndexError, KeyError) as e:
        case("--compare --passes output parses", False, f"{e}: {out2[:300]!r} {err2!r}")
    rc2, out2, err2 = run("--compare", "--passes", "2", good)
    case("--compare text shows driver time per policy", rc2 == 0 and "driver time, first pass (modelled)" in out2
         and "last of 2 passes" in out2, out2[-600:])
    p = subprocess.run([REPLAY, "--device", "--json", good], capture_output=True, text=True, timeout=300, env=env)
    try:
        dd = json.loads(p.stdout.splitlines()[0])
        tm = dd["driver_timing"]
        case("--device times each call kind the pool made (median, p90)",
             p.returncode == 0 and tm["create"]["calls"] >= dd["driver_calls"]["create"] > 0
             and 0 < tm["map"]["median_s"] <= tm["map"]["p90_s"]
             and tm["set_access"]["calls"] >= dd["driver_calls"]["set_access"] > 0, tm)
        # a trace's timings start from nothing: a kind the pool never called has no entry (the
        # timings also see the teardown's unmap, release, unreserve and synchronize, which the
        # replay's counts leave out)
        teardown = ("unmap", "release", "unreserve", "synchronize")
        unused = sorted(k for k, v in dd["driver_calls"].items() if v == 0 and k not in teardown)
        case("--device times only the kinds the pool called (%s never called: absent)" % ", ".join(unused),
             unused and not [k for k in unused if k in tm], (unused, sorted(tm)))
        cal = dd["driver_calibration"]
        case("--device fits a cost table on one- and ten-page handles",
             cal and cal["sizes"] == [2 * 2**20, 20 * 2**20] and sorted(cal["fitted"]) == sorted(KINDS)
             and all(v["per_call_s"] >= 0 and v["per_mib_s"] >= 0 for v in cal["fitted"].values()), cal)
        # every call the calibration makes takes some time, and far less than a second on the double
        timed = ("reserve", "create", "map", "set_access", "unmap", "release", "unreserve",
                 "synchronize", "event_record", "stream_wait")
        case("--device calibration: each VMM, event and synchronize call was timed (0 < median < 0.1 s)",
             all(0 < m < 0.1 for k in timed for m in cal["median_s"][k]), {k: cal["median_s"][k] for k in timed})
    except (ValueError, IndexError, KeyError, TypeError) as e:
        case("--device timing output parses", False, f"{e}: {p.stdout[:300]!r} {p.stderr[-300:]!r}")

if not os.path.isdir(TRACES):
    skip("real traces", f"{TRACES} not found: skipping the capacity and steady-state checks")
else:
    readme = open(os.path.join(TRACES, "README.md")).read()
    ref = {}
    for m in re.finditer(r"^\| (\S+\.pickle) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", readme, re.M):
        ref[m.group(1)] = {"events": int(m.group(3)), "allocs": int(m.group(4)), "prefix": int(m.group(5)),
                           "peak_live": int(m.group(6)), "torch_reserved": int(m.group(7))}
    picks = sorted(os.path.relpath(os.path.join(dp, f), TRACES)
                   for dp, _, fs in os.walk(TRACES) for f in fs if f.endswith(".pickle"))
    case("the traces README lists reference figures", len(ref) >= 10, len(ref))
    for rel in picks:
        path = os.path.join(TRACES, rel)
        rc, out, err = run("--json", "--capacity", "auto", path)
        if rc != 0:
            case(f"{rel}: replays", False, err.strip())
            continue
        for line in out.splitlines():
            d = json.loads(line)
            ratio = d["min_capacity_bytes"] / d["peak_live_bytes"] if d["peak_live_bytes"] else 1.0
            case(f"{rel}: min capacity {ratio:.4f} x peak live <= 1.03", ratio <= 1.03 and d["ooms"] == 0,
                 f"ratio {ratio:.4f}, ooms {d['ooms']}")
            dc = d["driver_calls"]
            case(f"{rel}: driver calls agree with the pool's own counters",
                 dc["map"] == d["map_ops"] and dc["set_access"] <= dc["map"] and dc["unmap"] == d["unmap_ops"]
                 and d["driver_seconds"] > 0, dc)
            if rel in ref:
                r = ref[rel]
                case(f"{rel}: peak live and counts match the reference",
                     d["peak_live_bytes"] == r["peak_live"] and d["allocs"] == r["allocs"]
                     and d["prefix_blocks"] == r["prefix"] and d["events"] == r["events"],
                     f"{d['peak_live_bytes']}/{r['peak_live']} allocs {d['allocs']}/{r['allocs']} "
                     f"prefix {d['prefix_blocks']}/{r['prefix']} events {d['events']}/{r['events']}")
        rc, out, err = run("--json", "--passes", "2", path)
        for line in out.splitlines():
            d = json.loads(line)
            # with no limit, as the first pass ran (issue 30: a limit at the first pass's peak is not
            # what a limited pass needs: under a limit the front end waits and places as the pool
            # alone does). The front end's bins place some blocks elsewhere than the pool alone,
            # so a second pass may map a few large blocks anew: at most 2 maps and 5% of what the
            # first pass held (measured: up to 240 MiB of 5.7 GiB, ftcourse), nothing unmapped.
            mb = d.get("steady_driver_bytes", {}).get("map", 0)
            case(f"{rel}: second pass with no limit maps at most 2 blocks anew, within 5% of the first pass's "
                 f"reserve, and unmaps nothing",
                 rc == 0 and d["steady_map_ops"] <= 2 and mb <= d["unlimited_peak_reserved_bytes"] // 20
                 and d["steady_unmap_ops"] == 0 and d["steady_ooms"] == 0,
                 f"maps {d.get('steady_map_ops')} ({mb >> 20} MiB of {d['unlimited_peak_reserved_bytes'] >> 20}), "
                 f"unmaps {d.get('steady_unmap_ops')}")

# issue 26: --compare prints the epoch reports' fragmentation figures for every model, a pass a step.
# By hand, no limit: A 4 MiB, B 3 MiB (freed), C 12 MiB, D 30 MiB, all freed; live peak 46 MiB.
#   torch (PyTorch's rules): A asks a 20 MiB segment (under 10 MiB: kLargeBuffer), B and C are split
#     from it, D (over 10 MiB: rounded to 2 MiB) a segment of its own: 50 MiB reserved, first reached
#     by D with 46 live: 46/50 = 0.92, 4 MiB beyond allocated at the peak; the second pass reuses
#     both segments (peaks reset at its start: 50 held): 46/50 again.
#   memshim (no limit: the open end of the line mapped in 20 MiB chunks): A maps pages 0-19 MiB, B
#     and C fit there (C at 4 MiB), D at 16 MiB extends the mapping to the next chunk boundary,
#     60 MiB: 46/60, 14 MiB beyond allocated at the peak.
with tempfile.TemporaryDirectory() as tmp:
    t = os.path.join(tmp, "frag.txt")
    MB = 1 << 20
    open(t, "w").write("# memshim-trace 1\n" + "".join(
        f"{op} 0 0x0 {addr:#x} {mb * MB}\n" for op, addr, mb in (
            ("a", 0x1000000, 4), ("a", 0x2000000, 3), ("f", 0x2000000, 3), ("a", 0x3000000, 12),
            ("a", 0x4000000, 30), ("f", 0x4000000, 30), ("f", 0x3000000, 12), ("f", 0x1000000, 4))))
    rc, out, err = run("--compare", "--json", "--passes", "2", t)
    try:
        pol = json.loads(out)["policies"]
    except (ValueError, KeyError):
        pol = {}
    want = {"torch": (46 / 50, 4 * MB), "memshim": (46 / 60, 14 * MB)}
    for k, (ratio, gap) in want.items():
        v = pol.get(k, {})
        sr = v.get("step_allocated_over_reserved") or {}
        case(f"--compare --json: {k}: peak allocated/reserved {ratio:.4f}, each of the 2 passes the same, "
             f"{gap // MB} MiB reserved beyond allocated at the peak (by hand)",
             abs(v.get("peak_allocated_over_peak_reserved", -1) - ratio) < 1e-5 and sr.get("steps") == 2
             and all(abs(sr.get(q, -1) - ratio) < 1e-5 for q in ("min", "median", "max"))
             and v.get("reserved_minus_allocated_at_peak_bytes") == gap, (rc, v, err[-300:]))
    x = pol.get("torch-expandable", {})
    case("--compare --json: torch-expandable carries the same figures, consistent with its reserved peak",
         x.get("step_allocated_over_reserved", {}).get("steps") == 2 and abs(
             x.get("peak_allocated_over_peak_reserved", -1) - 46 * MB / x.get("unlimited_peak_reserved_bytes", 1)) < 1e-5
         and 0 <= x.get("reserved_minus_allocated_at_peak_bytes", -1) <= x["unlimited_peak_reserved_bytes"] - 46 * MB,
         x)
    rc, out, err = run("--compare", "--passes", "2", t)
    line = [ln for ln in out.splitlines() if "fragmentation with no limit" in ln]
    case("--compare (text): one line of fragmentation figures for the three models",
         rc == 0 and len(line) == 1 and "torch: step allocated/reserved 0.920/0.920/0.920, peak allocated/reserved "
         "0.920, reserved - allocated at the peak 4 MiB" in line[0] and "memshim: step allocated/reserved 0.767" in line[0]
         and "torch-expandable:" in line[0], out[-800:])

finish()
