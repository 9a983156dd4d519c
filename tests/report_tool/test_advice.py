#!/usr/bin/env python3
"""memshim-report's advice rules (docs/reports.md, "Advice"), each on reports constructed here from
nothing (no library run): a leak is advised as a leak with its site, never as a peak to lower;
fragmentation as fragmentation with what helps; capacity as capacity (the dominant site, or a
smaller batch); nothing for peaks that are a tiny share of the device; unfinished, interrupted
and unreported runs are named; an epoch reason the tool does not know is read, not fatal;
numbers are rounded for people (CSV, text); no empty heading. Also --plot and --html stay
correct on these reports. MSH_REPORT_TOOL runs another copy of the tool (how the rules were
checked against the old one). Ends with "N passed, N failed, N skipped"."""
import copy
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import ROOT, case, finish  # noqa: E402

TOOL = os.environ.get("MSH_REPORT_TOOL") or os.path.join(ROOT, "scripts", "memshim-report")
MiB, GiB = 1024 * 1024, 1024 * 1024 * 1024
PID = [4000]


def base(kind, epoch, alloc_end, alloc_peak, resv_peak, total, *, pid, rank=-1, reason="dataloader", mode="tensor",
         t=0.0, limit="0", defrag="1", sites=None, growing=None, series=None, verdict=None, touched=None,
         torch_stats=None, ooms=0, driver_s=0.00024975999999999997, frag=0.1234567891):
    r = {"schema_version": 2, "kind": kind, "host": "node1", "pid": pid, "rank": rank, "device": 0, "epoch": epoch,
         "run_id": None, "reason": reason, "mode": mode, "steps": 10, "t_start_s": t, "t_end_s": t + 1.0,
         "wall_time_unix": 1800000000 + int(t) + 1, "memshim_version": "0.1.0",
         "memory": {"allocated_bytes": alloc_end, "allocated_peak_bytes": alloc_peak, "reserved_bytes": resv_peak,
                    "reserved_peak_bytes": resv_peak, "allocated_run_peak_bytes": alloc_peak,
                    "reserved_run_peak_bytes": resv_peak, "touched_peak_bytes": touched,
                    "device_total_bytes": total},
         "fragmentation": {"free_extent_fragmentation": frag},
         "operations": {"map_ops": 3, "unmap_ops": 0, "reclaimed_pages": 0},
         "oom": {"oom_events": ooms, "rescued_by_reclaim": 0, "rescued_by_gc": 0, "rescued_by_empty_cache": 0},
         "driver": {"modelled_seconds": driver_s},
         "config": {"MEMSHIM_LIMIT": {"value": limit, "source": "default" if limit == "0" else "environment"},
                    "MEMSHIM_DEFRAG": {"value": defrag, "source": "default"}},
         "sites": sites, "sites_note": None,
         "trend": {"verdict": verdict or "flat", "epoch_end_allocated_bytes": series or [],
                   "growing_sites": growing if growing is not None else []}}
    if torch_stats:
        r["torch_memory_stats"] = torch_stats
    return r


def write_run(d, epochs, *, summary=True, rank=-1, last_reason=None, **kw):
    """`epochs`: [(alloc_end, alloc_peak, resv_peak)]; the trend as the library computes it."""
    os.makedirs(d, exist_ok=True)
    PID[0] += 1
    pid = PID[0]
    series = []
    recs = []
    for i, (ae, ap, rp) in enumerate(epochs):
        series.append(ae)
        v = ("too few epochs" if len(series) < 3 else
             "possible leak: allocated memory grew at every epoch"
             if all(b > a + MiB for a, b in zip(series, series[1:])) else "flat")
        reason = last_reason if (last_reason and i == len(epochs) - 1) else kw.get("reason", "dataloader")
        k = dict(kw, reason=reason)
        recs.append(base("epoch", i, ae, ap, rp, pid=pid, rank=rank, t=10.0 * i, series=list(series), verdict=v, **k))
    if summary:
        last = copy.deepcopy(recs[-1])
        last.update(kind="summary", epoch=len(epochs), reason="exit", t_end_s=last["t_end_s"] + 1)
        last["memory"]["allocated_run_peak_bytes"] = max(e[1] for e in epochs)
        last["memory"]["reserved_run_peak_bytes"] = max(e[2] for e in epochs)
        recs.append(last)
    rk = f"-rank{rank}" if rank >= 0 else ""
    for r in recs:
        what = f"epoch{r['epoch']:04d}" if r["kind"] == "epoch" else "summary"
        with open(os.path.join(d, f"memshim-node1-pid{pid}{rk}-dev0-{what}.json"), "w") as f:
            json.dump(r, f)
    return d


def tool(*args):
    p = subprocess.run([sys.executable, TOOL] + [str(a) for a in args], capture_output=True, text=True, timeout=120)
    return p


def advice(d):
    p = tool(d, "--json")
    try:
        return json.loads(p.stdout)["runs"][0]["advice"], p
    except (ValueError, KeyError, IndexError):
        return [], p


def kinds(adv):
    return [a["kind"] for a in adv]


