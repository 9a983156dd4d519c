#!/usr/bin/env python3
"""scripts/memshim-report end to end. Runs the real tool on reports that the demo workload wrote
under LD_PRELOAD=libmemshim.so over the CUDA driver double: one process (steady and leaking), an
8-rank job (the workload started eight times with RANK set, rank 3 leaking, rank 5 larger), a
second run of the same ranks and an unranked process in the same directory. Every figure the
tool prints is compared with the report files; its --json and --csv with the files too; the PNG is
decoded (chunks, CRCs, inflate, size, colours), the SVG parsed (series values and their
positions), the HTML parsed (tables, charts, no external URL). Schema-2 fields the library does not
write yet (sites, growing sites, versions, latency, PyTorch's memory_stats) are tested on
SYNTHETIC copies of real reports, written by this test into their own directories and marked with
a "_synthetic" field. Ends with "N passed, N failed, N skipped"."""
import contextlib
import copy
import csv
import glob
import html
import html.parser
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, skip  # noqa: E402

TOOL = os.path.join(ROOT, "scripts", "memshim-report")   # the launcher users run
MODULE = os.path.join(ROOT, "hooks", "python", "memshim", "report.py")  # the tool itself (memshim.report)
MiB = 1024 * 1024
SYNTHETIC = "written by tests/report_tool/test_report_tool.py: schema-2 fields the library does not yet produce"
RANK_VARS = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")  # the reports' run_id


def demo_env(report_dir, rank=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMSHIM_") and k not in RANK_VARS and k not in JOB_VARS}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": os.path.join(BUILD, "libmemshim.so"),
                "CUDBL_CAPACITY": "8G", "MEMSHIM_REPORT_DIR": report_dir})
    if rank is not None:
        env["RANK"] = str(rank)
    return env


def demo_start(report_dir, *args, rank=None, env=None):
    return subprocess.Popen([os.path.join(BUILD, "memshim-train-demo"), *args],
                            env=dict(demo_env(report_dir, rank), **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def demo(report_dir, *args, rank=None, env=None):
    p = demo_start(report_dir, *args, rank=rank, env=env)
    out, err = p.communicate(timeout=300)
    ok = p.returncode == 0 and ("finished, 0 failed" in out or (env and "finished" in out))
    return p.pid, ok, err


def tool(*args):
    return subprocess.run([TOOL] + [str(a) for a in args], capture_output=True, text=True, timeout=300)


def raw_reports(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "**", "memshim-*.json"), recursive=True)):
        try:
            out[f] = json.load(open(f))
        except ValueError:
            pass
    return out


def key_of(r):
    return (r["host"], r["pid"], r["rank"] if r["rank"] >= 0 else None, r["device"])


def mib(b):
    return f"{b / MiB:.1f}"


def f3(v):
    return f"{v:.3f}"


# ---- reading the tool's text --------------------------------------------------------------------

def sections(text):
    """{run index: [lines]} split at '== run N of M'."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"== run (\d+) of \d+", line)
        if m:
            cur = int(m.group(1))
            out[cur] = []
        if cur is not None:
            out[cur].append(line)
    return out


def parse_table(lines, first_header, last_free=False):
    """Rows of the first table whose header starts with `first_header`, as dicts."""
    for i, line in enumerate(lines):
        cols = line.split()
        if cols and cols[0] == first_header and i + 1 < len(lines) and set(lines[i + 1]) == {"-"}:
            rows = []
            for row in lines[i + 2:]:
                if not row.strip() or set(row.strip()) == {"-"}:
                    break
                cells = row.split(None, len(cols) - 1) if last_free else row.split()
                if len(cells) != len(cols):
                    break
                rows.append(dict(zip(cols, cells)))
            return rows
    return None


def detail_expect(r):
    """What a detail row must say, from the report file alone (docs/reports.md)."""
    m = r["memory"]
    summ = r["kind"] == "summary"
    ap = m["allocated_run_peak_bytes"] if summ else m["allocated_peak_bytes"]
    rp = m["reserved_run_peak_bytes"] if summ else m["reserved_peak_bytes"]
    lat = (r.get("latency") or {}).get("alloc_ns") or {}
    t = r.get("torch_memory_stats") or {}
    us = lambda v: "n/a" if v is None else f"{v / 1000:.1f}"  # noqa: E731
    return {"alloc_end": mib(m["allocated_bytes"]), "alloc_peak": mib(ap), "resv_peak": mib(rp),
            "resv/alloc": f3(rp / ap) if ap else "n/a", "frag": f3(r["fragmentation"]["free_extent_fragmentation"]),
            # issue 26: min/median/max of each step's peak allocated over its peak reserved, and the
            # reserve beyond allocated at the peak (n/a in reports from before them)
            "step_a/r": "/".join(f3(sr[q]) for q in ("min", "median", "max"))
            if (sr := r["fragmentation"].get("step_allocated_over_reserved")) else "n/a",
            "gap@pk": mib(r["fragmentation"]["reserved_minus_allocated_at_peak_bytes"])
            if "reserved_minus_allocated_at_peak_bytes" in r["fragmentation"] else "n/a",
            "maps": str(r["operations"]["map_ops"]), "unmaps": str(r["operations"]["unmap_ops"]),
            "reclaim": str(r["operations"]["reclaimed_pages"]), "ooms": str(r["oom"]["oom_events"]),
            "steps": str(r["steps"]), "reason": r["reason"],
            "a.p50us": us(lat.get("p50")), "a.p99us": us(lat.get("p99")),
            "pt_alloc": mib(t["allocated_bytes.all.peak"]) if "allocated_bytes.all.peak" in t else "n/a",
            "pt_resv": mib(t["reserved_bytes.all.peak"]) if "reserved_bytes.all.peak" in t else "n/a"}


def check_detail_rows(name, lines, raw):
    rows = parse_table(lines, "host")
    if not case(f"{name}: the epoch table is printed", rows, "\n".join(lines[:30])):
        return
    shown = lambda r: f"oom#{r['oom_index']}" if "oom_index" in r else r["kind"]  # noqa: E731
    by = {(r["host"], str(r["pid"]), str(r["device"]), shown(r), str(r["epoch"])): r for r in raw.values()}
    bad, seen = [], set()
    for row in rows:
        k = (row["host"], row["pid"], row["dev"], row["kind"], row["epoch"])
        seen.add(k)
        r = by.get(k)
        if r is None:
            bad.append(("no report file for row", row))
            continue
        for col, want in detail_expect(r).items():
            if row[col] != want:
                bad.append((k, col, row[col], want))
    case(f"{name}: every figure of every epoch row equals its report file ({len(rows)} rows)",
         not bad and seen == set(by), bad[:5] or sorted(set(by) - seen)[:5])


def numbers(text):
    return re.findall(r"(?<![\w.])[+-]?\d+(?:\.\d+)?", text)


def figure_strings(fig):
    out = set()

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            out.update(numbers(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, int):
                out.add(str(v))
            out.update({f"{v:.2f}", f"{100 * v:.0f}", f"{100 * v:.1f}", f"{100 * v:.2g}", f"{v / MiB:.1f}", f"{v / MiB:+.1f}"})
    walk(fig)
    return out


def check_advice_backed(name, advice):
    """Every number in an advice text is one of its figures, formatted as the tool prints them."""
    bad = []
    for a in advice:
        t = a["text"]
        for tok in ("MEMSHIM_DEFRAG=1", "expandable_segments:True", "torch.utils.checkpoint"):
            t = t.replace(tok, "")
        for s in (a["figures"].get("growing_sites") or []) + ([a["figures"]["site"]] if "site" in a["figures"] else []):
            t = t.replace(f"{s['file']}:{s['line']} ({s['function']})", "")
        extra = [n for n in numbers(t) if n not in figure_strings(a["figures"])]
        if extra:
            bad.append((a["kind"], extra, a["text"]))
    case(f"{name}: every number in the advice is one of its figures ({len(advice)} items)", not bad, bad[:3])


# ---- images and HTML ----------------------------------------------------------------------------

def decode_png(data):
    """Width, height and RGB rows of a PNG (8-bit RGB or RGBA, any filter), checking every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "no PNG signature"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        n, tag = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        crc = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0]
        assert zlib.crc32(tag + body) & 0xFFFFFFFF == crc, f"bad CRC in {tag}"
        if tag == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat += body
        elif tag == b"IEND":
            break
        pos += 12 + n
    w, h, depth, ctype = ihdr[:4]
    assert depth == 8 and ctype in (2, 6), f"unexpected PNG format depth {depth} type {ctype}"
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    assert len(raw) == h * (stride + 1), f"inflated {len(raw)} bytes, expected {h * (stride + 1)}"
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride if f else 0):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    colours = set()
    for line in rows:
        colours.update(line[i:i + 3] for i in range(0, stride, bpp))
    return w, h, colours


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.text, self.tables, self.stack, self.rows = [], [], [], [], [], {}

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        if tag == "table":
            cls = dict(attrs).get("class", "")
            self.tables.append(cls)
            self.stack.append(cls)
        if tag == "tr" and self.stack:
            self.rows[self.stack[-1]] = self.rows.get(self.stack[-1], 0) + 1

    def handle_endtag(self, tag):
        if tag == "table" and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_html(name, path, report, expect_tables):
    page_src = open(path, encoding="utf-8").read()
    p = Page()
    p.feed(page_src)
    text = " ".join(" ".join(p.text).split())
    case(f"{name}: HTML has the tables {sorted(expect_tables)}", set(expect_tables) <= set(p.tables), p.tables)
    nruns = len(report["runs"])
    case(f"{name}: HTML has one inline chart per run ({nruns}) with its lines",
         p.tags.count("svg") == nruns and p.tags.count("polyline") >= 3 * nruns, (p.tags.count("svg"), nruns))
    ext = [(t, k, v) for t, k, v in p.attrs if k in ("src", "href", "xlink:href", "action", "data") or "url(" in v]
    case(f"{name}: HTML is self-contained (no src/href, no '://', no script)",
         not ext and "://" not in page_src and "script" not in p.tags and "link" not in p.tags, ext[:3])
    missing = [a["text"] for r in report["runs"] for a in r["advice"] if " ".join(a["text"].split()) not in text]
    case(f"{name}: HTML shows every advice item", not missing, missing[:2])
    nrows = sum(len(s["rows"]) for r in report["runs"] for k in r["ranks"] for s in k["streams"])
    case(f"{name}: HTML epoch tables hold one row per report ({nrows})", p.rows.get("epochs", 0) == nrows + nruns,
         p.rows.get("epochs"))
    return p, text


