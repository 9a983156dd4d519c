#!/usr/bin/env python3
"""memshim-report's HTML page in a real browser (issue 31, item 4): Chromium headless, from Debian's
packages (scripts/setup.sh installs it), opens the page the tool writes for real reports (the demo
workload as one process and as a 4-rank job, and the Python sites workload, all under
LD_PRELOAD=libmemshim.so on the CUDA driver double) and reports, from inside the page:
  - every script error and every error the console logged (the page must have none);
  - each chart line: the points the browser parsed against the values the line carries
    (data-values), each point inside its chart, a line with several points drawn with a length;
  - each table's right edge against the page's width, at 1280 and 900 CSS pixels (no table may
    run past the page: the epoch table of 23 columns did, and needed a horizontal scroll);
  - the page's text: memshim's own cost, as the text report prints it, for every process.
The probe is a copy of the page with one script added at the top (the tool's page itself has no
script); Chromium runs it with --dump-dom and the script writes its findings into the DOM. Skips,
saying why, only when no Chromium is installed or it cannot start here. Ends with
"N passed, N failed, N skipped"."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, skip  # noqa: E402

TOOL = os.path.join(ROOT, "scripts", "memshim-report")
WIDTHS = (1280, 900)

PROBE = r"""<script>
(function () {
  var found = {errors: []};
  window.addEventListener("error", function (e) {
    found.errors.push(String(e.message || (e.target && (e.target.src || e.target.href)) || "error"));
  }, true);
  window.addEventListener("unhandledrejection", function (e) { found.errors.push("rejection: " + e.reason); });
  var cerr = console.error;
  console.error = function () { found.errors.push("console: " + Array.prototype.join.call(arguments, " ")); cerr.apply(console, arguments); };
  window.addEventListener("load", function () {
    var de = document.documentElement;
    found.viewport = de.clientWidth;
    found.scroll_width = de.scrollWidth;
    found.body_right = document.body.getBoundingClientRect().right;
    found.tables = Array.prototype.map.call(document.querySelectorAll("table"), function (t) {
      var r = t.getBoundingClientRect();
      return {cls: t.className, left: r.left, right: r.right, scroll: t.scrollWidth, client: t.clientWidth,
              rows: t.rows.length};
    });
    found.svgs = Array.prototype.map.call(document.querySelectorAll("svg"), function (s) {
      var r = s.getBoundingClientRect();
      return {right: r.right, width: r.width};
    });
    found.lines = Array.prototype.map.call(document.querySelectorAll("polyline.series"), function (p) {
      var svg = p.ownerSVGElement, vb = svg.viewBox.baseVal, pts = [];
      for (var i = 0; i < p.points.numberOfItems; i++) { var q = p.points.getItem(i); pts.push([q.x, q.y]); }
      return {label: p.getAttribute("data-label"), values: (p.getAttribute("data-values") || "").split(",").length,
              points: pts, vb: [vb.x, vb.y, vb.width, vb.height], length: p.getTotalLength(),
              shown: p.getBoundingClientRect().width + p.getBoundingClientRect().height};
    });
    found.text = document.body.innerText;
    var pre = document.createElement("pre");
    pre.id = "memshim-probe";
    pre.textContent = JSON.stringify(found);
    document.body.appendChild(pre);
  });
})();
</script>"""


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


def browse(exe, page, width, profile):
    """Chromium headless on `page` at `width` CSS pixels: (the probe's findings or None, console lines)."""
    argv = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-extensions", f"--user-data-dir={profile}", f"--window-size={width},900",
            "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0", "--dump-dom", "file://" + page]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="memshim-probe">(.*?)</pre>', p.stdout, re.S)
    console = [ln for ln in p.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    if not m:
        return None, console, p.stderr[-800:]
    raw = m.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
    return json.loads(raw), console, None


def demo(report_dir, rank=None, python=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and k not in ("RANK", "LOCAL_RANK")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": os.path.join(BUILD, "libmemshim.so"),
                "CUDBL_CAPACITY": "8G", "MEMSHIM_REPORT_DIR": report_dir, "MEMSHIM_LOG": "error"})
    if rank is not None:
        env["RANK"] = str(rank)
    if python:
        env["MEMSHIM_EPOCH"] = "manual"
        os.makedirs(report_dir, exist_ok=True)
        argv = [sys.executable, python, os.path.join(report_dir, "sites.log")]
    else:
        argv = [os.path.join(BUILD, "memshim-train-demo"), "--epochs", "4", "--steps", "2", "--scale", "0.25"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300).returncode == 0


