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
import glob
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
         torch_stats=None, ooms=0, driver_s=0.00024975999999999997, frag=0.1234567891, spill=None, last_oom=None,
         spill_env=None):
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
    if spill:
        r["spill"] = spill
    if last_oom:
        r["last_oom"] = last_oom
    if spill_env:
        r["config"]["MEMSHIM_SPILL"] = {"value": spill_env, "source": "environment"}
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

        # 4b. spill: what it cost and what would stop it; an OOM short by a little suggests it
        sp = {"enabled": True, "spilled_bytes": 2 * GiB, "spilled_peak_bytes": 3 * GiB, "spilled_run_peak_bytes": 3 * GiB,
              "pages_to_host": 1536, "pages_to_device": 512, "bytes_to_host": 3 * GiB, "bytes_to_device": GiB,
              "seconds_moving": 0.41, "requests_refused": 0}
        write_run(D("spill"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, limit="38GiB", spill=sp,
                  spill_env="host")
        adv, p = advice(D("spill"))
        sa = [a for a in adv if a["kind"] == "spill"]
        case("spill rule: spilled pages are named with their peak, what moved, the time, and what would stop it",
             len(sa) == 1 and "up to 3072.0 MiB of cold pages lived on the host at epoch 0" in sa[0]["text"]
             and "3072.0 MiB moved to the host and 1024.0 MiB back, 0.41 s" in sa[0]["text"]
             and "raise it if the device has room" in sa[0]["text"] and "activation checkpointing" in sa[0]["text"],
             adv)
        oo = {"requested_bytes": GiB, "live_bytes": 38 * GiB, "reserved_bytes": 38 * GiB, "device_total_bytes": 80 * GiB,
              "device_free_bytes": 40 * GiB, "limit_bytes": 38 * GiB, "largest_free_extent_bytes": 0, "cause": "capacity"}
        write_run(D("oom-short"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, limit="38GiB", ooms=1, last_oom=oo)
        adv, p = advice(D("oom-short"))
        oa = [a for a in adv if a["kind"] == "oom"]
        case("OOM rule: a capacity OOM short by 2.6% of the limit suggests MEMSHIM_SPILL=host with the shortfall",
             len(oa) == 1 and "short by 1024.0 MiB (2.6% of the limit): MEMSHIM_SPILL=host" in oa[0]["text"], adv)
        write_run(D("oom-short-on"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, limit="38GiB", ooms=1,
                  last_oom=oo, spill_env="host")
        adv, p = advice(D("oom-short-on"))
        oa = [a for a in adv if a["kind"] == "oom"]
        case("OOM rule: with MEMSHIM_SPILL=host already set, no suggestion to set it",
             len(oa) == 1 and "MEMSHIM_SPILL" not in oa[0]["text"], adv)
        far = dict(oo, live_bytes=30 * GiB, requested_bytes=20 * GiB)
        write_run(D("oom-far"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, limit="38GiB", ooms=1, last_oom=far)
        adv, p = advice(D("oom-far"))
        oa = [a for a in adv if a["kind"] == "oom"]
        case("OOM rule: short by 32% of the limit is not a case for spilling (no suggestion)",
             len(oa) == 1 and "MEMSHIM_SPILL" not in oa[0]["text"], adv)
        # issue 25: a request larger than the limit alone, 2.6% over it: spill cannot help (a new block
        # lives in device memory), so the rule names the case and suggests no spilling
        alone = dict(oo, live_bytes=0, requested_bytes=39 * GiB, case="larger_than_limit", cached_bytes=0)
        write_run(D("oom-alone"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, limit="38GiB", ooms=1,
                  last_oom=alone)
        adv, p = advice(D("oom-alone"))
        oa = [a for a in adv if a["kind"] == "oom"]
        case("OOM rule: larger than the limit alone is named as such, with no spill suggestion (issue 25)",
             len(oa) == 1 and "larger than MEMSHIM_LIMIT (38912.0 MiB) alone" in oa[0]["text"]
             and "MEMSHIM_SPILL" not in oa[0]["text"] and "short_bytes" not in oa[0].get("figures", {}), adv)
        # issue 31: a limit refuses it, not memory: never "no allocator could serve it" for a limit,
        # and the limit named by what set it (no MEMSHIM_LIMIT in the config: the memory fraction)
        write_run(D("oom-alone-fraction"), [(30 * GiB, 36 * GiB, 38 * GiB)] * 3, total=80 * GiB, ooms=1,
                  last_oom=alone)
        adv2, p = advice(D("oom-alone-fraction"))
        ob = [a for a in adv2 if a["kind"] == "oom"]
        case("OOM rule: larger than a limit alone says the limit refuses it, naming what set it (issue 31)",
             len(ob) == 1 and "no allocator could serve it" not in oa[0]["text"] + ob[0]["text"]
             and "cannot fit under that limit" in oa[0]["text"] and "raise MEMSHIM_LIMIT" in oa[0]["text"]
             and "larger than the limit set_per_process_memory_fraction set (38912.0 MiB) alone" in ob[0]["text"]
             and "raise the memory fraction" in ob[0]["text"], (adv, adv2))

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
        # the library's own reasons of issue 16: `interval` is known, `interrupted_by` names the signal
        d = write_run(D("sigterm"), [(GiB, 2 * GiB, 2 * GiB)] * 3, total=80 * GiB, reason="interval",
                      last_reason="interrupted")
        for f in glob.glob(os.path.join(d, "*epoch0002.json")):
            r = json.load(open(f))
            r["interrupted_by"] = "SIGTERM"
            json.dump(r, open(f, "w"))
        adv, p = advice(d)
        js = tool(d, "--json")
        notes = json.loads(js.stdout)["runs"][0]["notes"] if js.returncode == 0 else []
        case("reason `interval` is the library's own (not named unknown); `interrupted_by` names the signal",
             not any("interval" in n for n in notes) and "interrupted" in kinds(adv)
             and "(SIGTERM:" in adv[kinds(adv).index("interrupted")]["text"], (notes, adv))
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

        check_charts(tmp, D)
    finish()


# ---- charts ----------------------------------------------------------------------------------------

def load_tool_module():
    """The tool as a module (its renderers): the file MSH_REPORT_TOOL names, else memshim.report."""
    import importlib.machinery
    import importlib.util
    path = os.environ.get("MSH_REPORT_TOOL") or os.path.join(ROOT, "hooks", "python", "memshim", "report.py")
    loader = importlib.machinery.SourceFileLoader("memshim_report_under_test", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def png_rows(data):
    """RGB rows of a PNG written with filter 0 on every row (the built-in writer), CRCs checked."""
    import struct
    import zlib
    pos, idat = 8, b""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    while pos < len(data):
        n, tag = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        assert zlib.crc32(tag + body) & 0xFFFFFFFF == struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0]
        if tag == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 3 * w + 1
    assert all(raw[y * stride] == 0 for y in range(h)), "a row with a filter other than 0"
    return w, h, [raw[y * stride + 1:(y + 1) * stride] for y in range(h)]


def check_charts(tmp, D):
    mod = load_tool_module()
    # the bitmap font of the built-in PNG: lower case is not upper case
    def ink(text):
        r = mod.Raster(len(text) * mod.CHAR_W, mod.CHAR_H)
        r.text(0, 0, text, b"\x00\x00\x00", "start")
        return bytes(r.px)
    case("built-in PNG font: `vm` is drawn in lower case, not as `VM`", ink("vm") != ink("VM"))
    glyphs = {c: ink(c) for c in "abcdefghijklmnopqrstuvwxyz"}
    case("built-in PNG font: every lower-case letter has its own glyph (none drawn as '?' or as its capital)",
         all(g != ink("?") and g != ink(c.upper()) for c, g in glyphs.items()) and len(set(glyphs.values())) == 26,
         [c for c, g in glyphs.items() if g in (ink("?"), ink(c.upper()))])

    # a series equal to another: tensor mode's reserved == allocated at every epoch
    write_run(D("equal"), [(GiB, 2 * GiB, 2 * GiB), (GiB, 3 * GiB, 3 * GiB), (GiB, 2 * GiB, 2 * GiB)],
              total=8 * GiB)
    png = os.path.join(tmp, "equal-builtin.png")
    p = tool(D("equal"), "--plot", png, "--plot-engine", "builtin")
    if p.returncode != 0 and "plot-engine" in p.stderr:  # a tool without the flag draws built-in anyway
        p = tool(D("equal"), "--plot", png)
    try:
        w, h, rows = png_rows(open(png, "rb").read())
        top = 12 + mod.RUN_HEAD + mod.PANEL_PAD_T
        a, r = (bytes.fromhex(c[1:]) for c in mod.PALETTE[:2])
        seen = {a: 0, r: 0}
        for y in range(top, top + mod.PLOT_H):
            row = rows[y]
            for x in range(mod.MARGIN_L, mod.MARGIN_L + mod.PLOT_W):
                px = bytes(row[3 * x:3 * x + 3])
                if px in seen:
                    seen[px] += 1
        case("built-in PNG: allocated equal to reserved at every epoch, both lines visible in the chart",
             seen[a] > 50 and seen[r] > 50, seen)
    except (OSError, AssertionError, ValueError) as e:
        case("built-in PNG: allocated equal to reserved, both visible", False, repr(e))
    svg = os.path.join(tmp, "equal-builtin.svg")
    tool(D("equal"), "--plot", svg, "--plot-engine", "builtin")
    text = open(svg, encoding="utf-8").read() if os.path.exists(svg) else ""
    widths = dict(re.findall(r'stroke="(#[0-9a-f]{6})" stroke-width="(\d+)"[^>]*class="series" data-label="'
                             r'(?:allocated|reserved)"', text))
    case("built-in SVG: the equal series differ in width, the legend says reserved (= allocated)",
         len(set(widths.values())) == 2 and re.search(r">reserved</text>\n<text [^>]*>\(= allocated\)</text>", text),
         widths)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        for what in ("PNG", "SVG", "fallback"):
            skip_ = __import__("pyharness").skip
            skip_(f"--plot with matplotlib ({what})", "matplotlib is not importable (scripts/setup.sh --with-torch)")
    else:
        svg = os.path.join(tmp, "equal-mpl.svg")
        p = tool(D("equal"), "--plot", svg)
        text = open(svg, encoding="utf-8").read() if os.path.exists(svg) else ""
        strokes = [(re.search(r"stroke: (#[0-9a-f]{6})", st).group(1), re.search(r"stroke-width: ([\d.]+)", st).group(1))
                   for st in re.findall(r'style="([^"]*)"', text) if "stroke: #" in st and "stroke-width" in st]
        a_w = {float(w) for c, w in strokes if c == mod.PALETTE[0]}
        r_w = {float(w) for c, w in strokes if c == mod.PALETTE[1]}
        case("--plot OUT.svg with matplotlib: drawn by matplotlib, text as text (host in lower case)",
             p.returncode == 0 and "Matplotlib" in text and "host node1" in text, p.stderr[-300:])
        case("matplotlib: the equal series stay distinguishable (different widths), legend (= allocated)",
             a_w and r_w and max(a_w) != max(r_w) and "reserved (= allocated)" in text, (a_w, r_w))
        png = os.path.join(tmp, "equal-mpl.png")
        p = tool(D("equal"), "--plot", png)
        data = open(png, "rb").read() if os.path.exists(png) else b""
        case("--plot OUT.png with matplotlib: a PNG matplotlib wrote", p.returncode == 0 and data[:8] ==
             b"\x89PNG\r\n\x1a\n" and b"Matplotlib" in data[:400], p.stderr[-300:])
        env_s = subprocess.run([sys.executable, "-S", "-s", TOOL, D("equal"), "--plot", os.path.join(tmp, "s.png")],
                               capture_output=True, text=True, timeout=120)
        data = open(os.path.join(tmp, "s.png"), "rb").read() if os.path.exists(os.path.join(tmp, "s.png")) else b""
        case("without matplotlib importable (python -S): the built-in PNG, exit 0",
             env_s.returncode == 0 and data[:8] == b"\x89PNG\r\n\x1a\n" and b"Matplotlib" not in data[:400],
             env_s.stderr[-300:])

    check_tensorboard(tmp, D)


def check_tensorboard(tmp, D):
    from pyharness import skip
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        skip("--tensorboard LOGDIR", "tensorboard is not importable (scripts/setup.sh --with-torch installs it)")
        return
    logdir = os.path.join(tmp, "tb")
    for rk in (0, 1):
        write_run(D("tbjob"), [(GiB * (1 + e), 2 * GiB + e * MiB, 3 * GiB) for e in range(4)], total=8 * GiB,
                  rank=rk)
    p = tool(D("tbjob"), "--tensorboard", logdir)
    runs = sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []
    case("--tensorboard LOGDIR: one TensorBoard run per rank", p.returncode == 0 and runs == ["run1-r0", "run1-r1"],
         (runs, p.stderr[-300:]))
    if not runs:
        return
    acc = EventAccumulator(os.path.join(logdir, runs[0]))
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    pk = [(e.step, e.value) for e in acc.Scalars("memshim/allocated_peak_mib")] if tags else []
    end = [(e.step, e.value) for e in acc.Scalars("memshim/allocated_end_mib")] if tags else []
    case("--tensorboard: memshim/ scalars per epoch with the reports' figures (step = epoch, MiB)",
         {"memshim/allocated_peak_mib", "memshim/reserved_peak_mib", "memshim/fragmentation",
          "memshim/oom_events"} <= set(tags) and pk == [(e, 2048.0 + e) for e in range(4)]
         and end == [(e, 1024.0 * (1 + e)) for e in range(4)], (tags, pk, end))
    ev = sorted(os.listdir(os.path.join(logdir, runs[0])))[0]
    q = tool(D("tbjob"), "--tensorboard", os.path.join(logdir, runs[0], ev, "no"))
    case("--tensorboard into a path that cannot be a directory: exit 1, said, the table still printed",
         q.returncode == 1 and "cannot write" in q.stderr and "== run 1" in q.stdout, q.stderr[-300:])


if __name__ == "__main__":
    main()