def check_svg(name, path, report):
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    ok = root.tag == ns + "svg" and int(root.get("width")) > 0 and int(root.get("height")) > 0
    case(f"{name}: SVG parses as XML with a size", ok, root.attrib)
    series, bad = 0, []
    for g in root.iter(ns + "g"):
        lo, hi, top, hgt = (float(g.get("data-" + k)) for k in ("lo", "hi", "top", "height"))
        for pl in g.iter(ns + "polyline"):
            if pl.get("class") != "series":
                continue
            series += 1
            vals = [float(v) for v in pl.get("data-values").split(",")]
            ys = [float(p.split(",")[1]) for p in pl.get("points").split()]
            want = [top + hgt - (v - lo) / (hi - lo) * hgt for v in vals]
            if len(ys) != len(vals) or any(abs(a - b) > 0.01 for a, b in zip(ys, want)):
                bad.append((pl.get("data-label"), ys, want))
    case(f"{name}: SVG draws each series where its values belong ({series} series)", series and not bad, bad[:2])
    return root


def svg_series(root, title_prefix):
    ns = "{http://www.w3.org/2000/svg}"
    out = []
    for g in root.iter(ns + "g"):
        if g.get("data-title", "").startswith(title_prefix):
            out.append({pl.get("data-label"): (list(map(int, pl.get("data-epochs").split(","))),
                                               list(map(float, pl.get("data-values").split(","))))
                        for pl in g.iter(ns + "polyline") if pl.get("class") == "series"})
    return out


# ---- synthetic schema-2 reports -----------------------------------------------------------------

def p99us(raw, key_of, k):
    """The per-rank a.p99us column from the files: the highest epoch p99, in us (n/a in schema 1)."""
    v = [r["latency"]["alloc_ns"]["p99"] for r in raw.values() if r["kind"] == "epoch" and "latency" in r
         and key_of(r) == (k["host"], k["pid"], k["rank"], 0) and r["latency"]["alloc_ns"]["p99"] is not None]
    return f"{max(v) / 1000:.1f}" if v else "n/a"


SCHEMA2_ONLY = ("versions", "latency", "sites", "sites_note", "driver", "torch_memory_stats")