def main():
    exe = chromium()
    if not exe:
        skip("memshim-report --html in a browser", "no Chromium here: bash scripts/setup.sh installs it "
             "(apt-get install chromium)")
        finish()
    for f in (os.path.join(BUILD, "libmemshim.so"), os.path.join(BUILD, "memshim-train-demo")):
        if not os.path.exists(f):
            case("built", False, f"{f} missing (make)")
            finish()
    with tempfile.TemporaryDirectory(prefix="memshim-html-") as tmp:
        one, job, sites = (os.path.join(tmp, d) for d in ("one", "job", "sites"))
        ok = demo(one) and all(demo(job, rank=r) for r in range(4)) and demo(
            sites, python=os.path.join(ROOT, "tests", "reports", "sites_workload.py"))
        case("the demo (one process, a 4-rank job) and the sites workload wrote reports", ok,
             [len(glob.glob(os.path.join(d, "*.json"))) for d in (one, job, sites)])
        page = os.path.join(tmp, "page.html")
        r = subprocess.run([TOOL, one, job, sites, "--html", page], capture_output=True, text=True, timeout=300)
        text_report = subprocess.run([TOOL, one, job, sites, "--per-process"], capture_output=True, text=True,
                                     timeout=300).stdout
        case("memshim-report --html writes the page", r.returncode == 0 and os.path.exists(page), r.stderr[-600:])
        if not os.path.exists(page):
            finish()
        src = open(page, encoding="utf-8").read()
        probe = os.path.join(tmp, "probe.html")
        with open(probe, "w", encoding="utf-8") as f:
            f.write(src.replace("<head>", "<head>" + PROBE, 1))
        found, console, why = browse(exe, probe, WIDTHS[0], os.path.join(tmp, "profile"))
        if found is None:
            skip("memshim-report --html in a browser", f"Chromium ({exe}) could not render here: {why}")
            finish()
        errors = found["errors"] + [c for c in console if "error" in c.lower() or "Uncaught" in c]
        case(f"Chromium renders the page with no script or console error ({len(found['lines'])} chart lines, "
             f"{len(found['tables'])} tables)", not errors and found["tables"], errors[:5])
        bad = []
        for ln in found["lines"]:
            x0, y0, w, h = ln["vb"]
            if len(ln["points"]) != ln["values"] or not ln["points"]:
                bad.append(f"{ln['label']}: {len(ln['points'])} points for {ln['values']} values")
            elif any(not (x0 <= x <= x0 + w and y0 <= y <= y0 + h) for x, y in ln["points"]):
                bad.append(f"{ln['label']}: a point outside its chart")
            elif len(ln["points"]) > 1 and not (ln["length"] > 0 and ln["shown"] > 0):
                bad.append(f"{ln['label']}: drawn with no length")
        case("every chart line carries one point per value, inside its chart, drawn", found["lines"] and not bad,
             bad[:4])
        # memshim's own cost: the text report's line for each process, on the page
        cost = [ln.split(": ", 1)[1] for ln in text_report.splitlines() if ln.startswith("memshim's own cost")]
        page_text = " ".join(found["text"].split())
        missing = [c for c in cost if " ".join(c.split()) not in page_text]
        case(f"the page shows memshim's own cost as the text report does ({len(cost)} processes: driver calls, "
             "synchronizes, path latency, share of the wall time)",
             cost and not missing and "memshim's own cost" in page_text, missing[:2])
        for width in WIDTHS:
            found, console, why = browse(exe, probe, width, os.path.join(tmp, f"profile{width}"))
            if found is None:
                case(f"the page renders at {width} px", False, why)
                continue
            wide = [f"{t['cls'] or 'table'}: right edge {t['right']:.0f} px" for t in found["tables"]
                    if t["right"] > found["viewport"] + 0.5 or t["scroll"] > t["client"] + 1]
            wide += [f"chart: right edge {s['right']:.0f} px" for s in found["svgs"] if s["right"] > found["viewport"] + 0.5]
            case(f"at {width} px no table or chart runs past the page ({found['viewport']} px wide; the page "
                 f"scrolls {found['scroll_width']} px)", not wide and found["scroll_width"] <= found["viewport"],
                 wide[:4])
    finish()


if __name__ == "__main__":
    main()