def significant(cell):
    """Significant digits of a number with a fraction ('0.00024976' -> 5); 0 for anything else."""
    m = re.fullmatch(r"-?(\d*)\.(\d+)(?:e[-+]?\d+)?", cell)
    return len((m.group(1) + m.group(2)).lstrip("0")) if m else 0


def site(file, line, fn, b, count=1):
    return {"file": file, "line": line, "function": fn, "bytes": b, "count": count}


def main():
    with tempfile.TemporaryDirectory(prefix="memshim-advice-") as tmp:
        D = lambda n: os.path.join(tmp, n)  # noqa: E731

        # 1. leak: growth at every boundary, the growing site also the largest at a peak near capacity
        lk = site("train.py", 57, "log_losses", int(60 * GiB))
        grow = [{"file": "train.py", "line": 57, "function": "log_losses", "growth_bytes_per_epoch": 4 * GiB}]
        write_run(D("leak"), [(50 * GiB, 60 * GiB, 62 * GiB), (54 * GiB, 64 * GiB, 66 * GiB),
                              (58 * GiB, 68 * GiB, 70 * GiB), (62 * GiB, 72 * GiB, 74 * GiB)],
                  total=80 * GiB, sites=[lk, site("model.py", 9, "forward", 10 * GiB)], growing=grow)
        adv, p = advice(D("leak"))
        leak = [a for a in adv if a["kind"] == "leak"]
        case("leak rule: growth at every epoch boundary is advised as a leak, with the growing site",
             len(leak) == 1 and "a leak at these sites: train.py:57 (log_losses) +4096.0 MiB/epoch" in leak[0]["text"],
             adv)
        wrong = [a for a in adv if "train.py:57" in a["text"] and ("checkpoint" in a["text"] or "smaller batch" in
                                                                    a["text"])]
        case("leak rule: the leaking site is never advised activation checkpointing or a smaller batch", not wrong,
             wrong)

        # 2. tiny: a 1 MiB peak on an 80 GiB device, one site holding all of it; and 300 MiB reserved for
        # 100 MiB live there (3x, 200 MiB excess): nothing to change
        write_run(D("tiny"), [(MiB, MiB, 2 * MiB)] * 3, total=80 * GiB, sites=[site("train.py", 3, "<module>", MiB)])
        adv, p = advice(D("tiny"))
        case("tiny rule: a 1 MiB peak on an 80 GiB device gets no capacity or site advice: nothing to change",
             kinds(adv) == ["none"] and "checkpoint" not in adv[0]["text"]
             and "(0.0024% of the 81920.0 MiB device)" in adv[0]["text"], adv)
        write_run(D("tiny-frag"), [(100 * MiB, 100 * MiB, 300 * MiB)] * 3, total=80 * GiB)
        adv, p = advice(D("tiny-frag"))
        case("tiny rule: 200 MiB held above the live peak, 0.37% of an 80 GiB device: no fragmentation advice",
             kinds(adv) == ["none"] and "(0.37% of the 81920.0 MiB device)" in adv[0]["text"], adv)

        # 3. fragmentation: memshim's pool (tensor mode) and PyTorch's segments (segment mode)
        write_run(D("frag"), [(10 * GiB, 10 * GiB, 13 * GiB)] * 3, total=40 * GiB, touched=11 * GiB)
        adv, p = advice(D("frag"))
        fr = [a for a in adv if a["kind"] == "pool-frag"]
        case("fragmentation rule (pool): held 1.30x the live peak at 33% of the device is fragmentation, with "
             "the split and what helps", len(fr) == 1 and fr[0]["text"].startswith("fragmentation: memshim held")
             and "1024.0 MiB in pages shared with live blocks, 2048.0 MiB in cached pages" in fr[0]["text"]
             and "MEMSHIM_EMPTY_CACHE=epoch" in fr[0]["text"] and kinds(adv) == ["pool-frag"], adv)
        write_run(D("frag-off"), [(10 * GiB, 10 * GiB, 13 * GiB)] * 3, total=40 * GiB, defrag="0")
        adv, p = advice(D("frag-off"))
        case("fragmentation rule (pool, MEMSHIM_DEFRAG=0): names the setting",
             any(a["kind"] == "pool-frag" and "MEMSHIM_DEFRAG=1 (now 0)" in a["text"] for a in adv), adv)
        ts = {"allocated_bytes.all.peak": 10 * GiB, "reserved_bytes.all.peak": 14 * GiB, "num_alloc_retries": 0,
              "num_ooms": 0}
        write_run(D("frag-seg"), [(10 * GiB, 10 * GiB, 14 * GiB)] * 3, total=40 * GiB, mode="segment", torch_stats=ts)
        adv, p = advice(D("frag-seg"))
        tf = [a for a in adv if a["kind"] == "torch-frag"]
        case("fragmentation rule (segment mode): PyTorch's segments, with tensor mode and expandable segments",
             len(tf) == 1 and "tensor mode" in tf[0]["text"] and "expandable_segments:True" in tf[0]["text"], adv)

        # 4. capacity: near the device, near MEMSHIM_LIMIT; with and without a dominant site
        write_run(D("cap"), [(60 * GiB, 66 * GiB, 70 * GiB)] * 3, total=80 * GiB,
                  sites=[site("model.py", 42, "attention", int(40 * GiB)), site("model.py", 7, "mlp", 20 * GiB)])
        adv, p = advice(D("cap"))
        cp = [a for a in adv if a["kind"] == "capacity"]
        case("capacity rule: peak reserved at 88% of the device is capacity; the dominant site with checkpointing",
             len(cp) == 1 and "near capacity: peak reserved 71680.0 MiB at epoch 0 is 88% of the 81920.0 MiB device"
             in cp[0]["text"] and "model.py:42 (attention)" in cp[0]["text"] and "torch.utils.checkpoint" in cp[0]["text"]
             and kinds(adv) == ["capacity"], adv)
        write_run(D("cap-limit"), [(30 * GiB, 34 * GiB, 37 * GiB)] * 3, total=80 * GiB, limit="40GiB")
        adv, p = advice(D("cap-limit"))
        cp = [a for a in adv if a["kind"] == "capacity"]
        case("capacity rule: against MEMSHIM_LIMIT when one is set (92% of the 40 GiB limit, 46% of the device)",
             len(cp) == 1 and "is 92% of the 40960.0 MiB limit (MEMSHIM_LIMIT)" in cp[0]["text"]
             and "smaller batch" in cp[0]["text"], adv)
        write_run(D("mid"), [(20 * GiB, 30 * GiB, 31 * GiB)] * 3, total=80 * GiB,
                  sites=[site("model.py", 42, "attention", 25 * GiB)])
        adv, p = advice(D("mid"))
        case("capacity rule: a dominant site at 39% of the device is not a capacity problem: nothing to change",
             kinds(adv) == ["none"], adv)

        # 5. unfinished and interrupted runs, unknown reasons
        write_run(D("nosummary"), [(GiB, 2 * GiB, 2 * GiB)] * 3, total=80 * GiB, summary=False)
        adv, p = advice(D("nosummary"))
        case("unfinished rule: a process without a summary report is named (last epoch 2)",
             kinds(adv)[:1] == ["unfinished"] and "no summary report" in adv[0]["text"]
             and "last epoch 2" in adv[0]["text"] and "nothing to change" in adv[-1]["text"], adv)
        write_run(D("interrupted"), [(GiB, 2 * GiB, 2 * GiB)] * 3, total=80 * GiB, last_reason="interrupted")
        adv, p = advice(D("interrupted"))
        case("interrupted rule: an epoch closed as `interrupted` names the run as stopped, the last epoch partial",
             "interrupted" in kinds(adv) and "unfinished" not in kinds(adv)
             and "epoch 2 was closed early" in adv[kinds(adv).index("interrupted")]["text"], adv)
        write_run(D("unknown"), [(GiB, 2 * GiB, 2 * GiB)] * 3, total=80 * GiB, last_reason="interval_steps")
        p = tool(D("unknown"))
        js = tool(D("unknown"), "--json")
        notes = json.loads(js.stdout)["runs"][0]["notes"] if js.returncode == 0 else []
        case("an unknown epoch reason is read (shown as written) and named once in the notes",
             p.returncode == 0 and " interval_steps " in p.stdout and any("interval_steps" in n for n in notes),
             (p.stdout[-800:], notes))
        for rk in (0, 1, 3):
            write_run(D("ranks"), [(GiB, 2 * GiB, 2 * GiB)] * 3, total=80 * GiB, rank=rk)
        adv, p = advice(D("ranks"))
        un = [a for a in adv if a["kind"] == "unreported"]
        case("unreported rule: ranks of the run without reports are named in the advice",
             len(un) == 1 and "no reports from rank 2 " in un[0]["text"], adv)

        # 6. numbers for people, headings with content
        c = tool(D("frag"), "--csv")
        cells = [v for row in csv.reader(io.StringIO(c.stdout)) for v in row]
        long = [v for v in cells if significant(v) > 6]
        case("numbers for people: no CSV cell carries more than 6 significant digits (0.00024976, not "
             "0.00024975999999999997)", c.returncode == 0 and not long and "0.00024976" in cells, long[:4])
        for name in ("leak", "tiny", "frag", "cap", "nosummary", "ranks"):
            p = tool(D(name))
            lines = p.stdout.splitlines()
            empty = [i for i, ln in enumerate(lines) if ln == "advice:" and
                     (i + 1 >= len(lines) or not lines[i + 1].startswith("  - "))]
            longf = re.findall(r"\d+\.\d{7,}", p.stdout)
            case(f"text ({name}): every heading has content, no number with more than 6 decimals",
                 p.returncode == 0 and not empty and not longf, (empty, longf[:3]))
        out = os.path.join(tmp, "page.html")
        p = tool(D("tiny"), "--html", out)
        page = open(out, encoding="utf-8").read() if os.path.exists(out) else ""
        case("HTML: no 'Memory grows: nowhere at every epoch'; it says on no device",
             p.returncode == 0 and "nowhere" not in page and "Memory grows: on no device" in page, page[-300:])
    finish()


if __name__ == "__main__":
    main()