def synthesize(src_dir, dst_dir, variant, grow=None, near=None):
    """SYNTHETIC copies of real reports, marked with '_synthetic'. Variants: tensor (sites, one
    dominating; growing sites; versions, latency, driver time, new epoch reasons), even (four
    equal sites), segment (PyTorch's memory_stats() with reserved 1.4x allocated, no sites),
    sparse (schema 2 with the optional fields absent or null), and two schema-1 ones: held
    (reserved 1.3x allocated with MEMSHIM_DEFRAG=0), twodev (a second device in the process).
    near: the device's size set so that each process's peak reserved is that share of it."""
    os.makedirs(dst_dir, exist_ok=True)
    peak = {}
    for r in raw_reports(src_dir).values():
        k = (r["host"], r["pid"], r["device"])
        peak[k] = max(peak.get(k, 0), r["memory"]["reserved_peak_bytes"], r["memory"].get("reserved_run_peak_bytes", 0))
    for path, r in raw_reports(src_dir).items():
        s = copy.deepcopy(r)
        if near:
            s["memory"]["device_total_bytes"] = int(peak[(r["host"], r["pid"], r["device"])] / near)
        s["_synthetic"] = SYNTHETIC
        # the variants are built from the demo's reports as schema 1 (the library now writes 2)
        for k in SCHEMA2_ONLY:
            s.pop(k, None)
        s["trend"].pop("growing_sites", None)
        s["schema_version"] = 1
        m = s["memory"]
        if variant == "held":  # schema 1, memshim holding 30% above the live peak with defrag off
            for k in ("reserved_peak_bytes", "reserved_run_peak_bytes"):
                m[k] = int(m[k.replace("reserved", "allocated")] * 1.3) // (2 * MiB) * (2 * MiB)
            m["touched_peak_bytes"] = m["allocated_peak_bytes"] + 10 * MiB
            s["config"]["MEMSHIM_DEFRAG"] = {"value": "0", "source": "environment"}
        if variant == "twodev":  # schema 1, the same process on a second device with half the memory
            json.dump(s, open(os.path.join(dst_dir, os.path.basename(path)), "w"))
            s["device"] = 1
            for k, v in m.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    m[k] = v // 2
            s["trend"]["epoch_end_allocated_bytes"] = [v // 2 for v in s["trend"]["epoch_end_allocated_bytes"]]
            path = path.replace("-dev0-", "-dev1-")
        if variant in ("held", "twodev"):
            json.dump(s, open(os.path.join(dst_dir, os.path.basename(path)), "w"))
            continue
        s["schema_version"] = 2
        ap, e = s["memory"]["allocated_peak_bytes"], s["epoch"]
        if variant in ("tensor", "segment", "even"):
            s["versions"] = {"cuda_driver": 13000, "cuda_runtime": 13000, "device_name": "Synthetic GPU",
                             "memshim": "0.2.0-synthetic", "torch": "2.11.0"}
            s["latency"] = {"alloc_ns": {"p50": 1200 + 10 * e, "p90": 2500, "p99": 9000 + 100 * e, "max": 50000},
                            "free_ns": {"p50": 300, "p90": 400, "p99": 900, "max": 4000}}
            s["driver"] = {"calls": {"map": 3}, "modelled_seconds": 0.25}
            if s["kind"] == "epoch" and e in (1, 2):
                s["reason"] = {1: "hf_trainer", 2: "dataloader"}[e]
        if variant == "tensor":
            s["sites"] = [{"file": "train.py", "line": 42, "function": "forward", "bytes": int(0.6 * ap), "count": 12},
                          {"file": "model.py", "line": 7, "function": "attention", "bytes": int(0.25 * ap),
                           "count": 96},
                          {"file": "optim.py", "line": 88, "function": "step", "bytes": int(0.1 * ap), "count": 3}]
            s["trend"]["growing_sites"] = ([{"file": "train.py", "line": 57, "function": "log_losses",
                                             "growth_bytes_per_epoch": grow}] if grow else [])
        elif variant == "even":
            s["sites"] = [{"file": "model.py", "line": 10 + i, "function": f"layer{i}", "bytes": int(0.2 * ap),
                           "count": 1} for i in range(4)]
        elif variant == "segment":
            s["mode"] = "segment"
            s["sites"], s["sites_note"] = [], "segment mode: sites need tensor mode"
            s["torch_memory_stats"] = {"allocated_bytes.all.peak": ap, "reserved_bytes.all.peak": int(1.4 * ap),
                                       "num_alloc_retries": 2, "num_ooms": 0}
        elif variant == "sparse":
            s.pop("memshim_version")
            s["versions"] = {"cuda_driver": None, "cuda_runtime": None, "device_name": None, "memshim": None,
                             "torch": None}
        with open(os.path.join(dst_dir, os.path.basename(path)), "w") as f:
            json.dump(s, f)


# ---- the checks ---------------------------------------------------------------------------------

def check_rename():
    case("scripts/memshim-report is executable with a python3 shebang",
         os.access(TOOL, os.X_OK) and open(TOOL).readline().strip() == "#!/usr/bin/env python3")
    case("scripts/memshim_report.py is gone", not os.path.exists(os.path.join(ROOT, "scripts", "memshim_report.py")))
    stale = []
    for top in ("README.md", "Makefile", "docs", "scripts", "tests"):
        for root, _, names in os.walk(os.path.join(ROOT, top)) if os.path.isdir(os.path.join(ROOT, top)) else \
                [(ROOT, [], [top])]:
            for n in names:
                p = os.path.join(root, n)
                if p == os.path.abspath(__file__) or "/corpus" in p:
                    continue
                try:
                    if "memshim_report.py" in open(p, encoding="utf-8").read():
                        stale.append(os.path.relpath(p, ROOT))
                except (UnicodeDecodeError, OSError):
                    pass
    case("no caller names the old memshim_report.py", not stale, stale)


def make_single(tmp):
    steady, leak = os.path.join(tmp, "steady"), os.path.join(tmp, "leak")
    # five steps an epoch: a steady run (the first epoch warms the pool up: at three steps, epoch 1's
    # live peak dips below epoch 0's and the reserved pages of the warm-up show as 1.11x)
    _, ok1, e1 = demo(steady, "--epochs", "4", "--steps", "5")
    _, ok2, e2 = demo(leak, "--epochs", "4", "--steps", "2", "--leak", "16")
    if not case("demo workload writes the reports (steady and leaking)", ok1 and ok2, (e1 + e2)[-400:]):
        return None
    return steady, leak


def check_single(steady, leak):
    for name, d in (("steady", steady), ("leak", leak)):
        raw = raw_reports(d)
        summ = next(r for r in raw.values() if r["kind"] == "summary")
        t = tool(d)
        case(f"{name}: text report, exit 0, nothing on stderr", t.returncode == 0 and not t.stderr, t.stderr[-300:])
        lines = t.stdout.splitlines()
        check_detail_rows(name, lines, raw)
        series = summ["trend"]["epoch_end_allocated_bytes"]
        g = (series[-1] - series[0]) / (len(series) - 1)
        want = (f"trend: {summ['trend']['verdict']}: allocated at epoch end {mib(series[0])} -> {mib(series[-1])} MiB "
                f"over {len(series)} epochs ({g / MiB:+.1f} MiB/epoch)")
        case(f"{name}: the trend line quotes the reports' verdict and series", want in lines,
             [ln for ln in lines if ln.startswith("trend")])
        if summ["schema_version"] >= 2:  # the demo is a C program: no Python, so no sites, and a note why
            case(f"{name}: no growing sites, no sites, the reports' note quoted",
                 "growing sites: none" in lines and f"sites at the peak: none ({summ['sites_note']})" in lines,
                 [ln for ln in lines if "sites" in ln])
        else:
            case(f"{name}: growing sites n/a in schema-1 reports, sites n/a",
                 "growing sites: n/a (these reports name no growing sites)" in lines
                 and "sites at the peak: n/a (reports of schema 1 name no sites)" in lines)
        j = tool(d, "--json")
        rep = json.loads(j.stdout)
        run = rep["runs"][0]
        rk = run["ranks"][0]
        case(f"{name}: --json: one run, one rank entry without a rank, its peaks and trend from the files",
             len(rep["runs"]) == 1 and len(run["ranks"]) == 1 and rk["rank"] is None
             and rk["allocated_peak_bytes"] == summ["memory"]["allocated_run_peak_bytes"]
             and rk["reserved_peak_bytes"] == summ["memory"]["reserved_run_peak_bytes"]
             and rk["trend"]["epoch_end_allocated_bytes"] == series
             and rk["trend"]["verdict"] == summ["trend"]["verdict"]
             and abs(rk["trend"]["growth_bytes_per_epoch"] - g) < 1e-6, rk)
        rows = rk["streams"][0]["rows"]
        case(f"{name}: --json rows: one per report file", sorted(r["file"] for r in rows) == sorted(raw), len(rows))
        adv = run["advice"]
        text_adv = [ln[4:] for ln in lines if ln.startswith("  - ")]
        case(f"{name}: printed advice is the JSON advice", all(a["text"] in text_adv for a in adv), text_adv)
        check_advice_backed(name, adv)
        if name == "steady":
            case("steady: no advice to change anything (peak reserved within 10% of allocated, flat, no OOM)",
                 [a["kind"] for a in adv] == ["none"] and adv[0]["figures"]["ratio"] <= 1.10
                 and f"{adv[0]['figures']['ratio']:.2f}x" in adv[0]["text"], adv)
        else:
            lk = [a for a in adv if a["kind"] == "leak"]
            case("leak: advice names the leak with its growth per epoch (+16.0 MiB/epoch from the files)",
                 len(lk) == 1 and "+16.0 MiB/epoch" in lk[0]["text"] and f"{g / MiB:+.1f}" == "+16.0"
                 and lk[0]["figures"]["growth_bytes_per_epoch"] == g, lk)
        c = tool(d, "--csv")
        rows = list(csv.DictReader(io.StringIO(c.stdout)))
        bad = []
        for row in rows:
            r = raw[row["file"]]
            m = r["memory"]
            ap = m["allocated_run_peak_bytes"] if r["kind"] == "summary" else m["allocated_peak_bytes"]
            if (row["allocated_peak_bytes"] != str(ap) or row["allocated_end_bytes"] != str(m["allocated_bytes"])
                    or row["map_ops"] != str(r["operations"]["map_ops"]) or row["epoch"] != str(r["epoch"])
                    or row["alloc_p99_ns"] != (str(r["latency"]["alloc_ns"]["p99"]) if "latency" in r else "n/a")
                    or row["top_site"] != "n/a"
                    or abs(float(row["fragmentation"]) - r["fragmentation"]["free_extent_fragmentation"]) > 1e-6
                    or row["fragmentation"] != f'{r["fragmentation"]["free_extent_fragmentation"]:.6g}'):
                bad.append(row)
        case(f"{name}: --csv: one row per file, bytes exact, latency as the files say, no top site", c.returncode == 0
             and len(rows) == len(raw) and not bad, bad[:2])


def make_job(tmp):
    d = os.path.join(tmp, "job")
    procs = []
    for r in range(8):  # run 1: eight ranks at once, as torchrun starts them
        extra = ("--leak", "8") if r == 3 else ("--scale", "1.3") if r == 5 else ()
        procs.append((r, demo_start(d, "--epochs", "4", "--steps", "2", *extra, rank=r)))
    run1, ok = {}, True
    for r, p in procs:
        out, _ = p.communicate(timeout=300)
        ok &= p.returncode == 0 and "finished, 0 failed" in out
        run1[r] = p.pid
    # Reports time-stamp whole seconds: runs closer than that cannot be told apart by time alone.
    time.sleep(2.5)
    run2 = {}
    for r in range(8):  # run 2: the same ranks again, one after another
        pid, ok_, _ = demo(d, "--epochs", "3", "--steps", "2", rank=r)
        ok &= ok_
        run2[r] = pid
    time.sleep(2.5)
    solo, ok_, _ = demo(d, "--epochs", "3", "--steps", "2")  # and a process without a rank
    ok &= ok_
    if not case("8-rank job, a second run of it and an unranked process write their reports", ok):
        return None
    return d, run1, run2, solo


def check_job_ids(tmp):
    """Two 2-rank jobs started at once into one directory, told apart by the launcher's job id."""
    d = os.path.join(tmp, "two-jobs")
    procs = []
    for r in range(2):  # interleaved starts: A0, B0, A1, B1
        for job in ("jobA", "jobB"):
            procs.append((job, r, demo_start(d, "--epochs", "3", "--steps", "2", rank=r,
                                             env={"TORCHELASTIC_RUN_ID": job})))
    want, ok = {}, True
    for job, r, p in procs:
        out, _ = p.communicate(timeout=300)
        ok &= p.returncode == 0 and "finished, 0 failed" in out
        want.setdefault("torchelastic:" + job, {})[r] = p.pid
    pid, ok_, _ = demo(d, "--epochs", "3", "--steps", "2", rank=0, env={"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "7"})
    ok &= ok_
    want["slurm:4242.7"] = {0: pid}
    if not case("two torchrun jobs started at once and a Slurm step write their reports", ok):
        return
    raw = raw_reports(d)
    ids = {(r["pid"], r["run_id"]) for r in raw.values()}
    expect = {(p, rid) for rid, m in want.items() for p in m.values()}
    case("every report carries its launcher's job id as run_id", ids == expect, sorted(ids ^ expect))
    rep = json.loads(tool(d, "--json").stdout)
    got = {r["run_id"]: {k["rank"]: k["pid"] for k in r["ranks"]} for r in rep["runs"]}
    case("memshim-report: one run per job id, each with its own ranks", got == want and len(rep["runs"]) == 3,
         [got, want])


def check_ranks(tmp, d, run1, run2, solo):
    raw = raw_reports(d)
    summ = {key_of(r): r for r in raw.values() if r["kind"] == "summary"}
    rep = json.loads(tool(d, "--json").stdout)
    runs = rep["runs"]
    got = [(r["ranked"], {k["rank"]: k["pid"] for k in r["ranks"]}) for r in runs]
    case("runs recognised: the 8-rank run, its repeat, the unranked process, in start order",
         got == [(True, run1), (True, run2), (False, {None: solo})], got)
    if len(runs) != 3:
        return None
    bad = []
    for run in runs:
        for k in run["ranks"]:
            s = summ[(k["host"], k["pid"], k["rank"], 0)]
            series = s["trend"]["epoch_end_allocated_bytes"]
            if (k["allocated_peak_bytes"] != s["memory"]["allocated_run_peak_bytes"]
                    or k["reserved_peak_bytes"] != s["memory"]["reserved_run_peak_bytes"]
                    or k["trend"]["verdict"] != s["trend"]["verdict"]
                    or k["trend"]["epoch_end_allocated_bytes"] != series
                    or abs(k["trend"]["growth_bytes_per_epoch"] - (series[-1] - series[0]) / (len(series) - 1)) > 1e-6):
                bad.append(k["rank"])
    case("--json ranks: one object per rank with its peaks and trend, equal to its summary file", not bad, bad)
    r1 = runs[0]
    top = max(r1["ranks"], key=lambda k: k["allocated_peak_bytes"])
    case("run 1: the rank with the highest peak is rank 5 (--scale 1.3)",
         r1["highest_peak"]["rank"] == 5 == top["rank"]
         and r1["highest_peak"]["allocated_peak_bytes"] == top["allocated_peak_bytes"], r1["highest_peak"])
    case("run 1: the rank whose memory grows is rank 3 (--leak 8); run 2 has none",
         [g["rank"] for g in r1["growing"]] == [3] and runs[1]["growing"] == [], [r1["growing"], runs[1]["growing"]])
    kinds = {a["kind"] for a in r1["advice"]}
    case("run 1 advice: the leak on rank 3 and rank 5 above the others",
         {"leak", "imbalance"} <= kinds and any("rank 3" in a["text"] for a in r1["advice"] if a["kind"] == "leak")
         and any("rank 5" in a["text"] for a in r1["advice"] if a["kind"] == "imbalance"), r1["advice"])
    for i, run in enumerate(runs):
        check_advice_backed(f"run {i + 1}", run["advice"])

    t = tool(d)
    sec = sections(t.stdout)
    case("text: three runs", t.returncode == 0 and sorted(sec) == [1, 2, 3], sorted(sec))
    for idx, run in ((1, runs[0]), (2, runs[1])):
        lines = sec.get(idx, [])
        ranks = {k["rank"]: k for k in run["ranks"]}
        table = parse_table(lines, "rank", last_free=True)
        bad = []
        for row in table or []:
            k = ranks[int(row["rank"][1:])]
            s = summ[(k["host"], k["pid"], k["rank"], 0)]
            st = k["streams"][0]
            fr = [r["fragmentation"]["free_extent_fragmentation"] for r in raw.values()
                  if key_of(r) == (k["host"], k["pid"], k["rank"], 0) and r["kind"] == "epoch"]
            want = {"pid": str(k["pid"]), "alloc_peak": mib(s["memory"]["allocated_run_peak_bytes"]),
                    "resv_peak": mib(s["memory"]["reserved_run_peak_bytes"]),
                    "resv/alloc": f3(s["memory"]["reserved_run_peak_bytes"] / s["memory"]["allocated_run_peak_bytes"]),
                    "frag_max": f3(max(fr)), "epochs": str(len(fr)), "a.p99us": p99us(raw, key_of, k),
                    "growth/ep": f"{k['trend']['growth_bytes_per_epoch'] / MiB:+.1f}", "verdict": s["trend"]["verdict"]}
            bad += [(row["rank"], c, row[c], w) for c, w in want.items() if row[c] != w]
            if st["rows"][0]["pid"] != k["pid"]:
                bad.append("rows")
        case(f"run {idx}: the per-rank table has 8 rows, each figure equal to the files",
             table and len(table) == 8 and not bad, bad[:4] or table)
        for title, field in (("peak allocated per epoch", "allocated_peak_bytes"),
                             ("peak reserved per epoch", "reserved_peak_bytes")):
            at = next((i for i, ln in enumerate(lines) if ln.startswith(title)), None)
            mat = parse_table(lines[at + 1:], "epoch") if at is not None else None
            bad = []
            for row in mat or []:
                for col, cell in row.items():
                    if col == "epoch":
                        continue
                    k = ranks[int(col[1:])]
                    if row["epoch"] == "run":
                        want = mib(k[field])
                    else:
                        f = [r for r in raw.values() if key_of(r) == (k["host"], k["pid"], k["rank"], 0)
                             and r["kind"] == "epoch" and r["epoch"] == int(row["epoch"])]
                        want = mib(f[0]["memory"][field]) if f else "n/a"
                    if cell != want:
                        bad.append((row["epoch"], col, cell, want))
            case(f"run {idx}: '{title}' has per-rank columns r0..r7 equal to the files",
                 mat and list(mat[0])[1:] == [f"r{i}" for i in range(8)] and not bad, bad[:4] or mat)
        h = run["highest_peak"]
        want = (f"highest peak: rank {h['rank']} (host {h['host']}, pid {h['pid']}, device 0): "
                f"{mib(h['allocated_peak_bytes'])} MiB allocated, {mib(h['reserved_peak_bytes'])} MiB reserved")
        case(f"run {idx}: the highest-peak line names the rank with its figures", want in lines,
             [ln for ln in lines if ln.startswith("highest")])
    grows = [ln for ln in sec.get(1, []) if ln.startswith("memory grows: ")]
    k3 = next(k for k in runs[0]["ranks"] if k["rank"] == 3)
    s3 = k3["trend"]["epoch_end_allocated_bytes"]
    case("run 1: 'memory grows' names rank 3 with its series and growth from the files",
         len(grows) == 1 and grows[0].startswith(f"memory grows: rank 3 (host {k3['host']}, pid {k3['pid']})")
         and f"{mib(s3[0])} -> {mib(s3[-1])} MiB over {len(s3)} epochs (+8.0 MiB/epoch)" in grows[0], grows)
    case("run 2: 'memory grows' says no rank",
         "memory grows: on no rank (no rank's allocated memory at epoch end rose at every epoch boundary)"
         in sec.get(2, []), [ln for ln in sec.get(2, []) if "grows" in ln])
    check_detail_rows("unranked run 3", sec.get(3, []), {p: r for p, r in raw.items() if r["pid"] == solo})
    pp = tool(d, "--per-process")
    rows = parse_table(sections(pp.stdout).get(1, []), "host")
    case("--per-process prints every process's epoch rows in a run of many", rows and len(rows) == sum(
        1 for r in raw.values() if r["pid"] in run1.values()), len(rows or []))

    # charts: PNG decoded, SVG parsed, both the same size; per-rank lines in the rank colours
    png, svg, page = (os.path.join(tmp, n) for n in ("job.png", "job.svg", "job.html"))
    # the built-in drawing (matplotlib draws --plot when it is importable: tests/report_tool/test_advice.py)
    a, b = tool(d, "--plot", png, "--plot-engine", "builtin"), tool(d, "--plot", svg, "--plot-engine", "builtin",
                                                                     "--html", page)
    case("--plot OUT.png / OUT.svg / --html write their files", a.returncode == 0 and b.returncode == 0
         and all(os.path.getsize(p) > 1000 for p in (png, svg, page)), a.stderr + b.stderr)
    try:
        w, h, colours = decode_png(open(png, "rb").read())
        root = ET.parse(svg).getroot()
        case("PNG decodes (chunks, CRCs, inflate) to the SVG's size, 1000 px wide",
             (w, h) == (int(root.get("width")), int(root.get("height"))) and w == 1000 and h > 3 * 3 * 200, (w, h))
        rank_colours = {bytes.fromhex(pl.get("stroke")[1:]) for pl in root.iter("{http://www.w3.org/2000/svg}polyline")
                        if pl.get("class") == "series" and re.fullmatch(r"r\d", pl.get("data-label") or "")}
        case("PNG pixels vary and hold every rank's line colour", len(colours) > 10 and len(rank_colours) == 8
             and rank_colours <= colours, (len(colours), len(rank_colours)))
    except (AssertionError, ValueError, struct.error, zlib.error, TypeError) as e:
        case("PNG decodes", False, repr(e))
    root = check_svg("job", svg, rep)
    mem = svg_series(root, "peak allocated and reserved")
    bad = []
    for run, panel in zip(runs[:2], mem):
        for k in run["ranks"]:
            rows = [r for r in k["streams"][0]["rows"] if r["kind"] == "epoch"]
            want = ([r["epoch"] for r in rows], [r["allocated_peak_bytes"] / MiB for r in rows])
            got = panel.get(f"r{k['rank']}")
            if not got or got[0] != want[0] or any(abs(x - y) > 1e-9 for x, y in zip(got[1], want[1])):
                bad.append((k["rank"], got, want))
            if f"r{k['rank']} reserved" not in panel:
                bad.append((k["rank"], "no reserved line"))
    case("SVG: one allocated and one reserved line per rank, values from the reports", len(mem) == 3 and not bad,
         bad[:2])
    check_html("job", page, rep, {"ranks", "epochs"})


def check_schema2(tmp, steady, leak, job):
    # SYNTHETIC schema-2 reports (see synthesize): the library on this branch writes schema 1.
    raw_leak = raw_reports(leak)
    series = next(r for r in raw_leak.values() if r["kind"] == "summary")["trend"]["epoch_end_allocated_bytes"]
    grow = (series[-1] - series[0]) // (len(series) - 1)
    d = os.path.join(tmp, "synthetic-tensor")
    synthesize(leak, d, "tensor", grow=grow)
    raw = raw_reports(d)
    t = tool(d)
    case("synthetic schema 2 (tensor): read without warnings", t.returncode == 0 and not t.stderr, t.stderr[-300:])
    lines = t.stdout.splitlines()
    check_detail_rows("synthetic schema 2", lines, raw)
    case("synthetic schema 2: new epoch reasons shown", any(" hf_trainer " in ln for ln in lines)
         and any(" dataloader " in ln for ln in lines))
    case("synthetic schema 2: the versions line",
         "versions: memshim 0.2.0-synthetic, torch 2.11.0, CUDA driver 13000, runtime 13000, device Synthetic GPU"
         in lines, [ln for ln in lines if ln.startswith("versions")])
    case("synthetic schema 2: the growing sites with their growth per epoch",
         f"growing sites: train.py:57 (log_losses) {grow / MiB:+.1f} MiB/epoch" in lines,
         [ln for ln in lines if "growing" in ln])
    peak = max((r for r in raw.values() if r["kind"] != "summary"), key=lambda r: r["memory"]["allocated_peak_bytes"])
    at = next((i for i, ln in enumerate(lines) if ln.startswith("sites at the peak")), None)
    rows = parse_table([ln.strip() for ln in lines[at + 1:]], "MiB", last_free=True) if at is not None else None
    ap = peak["memory"]["allocated_peak_bytes"]
    want = [{"MiB": mib(s["bytes"]), "share": f3(s["bytes"] / ap), "count": str(s["count"]),
             "site": f"{s['file']}:{s['line']} ({s['function']})"} for s in peak["sites"]]
    case("synthetic schema 2: sites at the peak epoch, bytes, share and count from the file",
         at is not None and lines[at] == f"sites at the peak (epoch {peak['epoch']}, peak allocated {mib(ap)} MiB):"
         and rows == want, (lines[at] if at is not None else None, rows, want))
    rep = json.loads(tool(d, "--json").stdout)
    adv = rep["runs"][0]["advice"]
    case("synthetic schema 2: a site with 60% of a peak at a small share of the device: no capacity advice",
         not [a for a in adv if a["kind"] in ("capacity", "site")], adv)
    dn = os.path.join(tmp, "synthetic-tensor-near")
    synthesize(leak, dn, "tensor", grow=grow, near=0.9)
    adv_n = json.loads(tool(dn, "--json").stdout)["runs"][0]["advice"]
    site = [a for a in adv_n if a["kind"] == "capacity"]
    case("synthetic schema 2 at 90% of the device: capacity advice names the dominant site (60% of the peak) with "
         "checkpointing or a smaller batch",
         len(site) == 1 and "train.py:42 (forward)" in site[0]["text"] and "(60%)" in site[0]["text"]
         and "is 90% of the" in site[0]["text"]
         and "checkpointing" in site[0]["text"] and "smaller batch" in site[0]["text"], site)
    check_advice_backed("synthetic schema 2 at 90% of the device", adv_n)
    lk = [a for a in adv if a["kind"] == "leak"]
    case("synthetic schema 2: the leak advice names the growing site",
         len(lk) == 1 and f"at these sites: train.py:57 (log_losses) {grow / MiB:+.1f} MiB/epoch" in lk[0]["text"], lk)
    check_advice_backed("synthetic schema 2", adv)
    c = list(csv.DictReader(io.StringIO(tool(d, "--csv").stdout)))
    bad = [r for r in c if r["alloc_p99_ns"] != str(raw[r["file"]]["latency"]["alloc_ns"]["p99"])
           or r["top_site"] != "train.py:42:forward" or r["driver_modelled_seconds"] != "0.25"]
    case("synthetic schema 2: --csv carries latency, top site and driver time", c and not bad, bad[:2])
    png, page = os.path.join(tmp, "s2.png"), os.path.join(tmp, "s2.html")
    tool(d, "--plot", png, "--plot-engine", "builtin", "--html", page)
    try:
        w, h, colours = decode_png(open(png, "rb").read())
        case("synthetic schema 2: PNG decodes, 1000 px wide, pixels vary", w == 1000 and h > 600 and len(colours) > 5,
             (w, h, len(colours)))
    except (AssertionError, ValueError, struct.error, zlib.error, TypeError) as e:
        case("synthetic schema 2: PNG decodes", False, repr(e))
    p, text = check_html("synthetic schema 2", page, rep, {"ranks", "epochs", "sites"})
    case("synthetic schema 2: HTML names the sites",
         "train.py:42 (forward)" in text and "model.py:7 (attention)" in text)

    d = os.path.join(tmp, "synthetic-even")
    synthesize(steady, d, "even")
    adv = json.loads(tool(d, "--json").stdout)["runs"][0]["advice"]
    case("synthetic schema 2: no site dominates (4 x 20%): no site advice", [a["kind"] for a in adv] == ["none"], adv)

    d = os.path.join(tmp, "synthetic-segment")
    synthesize(steady, d, "segment")
    t = tool(d)
    rep = json.loads(tool(d, "--json").stdout)
    fr = [a for a in rep["runs"][0]["advice"] if a["kind"] == "torch-frag"]
    case("synthetic schema 2 (segment): PyTorch reserved 1.40x allocated: tensor mode or expandable segments",
         len(fr) == 1 and "(1.40x)" in fr[0]["text"] and "tensor mode" in fr[0]["text"]
         and "expandable_segments:True" in fr[0]["text"], fr)
    check_advice_backed("synthetic schema 2 (segment)", rep["runs"][0]["advice"])
    check_detail_rows("synthetic schema 2 (segment)", t.stdout.splitlines(), raw_reports(d))
    case("synthetic schema 2 (segment): sites say why they are empty",
         "sites at the peak: none (segment mode: sites need tensor mode)" in t.stdout.splitlines(), t.stdout[-600:])

    d = os.path.join(tmp, "synthetic-sparse")
    synthesize(steady, d, "sparse")
    t = tool(d)
    j = tool(d, "--json")
    h = os.path.join(tmp, "sparse.html")
    x = tool(d, "--html", h, "--plot", os.path.join(tmp, "sparse.svg"))
    lines = t.stdout.splitlines()
    case("synthetic schema 2 without the optional fields: n/a, never a traceback",
         t.returncode == j.returncode == x.returncode == 0 and "Traceback" not in t.stderr + j.stderr + x.stderr
         and "versions: memshim n/a, torch n/a, CUDA driver n/a, runtime n/a, device n/a" in lines
         and "growing sites: n/a (these reports name no growing sites)" in lines
         and "sites at the peak: n/a (these reports name no sites)" in lines, t.stdout[-800:] + t.stderr)

    d = os.path.join(tmp, "synthetic-ranks")
    src = os.path.join(tmp, "run2-only")
    os.makedirs(src)
    raw_job = raw_reports(job)
    pids = sorted({r["pid"] for r in raw_job.values() if r["rank"] >= 0})[8:16]
    for p, r in raw_job.items():
        if r["pid"] in pids:
            shutil.copy(p, src)
    synthesize(src, d, "tensor", near=0.9)
    rep = json.loads(tool(d, "--json").stdout)
    site = [a for a in rep["runs"][0]["advice"] if a["kind"] == "capacity"]
    case("synthetic schema 2, 8 ranks at 90% of their device: one capacity advice for all ranks, naming them",
         len(rep["runs"]) == 1 and len(site) == 1 and " on ranks 0-7 " in site[0]["text"]
         and site[0]["figures"]["ranks"] == list(range(8)), site)


def check_wide(tmp, job):
    """SYNTHETIC 24-rank run (run 2's reports copied as ranks 8-23): per-rank columns in blocks of 16."""
    d = os.path.join(tmp, "synthetic-wide")
    os.makedirs(d)
    raw_job = raw_reports(job)
    pids = sorted({r["pid"] for r in raw_job.values() if r["rank"] >= 0})[8:16]
    for path, r in raw_job.items():
        if r["pid"] not in pids:
            continue
        for k in range(3):
            s = dict(r, rank=r["rank"] + 8 * k, pid=r["pid"] + 1000000 * k, _synthetic=SYNTHETIC)
            name = os.path.basename(path).replace(f"-rank{r['rank']}-", f"-rank{s['rank']}-")
            json.dump(s, open(os.path.join(d, name.replace(f"pid{r['pid']}", f"pid{s['pid']}")), "w"))
    raw = raw_reports(d)
    lines = tool(d).stdout.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("peak allocated per epoch")), None)
    first = parse_table(lines[at + 1:], "epoch") if at is not None else None
    nxt = next((i for i in range(at + 4, len(lines)) if lines[i].startswith("epoch ")), None) if first else None
    second = parse_table(lines[nxt:], "epoch") if nxt else None
    bad = []
    for row in second or []:
        for col, cell in list(row.items())[1:]:
            kind = "summary" if row["epoch"] == "run" else "epoch"
            f = [r for r in raw.values() if r["rank"] == int(col[1:]) and r["kind"] == kind
                 and (kind == "summary" or r["epoch"] == int(row["epoch"]))]
            m = f[0]["memory"] if f else {}
            want = mib(m["allocated_run_peak_bytes"] if kind == "summary" else m["allocated_peak_bytes"])
            if cell != want:
                bad.append((row["epoch"], col, cell, want))
    case("24 ranks (synthetic copies): per-rank columns in blocks of 16, r0-r15 then r16-r23, figures from the files",
         first and second and list(first[0])[1:] == [f"r{i}" for i in range(16)]
         and list(second[0])[1:] == [f"r{i}" for i in range(16, 24)] and not bad, bad[:3] or (first, second))


def check_oom_and_pages(tmp, steady):
    d = os.path.join(tmp, "oom")
    _, ok, err = demo(d, "--epochs", "3", "--steps", "3", env={"MEMSHIM_LIMIT": "1200M"})
    raw = raw_reports(d)
    ooms = [r for r in raw.values() if r["kind"] == "oom"]
    if not case("the demo under MEMSHIM_LIMIT=1200M writes OOM reports", ok and ooms, err[-300:]):
        return
    summ = next(r for r in raw.values() if r["kind"] == "summary")
    # each OOM report names its failure in oom_index, the NNNN of its file name, in the order
    # the failures happened; its epoch is the epoch under way (not the OOM number)
    named = sorted((int(re.search(r"oom(\d+)\.json$", f).group(1)), r) for f, r in raw.items() if r["kind"] == "oom")
    nepochs = sum(1 for r in raw.values() if r["kind"] == "epoch")
    case("OOM run: oom_index is the file's number, 0..n-1 in time order; epoch is the epoch under way",
         [i for i, _ in named] == list(range(len(named)))
         and all(r.get("oom_index") == i for i, r in named)
         and [r["t_end_s"] for _, r in named] == sorted(r["t_end_s"] for _, r in named)
         and all(r["epoch"] <= nepochs for _, r in named),
         [(i, r.get("oom_index"), r["epoch"]) for i, r in named])
    t = tool(d)
    lines = t.stdout.splitlines()
    check_detail_rows("OOM run", lines, raw)
    rows = parse_table(lines, "host")
    times = sorted(r["t_end_s"] for r in raw.values() if r["kind"] != "summary")
    by = {}
    for r in raw.values():
        by.setdefault((r["kind"], str(r["epoch"])), []).append(r["t_end_s"])
    order = [(row["kind"].split("#")[0], row["epoch"]) for row in rows[:-1]]
    want = sorted(((r["kind"], str(r["epoch"])) for r in raw.values() if r["kind"] != "summary"),
                  key=lambda k: min(by[k]))
    case("OOM run: rows in the order the reports were made (OOM rows among the epoch rows by time)",
         order == sorted(order, key=lambda k: min(by[k])) and sorted(order) == sorted(want)
         and rows[-1]["kind"] == "summary", (order, times))
    rep = json.loads(tool(d, "--json").stdout)
    adv = [a for a in rep["runs"][0]["advice"] if a["kind"] == "oom"]
    lo, n = summ["last_oom"], summ["oom"]["oom_events"]
    cap = lo["limit_bytes"] or lo["device_total_bytes"]
    want = (f"{n} failed requests (OOM): the last asked for {mib(lo['requested_bytes'])} MiB with "
            f"{mib(lo['live_bytes'])} MiB live and {mib(lo['reserved_bytes'])} MiB reserved of {mib(cap)} MiB "
            "(MEMSHIM_LIMIT)")
    case("OOM run: advice quotes the failures and the last OOM of the summary, cause as the report says",
         len(adv) == 1 and adv[0]["text"].startswith(want) and adv[0]["figures"]["oom_events"] == n
         and ("the live set does not fit" in adv[0]["text"] if lo["cause"] == "capacity"
              else "fragmentation" in adv[0]["text"]), (adv, want))
    check_advice_backed("OOM run", rep["runs"][0]["advice"])

    d = os.path.join(tmp, "synthetic-held")
    synthesize(steady, d, "held")
    raw = raw_reports(d)
    rep = json.loads(tool(d, "--json").stdout)
    adv = [a for a in rep["runs"][0]["advice"] if a["kind"] == "pool-frag"]
    ep = max((r for r in raw.values() if r["kind"] == "epoch"),
             key=lambda r: r["memory"]["reserved_peak_bytes"] - r["memory"]["allocated_peak_bytes"])
    m = ep["memory"]
    want = (f"fragmentation: memshim held {mib(m['reserved_peak_bytes'])} MiB at the peak of epoch "
            f"{ep['epoch']} for {mib(m['allocated_peak_bytes'])} MiB live "
            f"({m['reserved_peak_bytes'] / m['allocated_peak_bytes']:.2f}x) "
            "(10.0 MiB in pages shared with live blocks, "
            f"{mib(m['reserved_peak_bytes'] - m['touched_peak_bytes'])} MiB in cached pages); MEMSHIM_DEFRAG=1 (now 0)")
    case("synthetic held pages (reserved 1.3x allocated, defrag off): advice splits the excess, names MEMSHIM_DEFRAG",
         len(adv) == 1 and adv[0]["text"].startswith(want), (adv, want))
    check_advice_backed("synthetic held pages", rep["runs"][0]["advice"])

    d = os.path.join(tmp, "synthetic-twodev")
    synthesize(steady, d, "twodev")
    raw = raw_reports(d)
    rep = json.loads(tool(d, "--json").stdout)
    t = tool(d)
    lines = t.stdout.splitlines()
    tab = parse_table(lines, "stream", last_free=True)
    case("synthetic two devices in one process: one run, one process entry with devices [0, 1]",
         len(rep["runs"]) == 1 and len(rep["runs"][0]["ranks"]) == 1
         and rep["runs"][0]["ranks"][0]["devices"] == [0, 1],
         rep["runs"][0]["ranks"][0]["devices"] if rep["runs"] else None)
    s0 = [r for r in raw.values() if r["kind"] == "summary"]
    case("synthetic two devices: per-device table, device 0 has the highest peak",
         tab and [r["stream"] for r in tab] == ["dev0", "dev1"]
         and [r["alloc_peak"] for r in tab] == [mib(s["memory"]["allocated_run_peak_bytes"])
                                               for s in sorted(s0, key=lambda s: s["device"])]
         and rep["runs"][0]["highest_peak"]["device"] == 0
         and any(ln.startswith("highest peak: device 0 ") for ln in lines), tab)


def check_mutations(tmp, steady):
    """Reports with one field deleted or replaced by a value of another type: the tool reads,
    skips or warns, and never raises (run in-process, 400 variants, fixed seed)."""
    import importlib.machinery
    import importlib.util
    import random
    loader = importlib.machinery.SourceFileLoader("memshim_report_tool", MODULE)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    base = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(steady, "*.json")))]
    base.append(copy.deepcopy(base[0]))
    base[-1].update(schema_version=2, sites=[{"file": "a.py", "line": 1, "function": "f", "bytes": 5, "count": 1}],
                    latency={"alloc_ns": {"p50": 1, "p99": 2}}, versions={"torch": "x"},
                    torch_memory_stats={"allocated_bytes.all.peak": 1, "reserved_bytes.all.peak": 2})
    base[-1]["trend"]["growing_sites"] = [{"file": "a.py", "line": 1, "function": "f", "growth_bytes_per_epoch": 1}]

    def paths(o, pre=()):
        yield pre
        if isinstance(o, dict):
            for k, v in o.items():
                yield from paths(v, pre + (k,))
        elif isinstance(o, list):
            for i, v in enumerate(o[:3]):
                yield from paths(v, pre + (i,))
    rnd = random.Random(11)
    values = [None, "x", -1, 0, 2 ** 70, 1e308, -0.5, True, [], {}, [1, "a"], {"a": None}]
    failures = []
    d = os.path.join(tmp, "mutants")
    for i in range(400):
        r = copy.deepcopy(rnd.choice(base))
        where = rnd.choice([p for p in paths(r) if p])
        parent = r
        for k in where[:-1]:
            parent = parent[k]
        if rnd.random() < 0.3 and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = rnd.choice(values)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for j, b in enumerate(base[:2]):
            json.dump(b, open(os.path.join(d, f"memshim-good{j}.json"), "w"))
        json.dump(r, open(os.path.join(d, "memshim-mutant.json"), "w"))
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                for args in ([d], [d, "--json"], [d, "--csv"], [d, "--html", os.path.join(tmp, "m.html"), "--plot",
                                                                  os.path.join(tmp, "m.svg"), "--plot-engine",
                                                                  "builtin"]):
                    rc = mod.main(args)
                    if rc != 0:
                        raise RuntimeError(f"exit {rc}")
        except Exception as e:  # noqa: BLE001 -- any exception is the finding
            failures.append((where, repr(e), err.getvalue()[-200:]))
    case("400 reports with a field deleted or of another type: read, skipped or warned, never an exception",
         not failures, failures[:3])


def check_bad_input(tmp, steady):
    d = os.path.join(tmp, "bad")
    shutil.copytree(steady, d)
    good = sorted(glob.glob(os.path.join(d, "memshim-*.json")))
    base = json.load(open(good[0]))
    bad = {
        "memshim-truncated.json": '{"schema_version": 1, "kind": "epoch", ',
        "memshim-empty.json": "",
        "memshim-array.json": "[1, 2, 3]",
        "memshim-schema9.json": json.dumps(dict(base, schema_version=9)),
        "memshim-pidstring.json": json.dumps(dict(base, pid="12")),
        "memshim-nomemory.json": json.dumps({k: v for k, v in base.items() if k != "memory"}),
        "memshim-nan.json": json.dumps(dict(base, memory=dict(base["memory"], allocated_bytes=float("nan")))),
        "memshim-negative.json": json.dumps(dict(base, memory=dict(base["memory"], reserved_peak_bytes=-1))),
        "memshim-bool.json": json.dumps(dict(base, device=True)),
        "memshim-nested.json": "[" * 100000 + "]" * 100000,
    }
    for n, body in bad.items():
        open(os.path.join(d, n), "w").write(body)
    open(os.path.join(d, "memshim-binary.json"), "wb").write(b"\xff\xfe\x00\x81")
    os.makedirs(os.path.join(d, "memshim-adir.json"))
    shutil.copy(good[0], os.path.join(d, "memshim-copy-of-first.json"))
    odd = dict(base, schema_version=2, sites="oops", latency={"alloc_ns": {"p50": "fast"}},
               memshim_overhead={"driver_calls": {"cuMemCreate": 5}, "share_of_wall": "x"})
    odd["epoch"] = 77
    open(os.path.join(d, "memshim-oddfields.json"), "w").write(json.dumps(odd))
    t = tool(d)
    named = [n for n in list(bad) + ["memshim-binary.json"]
             if sum(n in ln and "skipping" in ln for ln in t.stderr.splitlines()) != 1]
    dup = [ln for ln in t.stderr.splitlines() if "duplicate of" in ln]
    case("a copy of a report is skipped as a duplicate, both names given",
         len(dup) == 1 and "memshim-copy-of-first.json" in dup[0] and os.path.basename(good[0]) in dup[0], dup)
    case("malformed files: each named once on stderr and skipped, the rest tabulated, no traceback",
         t.returncode == 0 and not named and "Traceback" not in t.stderr
         and t.stdout.startswith(f"memshim-report: {len(good) + 1} reports"), (named, t.stderr[-1500:]))
    case("a report with malformed optional fields is kept, the fields named and shown n/a",
         "memshim-oddfields.json: field sites ignored: not a list" in t.stderr
         and "field latency.alloc_ns.p50 ignored: not a number" in t.stderr
         and "field memshim_overhead.driver_calls ignored: not an object of {count, seconds}" in t.stderr
         and "field memshim_overhead.share_of_wall ignored: not a number" in t.stderr
         and any(re.search(r"\sepoch\s+77\s", ln) and ln.split()[-4:-2] == ["n/a", "n/a"]
                 for ln in t.stdout.splitlines()),
         t.stderr[-600:])
    case("memshim's own cost: one line per process from its last report, its largest driver cost named (issue 24)",
         any(re.match(r"memshim's own cost, \w+ report: driver cu[A-Za-z]+ \d+ x [\d.]+ ms", ln)
             for ln in t.stdout.splitlines()), t.stdout[-1200:])
    j = tool(d, "--json")
    rep = json.loads(j.stdout)
    case("--json lists the skipped files with reasons", len(rep["skipped"]) == len(bad) + 2
         and all(s["reason"] for s in rep["skipped"]), rep["skipped"][:3])
    only_bad = os.path.join(tmp, "only-bad")
    os.makedirs(only_bad)
    open(os.path.join(only_bad, "memshim-x.json"), "w").write("{")
    t = tool(only_bad)
    case("a directory of bad files: exit 1, one line naming it, one line saying no reports",
         t.returncode == 1 and "memshim-x.json" in t.stderr and "no memshim reports" in t.stderr
         and len(t.stderr.splitlines()) == 2 and not t.stdout, t.stderr)
    t = tool(os.path.join(tmp, "does-not-exist"), steady)
    case("a missing path is named, the other path still read", t.returncode == 0 and "does-not-exist" in t.stderr
         and "no such file or directory" in t.stderr and "== run 1 of 1" in t.stdout, t.stderr)
    t = tool(*sorted(glob.glob(os.path.join(steady, "*-epoch*.json"))))
    case("files given one by one are read (epochs only: the trend still comes from them)",
         t.returncode == 0 and "== run 1 of 1" in t.stdout and "trend: flat" in t.stdout, t.stdout[-300:] + t.stderr)
    for args, what in (((), "no path"), ((steady, "--plot", os.path.join(tmp, "x.jpg")), "--plot x.jpg"),
                       ((steady, "--json", "--csv"), "--json with --csv"), ((steady, "--bogus"), "unknown option")):
        t = tool(*args)
        case(f"usage error ({what}): exit 2 with a message, no traceback",
             t.returncode == 2 and t.stderr and "Traceback" not in t.stderr, t.stderr)
    t = tool(steady, "--plot", os.path.join(good[0], "sub", "x.png"))
    case("an unwritable --plot path: exit 1, one line, the table still printed",
         t.returncode == 1 and "cannot write" in t.stderr and "Traceback" not in t.stderr and "== run 1" in t.stdout,
         t.stderr)
    t = tool("--help")
    case("--help explains how a run is recognised", t.returncode == 0 and "until a rank repeats" in t.stdout)


def check_callers(tmp):
    # -S -s: no site-packages, so matplotlib and friends are out of reach
    t = subprocess.run([sys.executable, "-S", "-s", TOOL, os.path.join(tmp, "steady"), "--plot",
                        os.path.join(tmp, "nosite.png"), "--html", os.path.join(tmp, "nosite.html")],
                       capture_output=True, text=True, timeout=120)
    case("standard library only: table, PNG and HTML with site-packages out of reach (python3 -S)",
         t.returncode == 0 and os.path.getsize(os.path.join(tmp, "nosite.png")) > 1000, t.stderr[-300:])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and k not in RANK_VARS}
    env.update({"BUILD": os.path.relpath(BUILD, ROOT), "MEMSHIM_REPORT_DIR": os.path.join(tmp, "demo-sh")})
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--epochs", "3", "--steps", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    case("scripts/demo.sh runs memshim-report on its reports", p.returncode == 0 and "== run 1 of 1" in p.stdout
         and "advice:" in p.stdout, (p.stdout + p.stderr)[-600:])
    dest = os.path.join(tmp, "install")
    p = subprocess.run(["make", "-s", "-C", ROOT, f"BUILD={os.path.relpath(BUILD, ROOT)}", "install",
                        f"DESTDIR={dest}", "PREFIX=/opt/memshim"], capture_output=True, text=True, timeout=600)
    inst = os.path.join(dest, "opt", "memshim", "bin", "memshim-report")
    case("make install puts memshim-report in PREFIX/bin, executable", p.returncode == 0 and os.access(inst, os.X_OK)
         and subprocess.run([inst, os.path.join(tmp, "steady")], capture_output=True).returncode == 0,
         (p.stdout + p.stderr)[-400:])


def guarded(fn, *args):
    """A check that dies half-way (the tool printed no JSON, a table is missing) is one failure
    with its traceback; the other checks still run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        import traceback
        case(f"{fn.__name__} runs to its end", False, traceback.format_exc(limit=3)[-800:])
        return None


def main():
    check_rename()
    needed = [os.path.join(BUILD, n) for n in ("memshim-train-demo", "libmemshim.so", "double/libcuda.so.1")]
    if not all(os.path.exists(p) for p in needed):
        missing = [p for p in needed if not os.path.exists(p)]
        skip("memshim-report on the demo's reports", f"build first (make): missing {missing}")
        finish()
    with tempfile.TemporaryDirectory(prefix="memshim-report-test-") as tmp:
        steady, leak = guarded(make_single, tmp) or (None, None)
        job = guarded(make_job, tmp)
        if steady:
            guarded(check_single, steady, leak)
        if job:
            guarded(check_ranks, tmp, *job)
        guarded(check_job_ids, tmp)
        if steady and job:
            guarded(check_schema2, tmp, steady, leak, job[0])
            guarded(check_wide, tmp, job[0])
        if steady:
            guarded(check_oom_and_pages, tmp, steady)
            guarded(check_bad_input, tmp, steady)
            guarded(check_mutations, tmp, steady)
            guarded(check_callers, tmp)
    finish()


if __name__ == "__main__":
    main()
