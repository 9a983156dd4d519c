#!/usr/bin/env python3
"""The GPU check in one go (issue 17 item 6; docs/testing.md, "The GPU check"). Run through
tests/gpu/run_gpu_checks.sh:

  --prepare   here: build build-gpu/ (make BUILD=build-gpu JANSSON=static: jansson inside the
              library, so reports need no libjansson there), the VMM cost probe, the audit module
              that hides libjansson, then drop what the run does not need (objects, archives): the
              folder a device run carries (a few MB). No network, nothing installed.
  (none)      on the lent GPU machine, from the checkout with build-gpu/ carried: every step but the
              bench on the real driver, nothing installed, each step with its own timeout, all
              within --budget (default 470 s, under 8 minutes), results as JSON under $OUT
              (gpu-checks.json, one file per step).
  --steps machine,glue,bench   the bench, alone (another device command), with its own budget
              (--bench-budget, default 420 s): a row it cannot finish fails the step.
  --dry-run   here (make check): the same steps on the CUDA driver double and PyTorch on the CPU,
              with libjansson made unreachable as on the GPU machine, so no step can fail there on
              a typo (default budget 900 s: no device time is spent).

Steps, in order: machine (nvidia-smi, PyTorch, CUDA), vmm-costs (build-gpu/gpu-vmm-cost: probes the
VMM calls, then times them at 2 MiB and larger handles and cuMemGetInfo against policy/drvcost.c's
table, asks whether cuMemMap accepts a non-zero offset into a handle, and measures the device
memory the driver keeps per handle: 10 GiB as 2 MiB against 20 and 64 MiB handles), glue
(the carried glue is for this checkout's PyTorch; for another version `memshim build-glue`
rebuilds it there, with the machine's g++ and CUDA headers), doctor (`python3 -m memshim doctor
--json`), demo (the C training-loop workload on the real driver under LD_PRELOAD, reports without
libjansson), torch (tests/gpu/test_torch.py with what is left of the budget: native, expandable
segments and tensor mode side by side, OOM, CUDA graphs sharing a pool, torch.compile, the largest
batch under 24 GiB), spill, gpt (tests/gpu/bench_workloads.py gpt: a GPT trained by a plain loop
natively, in tensor mode and in segment mode, interleaved, with memshim's own account and a CPU
profile: where memshim's time per step goes; issue 24), bench (bench_workloads.py bench: training
shapes under native, expandable segments, cudaMallocAsync and memshim: throughput and the largest
batch under one cap, within --bench-budget, run alone; gpu-bench.json and gpu-bench.md; issue 26), report
(memshim-report over every report written). --steps NAME,NAME runs those steps only (the others
are recorded as skipped; `machine` gives the facts the others need, so keep it first). A step whose inputs
failed is skipped with the reason (no VMM: the memshim steps; no PyTorch: torch). Ends with
"N passed, N failed, N skipped" (one per step).
"""
import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = "build-gpu"
B = os.path.join(ROOT, BUILD)
BUDGET_S = 470
# The dry run spends no device time: it gets what a loaded 2-core machine needs for every step
# (the gpt and bench steps start a dozen PyTorch processes there).
DRY_BUDGET_S = 900
KEEP = ("libmemshim.so", "libmemshim_torch.so", "memshim-replay", "memshim-options", "memshim-train-demo",
        "gpu-vmm-cost", "hide_jansson.so", "double", "torch-flags.mk", "jansson.mode",
        "prepared.json")


def say(msg):
    print(f"gpu-checks: {msg}", flush=True)


def sh(argv, timeout, env=None, cwd=ROOT, out_path=None):
    """Run argv in its own process group; kill the group at the timeout. (rc, stdout, stderr, s, timed_out)."""
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(1, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        timed_out = True
    if out_path:
        with open(out_path, "w") as f:
            f.write(out + ("\n--- stderr ---\n" + err if err else ""))
    return (124 if timed_out else p.returncode), out, err, round(time.time() - t0, 1), timed_out


# ---- --prepare ----------------------------------------------------------------------------------

def prepare():
    jobs = os.environ.get("JOBS", "2")
    targets = [f"{BUILD}/{t}" for t in ("libmemshim.so", "memshim-replay", "memshim-options", "memshim-train-demo",
                                        "gpu-vmm-cost")] + [f"BUILD={BUILD}", "JANSSON=static", "double"]
    rc = subprocess.run(["make", f"-j{jobs}", *targets], cwd=ROOT).returncode
    if rc != 0:
        say("make failed")
        return 1
    try:  # the glue, where this machine has PyTorch (the run rebuilds it for another version)
        subprocess.run(["make", f"-j{jobs}", f"BUILD={BUILD}", "JANSSON=static", f"{BUILD}/libmemshim_torch.so"],
                       cwd=ROOT, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        say(f"no glue built here ({(e.stderr or '').strip().splitlines()[-1:] or ['no PyTorch']}); the run builds it")
    cc = os.environ.get("CC", "cc")
    if subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", os.path.join(B, "hide_jansson.so"),
                       os.path.join(ROOT, "tests", "package", "hide_jansson.c")]).returncode != 0:
        return 1
    for n in os.listdir(B):
        if n not in KEEP:
            p = os.path.join(B, n)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    nd = subprocess.run(["readelf", "-d", os.path.join(B, "libmemshim.so")], capture_output=True, text=True).stdout
    needed = [ln.split("[")[1].rstrip("]") for ln in nd.splitlines() if "(NEEDED)" in ln]
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(B) for f in fs
               if not os.path.islink(os.path.join(r, f)))
    info = {"prepared_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "needed": needed, "bytes": size,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip()}
    with open(os.path.join(B, "prepared.json"), "w") as f:
        json.dump(info, f, indent=1)
    say(f"{BUILD}/ ready: {size / 2**20:.1f} MiB, libmemshim.so NEEDs {', '.join(needed)}; carry it: "
        f"run(command='bash tests/gpu/run_gpu_checks.sh', carry=['{BUILD}'])")
    return 0


# ---- the run -------------------------------------------------------------------------------------

STEPS = ("machine", "vmm-costs", "glue", "doctor", "demo", "torch", "spill", "oom", "gpt", "bench", "report")
# The bench runs alone, with its own budget (issue 31: it shared the check's and skipped rows): the
# default steps leave it out; `--steps machine,glue,bench` runs it. The dry run runs every step.
DEFAULT_STEPS = tuple(x for x in STEPS if x != "bench")
BENCH_COMPANIONS = {"machine", "glue", "bench"}
BENCH_BUDGET_S, BENCH_BUDGET_MAX_S = 420, 540
# the step whose result a fact is: a fact of a step not selected (--steps) is not checked
PROVIDES = {"torch": "machine", "gpu": "machine", "vmm": "vmm-costs", "glue": "glue"}


class Run:
    def __init__(self, out, dry, budget, selected=STEPS, bench_budget=BENCH_BUDGET_S):
        self.out, self.dry, self.budget, self.t0 = out, dry, budget, time.time()
        self.selected, self.bench_budget = set(selected), bench_budget
        self.steps, self.facts = [], {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "_MEMSHIM_"))
               and k not in ("LD_PRELOAD", "PYTHONPATH")}
        env.update(BUILD=BUILD, OUT=out, MSH_TEST_TIMEOUT="86400")
        if dry:
            env.update(LD_LIBRARY_PATH=os.path.join(B, "double"), CUDBL_CAPACITY="16G",
                       LD_AUDIT=os.path.join(B, "hide_jansson.so"))
        self.env = env

    def left(self):
        return self.budget - (time.time() - self.t0)

    def step(self, name, fn, timeout, needs=(), own_budget=False):
        """Run one step within `timeout`, cut to what the check's budget leaves, unless the step has
        a budget of its own (the bench: `timeout` is that budget, whatever the others took)."""
        missing = [n for n in needs if not self.facts.get(n) and PROVIDES[n] in self.selected]
        rec = {"name": name, "ok": None, "seconds": 0.0, "timed_out": False}
        if name not in self.selected:
            rec["skipped"] = "not selected (--steps)"
        elif missing:
            rec["skipped"] = f"needs {', '.join(missing)}"
        elif self.left() < 15 and not own_budget:
            rec["skipped"] = f"the budget ({self.budget:.0f} s) is spent"
        if "skipped" in rec:
            say(f"{name}: skipped ({rec['skipped']})")
            self.steps.append(rec)
            return
        limit = timeout if own_budget else max(10, min(timeout, self.left() - 10))
        say(f"{name} (up to {limit:.0f} s)")
        t0 = time.time()
        try:
            ok, detail = fn(limit)
        except Exception as e:  # noqa: BLE001 - a broken step is a failed step, the others still run
            ok, detail = False, {"error": f"{type(e).__name__}: {e}"}
        rec.update(ok=bool(ok), seconds=round(time.time() - t0, 1), **(detail or {}))
        say(f"{name}: {'ok' if ok else 'FAILED'} in {rec['seconds']} s")
        self.steps.append(rec)

    def py(self, *argv):
        return [sys.executable, *argv]

    def memshim_cmd(self, *args):
        return self.py("-m", "memshim", *args)

    def memshim_env(self):
        e = dict(self.env, PYTHONPATH=os.path.join(ROOT, "hooks", "python"))
        return e

    # -- steps --
    def machine(self, limit):
        d = {}
        if shutil.which("nvidia-smi"):
            rc, out, err, s, to = sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                      "--format=csv,noheader"], min(limit, 30), self.env)
            d["nvidia_smi"] = out.strip() or err.strip()[-300:]
        else:
            d["nvidia_smi"] = None
        rc, out, err, s, to = sh(self.py("-c", "import json, torch; print(json.dumps({'torch': torch.__version__, "
                                         "'cuda': torch.version.cuda, 'gpu': torch.cuda.is_available(), "
                                         "'devices': torch.cuda.device_count() if torch.cuda.is_available() else 0}))"),
                                 limit, self.env)
        try:
            d.update(json.loads(out.strip().splitlines()[-1]))
            self.facts["torch"] = True
        except (ValueError, IndexError):
            d["torch_error"] = (err or out).strip()[-400:]
        d["python"] = sys.version.split()[0]
        try:
            d["prepared"] = json.load(open(os.path.join(B, "prepared.json")))
        except (OSError, ValueError):
            pass
        self.facts["gpu"] = bool(d.get("gpu"))
        return (self.dry or self.facts["gpu"]), d

    def vmm_costs(self, limit):
        # the dry run takes 1 GiB for the per-handle overhead so that the double runs that code too
        args = ["--sizes-mib", "2,20,64", "--iters", "5", "--budget-s", "10", "--overhead-gib", "1"] if self.dry else \
            ["--sizes-mib", "2,20,64,512,2048", "--iters", "30", "--budget-s", str(max(10, limit - 15))]
        path = os.path.join(self.out, "vmm-costs.json")
        rc, out, err, s, to = sh([os.path.join(B, "gpu-vmm-cost"), *args], limit, self.env)
        try:
            d = json.loads(out)
        except ValueError:
            return False, {"rc": rc, "stderr": err[-400:], "stdout": out[-400:]}
        with open(path, "w") as f:
            json.dump(d, f, indent=1)
        self.facts["vmm"] = bool(d.get("vmm_ok"))
        summary = {}
        for sz in d.get("sizes", []):
            summary[f"{sz['handle_mib']:g} MiB"] = {k: {"p50_us": v["p50_us"], "table_us": v["table_us"],
                                                        "p50_over_table": v["p50_over_table"]}
                                                    for k, v in sz["calls"].items()}
        # what the driver keeps per handle: 2 MiB against 20 MiB handles of the same bytes (issue 24)
        ho = d.get("handle_overhead") or {}
        over = {f"{x['handle_mib']:g} MiB x {x['handles']}": {k: x.get(k) for k in
                                                              ("failed", "beyond_bytes", "beyond_per_handle_bytes")}
                for x in ho.get("sets", [])} or ho
        # issue 31: cuMemGetInfo's cost (the table's mem_info row) and whether a non-zero offset maps
        mi = d.get("mem_info") or {}
        mo = d.get("map_offset") or {}
        return d.get("vmm_ok") and rc == 0 and "p50_us" in mi and "accepted" in mo, {
            "file": path, "vmm_ok": d.get("vmm_ok"), "failed": d.get("failed"),
            "granularity_bytes": d.get("granularity_bytes"), "by_size": summary, "handle_overhead": over,
            "mem_info": {k: mi.get(k) for k in ("n", "p50_us", "table_us", "p50_over_table")},
            "map_offset": {k: mo.get(k) for k in ("failed", "result", "accepted", "offset_honoured")}}

    def doctor_json(self, limit):
        rc, out, err, s, to = sh(self.memshim_cmd("doctor", "--json"), limit, self.memshim_env())
        try:
            return rc, json.loads(out), err
        except ValueError:
            return rc, None, (err or out)[-600:]

    def glue(self, limit):
        rc, d, err = self.doctor_json(min(limit, 90))
        t = (d or {}).get("torch") or {}
        if t.get("glue_error") is None and t.get("version"):
            self.facts["glue"] = True
            return True, {"glue_built_for": t.get("glue_built_for"), "torch": t.get("version"), "rebuilt": False}
        rc, out, err, s, to = sh(self.memshim_cmd("build-glue"), max(10, limit - 5), self.memshim_env(),
                                 out_path=os.path.join(self.out, "build-glue.txt"))
        rc2, d2, _ = self.doctor_json(60)
        t2 = (d2 or {}).get("torch") or {}
        self.facts["glue"] = rc == 0 and t2.get("glue_error") is None
        return self.facts["glue"], {"before": t.get("glue_error"), "rebuilt": rc == 0, "build_rc": rc,
                                    "timed_out": to, "glue_built_for": t2.get("glue_built_for"),
                                    "torch": t2.get("version"), "build_output": err[-1500:] if rc else None}

    def doctor(self, limit):
        rc, d, err = self.doctor_json(limit)
        path = os.path.join(self.out, "doctor.json")
        if d is not None:
            with open(path, "w") as f:
                json.dump(d, f, indent=1)
        v = (d or {}).get("verdict") or {}
        return rc == 0 and v.get("tensor_mode"), {"file": path, "rc": rc, "verdict": v, "error": None if d else err}

    def demo(self, limit):
        rdir = os.path.join(self.out, "memreport-demo")
        shutil.rmtree(rdir, ignore_errors=True)
        # The demo links the runtime double (build-gpu/double, its RUNPATH), which dlopens
        # libcuda.so.1 as the real libcudart does: the machine's driver, or in a dry run the
        # driver double that LD_LIBRARY_PATH names.
        env = dict(self.env, LD_PRELOAD=os.path.join(B, "libmemshim.so"), MEMSHIM_REPORT_DIR=rdir, MEMSHIM_LOG="info")
        args = ["--epochs", "3", "--steps", "3"] if self.dry else ["--epochs", "3", "--steps", "20", "--scale", "4"]
        rc, out, err, s, to = sh([os.path.join(B, "memshim-train-demo"), *args], limit, env,
                                 out_path=os.path.join(self.out, "demo.txt"))
        reps = sorted(glob.glob(os.path.join(rdir, "memshim-*.json")))
        ok = rc == 0 and any("-epoch" in r for r in reps) and any(r.endswith("-summary.json") for r in reps)
        return ok, {"rc": rc, "timed_out": to, "reports": len(reps), "dir": rdir,
                    "jansson_warning": "libjansson" in err, "stderr_tail": err[-600:] if not ok else None}

    def torch(self, limit):
        path = os.path.join(self.out, "gpu-torch.json")
        argv = self.py(os.path.join(ROOT, "tests", "gpu", "test_torch.py"), "--json", path,
                       "--budget", str(max(20, limit - 25)))
        if self.dry:
            argv.append("--dry-run")
        rc, out, err, s, to = sh(argv, limit, self.env, out_path=os.path.join(self.out, "torch.txt"))
        line = [ln for ln in out.splitlines() if " passed, " in ln][-1:]
        return rc == 0, {"rc": rc, "timed_out": to, "file": path, "counts": line[0] if line else None,
                         "failures": [ln for ln in out.splitlines() if ln.startswith("FAIL")][:10]}

    def spill(self, limit):
        """MEMSHIM_SPILL=host (issue 20). On the GPU: a real training step unlimited, then at a limit of
        0.9x its peak with spill (same losses, step time measured against the unlimited run), then
        the same limit with spill off (torch.OutOfMemoryError). Dry run: the replay below a trace's
        peak on the simulated device (the pool's part)."""
        if self.dry:
            trace = os.path.join(self.out, "spill-offload.txt")
            sh(self.py(os.path.join(ROOT, "scripts", "gen_offload_trace.py"), "-o", trace, "--seed", "1"), 60, self.env)
            rc, out, err, s, to = sh([os.path.join(B, "memshim-replay"), "--json", trace], 60, self.env)
            try:
                peak = json.loads(out.splitlines()[0])["peak_live_bytes"]
            except (ValueError, IndexError, KeyError):
                return False, {"rc": rc, "stderr": err[-400:]}
            cap = int(peak * 0.95) // (2 << 20) * (2 << 20)
            rc, out, err, s, to = sh([os.path.join(B, "memshim-replay"), "--json", "--spill", "host", "--capacity",
                                      str(cap), trace], max(10, limit - 60), self.env)
            try:
                d = json.loads(out.splitlines()[0])
            except (ValueError, IndexError):
                return False, {"rc": rc, "stderr": err[-400:]}
            return d["ooms"] == 0 and d["spilled_peak_bytes"] > 0, {
                "replay": {k: v for k, v in d.items() if "spill" in k or k == "ooms"}}
        script = os.path.join(ROOT, "tests", "gpu", "spill_step.py")
        runs = {}
        for name, extra in (("unlimited", {}), ("spill", None), ("off", None)):
            env = dict(self.memshim_env(), MEMSHIM_LOG="info")
            if extra is None:
                peak = (runs.get("unlimited") or {}).get("peak_allocated")
                if not peak:
                    break
                env.update(MEMSHIM_LIMIT=str(int(peak * 0.9)), MEMSHIM_SPILL="host" if name == "spill" else "off")
            path = os.path.join(self.out, f"spill-{name}.json")
            rc, out, err, s, to = sh(self.memshim_cmd("run", "--", sys.executable, script, path),
                                     max(10, min(120, self.left() - 20)), env,
                                     out_path=os.path.join(self.out, f"spill-{name}.txt"))
            try:
                runs[name] = json.load(open(path))
            except (OSError, ValueError):
                runs[name] = {"ok": False, "rc": rc, "timed_out": to, "stderr": err[-600:]}
        u, sp, off = runs.get("unlimited", {}), runs.get("spill", {}), runs.get("off", {})
        same = bool(u.get("ok") and sp.get("ok")) and all(
            abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(u["losses"], sp["losses"]))
        med = lambda v: sorted(v)[len(v) // 2] if v else None  # noqa: E731
        d = {"unlimited_step_s": med(u.get("step_s", [])[1:]), "spill_step_s": med(sp.get("step_s", [])[1:]),
             "peak_allocated": u.get("peak_allocated"), "losses_match": same, "off_ooms": bool(off.get("oom")),
             "spill_stats": sp.get("memshim_stats"), "runs": {k: {x: v.get(x) for x in ("ok", "oom", "rc")}
                                                             for k, v in runs.items()}}
        if d["unlimited_step_s"] and d["spill_step_s"]:
            d["slowdown"] = d["spill_step_s"] / d["unlimited_step_s"]
        return same and d["off_ooms"], d

    def oom(self, limit):
        """Issue 25: torch.empty of 2x the device and of free + 4 GiB, a hand-written batch-size finder
        and accelerate's, natively and in tensor mode, nvidia-smi sampling the card meanwhile
        (tests/gpu/oom_check.py; dry run: memshim on the double)."""
        path = os.path.join(self.out, "oom-check.json")
        argv = self.py(os.path.join(ROOT, "tests", "gpu", "oom_check.py"), "--json", path,
                       "--budget", str(max(20, limit - 5))) + (["--dry-run"] if self.dry else [])
        rc, out, err, s, to = sh(argv, limit, self.env, out_path=os.path.join(self.out, "oom.txt"))
        return rc == 0, {"rc": rc, "timed_out": to, "file": path,
                         "checks": [ln for ln in out.splitlines() if ln.startswith(("ok ", "FAIL", "skip"))][:12]}

    def workloads(self, what, limit):
        """tests/gpu/bench_workloads.py `what` (gpt, bench) with the step's time less a margin as
        its budget; its own verdict (rc) and its JSON's rows."""
        path = os.path.join(self.out, f"gpu-{what}.json")
        argv = self.py(os.path.join(ROOT, "tests", "gpu", "bench_workloads.py"), what, "--out", self.out,
                       "--budget", str(round(max(20, limit - 15))))
        if self.dry:
            argv.append("--dry-run")
        rc, out, err, s, to = sh(argv, limit, self.env, out_path=os.path.join(self.out, f"{what}.txt"))
        try:
            d = json.load(open(path))
        except (OSError, ValueError):
            return False, {"rc": rc, "timed_out": to, "stderr": err[-800:], "stdout": out[-800:]}
        fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
        return rc == 0, {"rc": rc, "timed_out": to, "file": path, "failures": fails[:10], "data": d}

    def gpt(self, limit):
        """Issue 24 item 5: the GPT loop natively, in tensor mode and in segment mode, interleaved,
        memshim's report of each timed window, and a CPU profile natively and in tensor mode."""
        ok, d = self.workloads("gpt", limit)
        data = d.pop("data", None) or {}
        d["ms_per_step"] = {r["allocator"]: r.get("ms_per_step") for r in data.get("rows", [])}
        d["split"] = data.get("split")
        return ok, d

    def bench(self, limit):
        """Issue 26: every workload under every allocator, throughput and frontier, within its budget."""
        ok, d = self.workloads("bench", limit)
        data = d.pop("data", None) or {}
        d["rows"] = [[r["workload"], r["allocator"], r.get("tokens_per_s"),
                      [(r.get("frontier") or {}).get("largest"), (r.get("frontier") or {}).get("first_failure")],
                      r.get("skipped") or r.get("error")] for r in data.get("rows", [])]
        return ok, d

    def report(self, limit):
        dirs = sorted(d for d in glob.glob(os.path.join(self.out, "memreport-*")) if os.path.isdir(d))
        if not dirs:
            return False, {"error": "no report directory under OUT"}
        rc, out, err, s, to = sh(self.memshim_cmd("report", *dirs), limit, self.memshim_env(),
                                 out_path=os.path.join(self.out, "report.txt"))
        rc2, out2, _, _, _ = sh(self.memshim_cmd("report", "--json", *dirs), limit, self.memshim_env())
        try:
            runs = len(json.loads(out2)["runs"])
        except (ValueError, KeyError):
            runs = None
        return rc == 0 and rc2 == 0, {"rc": rc, "runs": runs, "dirs": dirs, "file": os.path.join(self.out, "report.txt")}

    def bench_limit(self):
        """The bench's own budget (the dry run measures nothing: it gets the time a loaded CPU
        machine needs for every row, fresh frontier workers included)."""
        return max(self.bench_budget, 400) if self.dry else self.bench_budget

    def bench_step(self):
        # on the GPU the bench runs alone, on its own budget; the dry run shares the check's (one
        # command in make check)
        self.step("bench", self.bench, self.bench_limit(), needs=("torch", "vmm", "glue"), own_budget=not self.dry)

    def run(self):
        os.makedirs(self.out, exist_ok=True)
        self.step("machine", self.machine, 60)
        self.step("vmm-costs", self.vmm_costs, 90, needs=("gpu",) if not self.dry else ())
        self.step("glue", self.glue, 150, needs=("torch",))
        self.step("doctor", self.doctor, 60)
        self.step("demo", self.demo, 90, needs=("vmm",))
        self.step("torch", self.torch, 330, needs=("torch", "vmm"))
        self.step("spill", self.spill, 150, needs=("torch", "vmm", "gpu") if not self.dry else ())
        self.step("oom", self.oom, 60, needs=("torch", "vmm"))
        self.step("gpt", self.gpt, 240 if self.dry else 90, needs=("torch", "vmm", "glue"))
        self.bench_step()
        self.step("report", self.report, 60)
        total = round(time.time() - self.t0, 1)
        summary = {"dry_run": self.dry, "budget_s": self.budget, "total_s": total, "steps": self.steps,
                   "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
        with open(os.path.join(self.out, "gpu-checks.json"), "w") as f:
            json.dump(summary, f, indent=1)
        p = sum(1 for s in self.steps if s["ok"])
        fl = sum(1 for s in self.steps if s["ok"] is False)
        sk = sum(1 for s in self.steps if s["ok"] is None)
        for s in self.steps:
            state = "skip" if s["ok"] is None else "ok  " if s["ok"] else "FAIL"
            print(f"{state} {s['name']:<10} {s['seconds']:>6.1f} s  {s.get('skipped') or ''}")
        say(f"{total} s of {self.budget:.0f}; results in {self.out}/gpu-checks.json")
        print(f"{p} passed, {fl} failed, {sk} skipped")
        return 0 if fl == 0 else 1


def main():
    ap = argparse.ArgumentParser(prog="run_gpu_checks.sh")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prepare", action="store_true")
    g.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for every step together (default {BUDGET_S}; the dry run: {DRY_BUDGET_S})")
    ap.add_argument("--steps", default=None,
                    help=f"the steps to run, comma-separated (default: {','.join(DEFAULT_STEPS)}; the dry run: all "
                         f"of {','.join(STEPS)}); the others are recorded as skipped. The bench runs alone: "
                         "--steps machine,glue,bench")
    ap.add_argument("--bench-budget", type=float, default=BENCH_BUDGET_S,
                    help=f"seconds for the bench step, its own (default {BENCH_BUDGET_S}, at most {BENCH_BUDGET_MAX_S})")
    ap.add_argument("--pack", action="store_true",
                    help="at the end, move every result file but gpu-checks.json into OUT/gpu-results.tgz "
                         "(a lent machine returns at most 8 files)")
    a = ap.parse_args()
    steps = a.steps if a.steps is not None else ",".join(STEPS if a.dry_run else DEFAULT_STEPS)
    sel = [x.strip() for x in steps.split(",") if x.strip()]
    if not sel or set(sel) - set(STEPS):
        say(f"--steps {steps}: name steps among {', '.join(STEPS)}")
        return 2
    if "bench" in sel and not a.dry_run and (set(sel) - BENCH_COMPANIONS or not 60 <= a.bench_budget <= BENCH_BUDGET_MAX_S):
        say(f"--steps {steps} --bench-budget {a.bench_budget:g}: the bench runs alone, with its own budget of 60 to "
            f"{BENCH_BUDGET_MAX_S} s (--steps machine,glue,bench): run the other steps in another command")
        return 2
    if a.prepare:
        return prepare()
    if not os.path.isfile(os.path.join(B, "libmemshim.so")):
        say(f"{BUILD}/libmemshim.so is missing: run `bash tests/gpu/run_gpu_checks.sh --prepare` where the code "
            f"was built, and carry {BUILD}/ with the run")
        return 2
    if a.budget is None:
        a.budget = DRY_BUDGET_S if a.dry_run else BUDGET_S
    if a.budget <= 60 or (a.budget > 570 and not a.dry_run):
        say(f"--budget {a.budget}: give 60 to 570 seconds (a device command has 600)")
        return 2
    out = os.environ.get("OUT") or os.path.join(ROOT, "gpu-out" if not a.dry_run else os.path.join(BUILD, "dry-out"))
    rc = Run(os.path.abspath(out), a.dry_run, a.budget, sel, a.bench_budget).run()
    if a.pack:
        pack(os.path.abspath(out))
    return rc


def pack(out):
    """Every file under `out` but gpu-checks.json into out/gpu-results.tgz, then removed: a lent
    machine returns at most 8 files (2026-12-06: 8 of 20 came back). Nothing is removed unless the
    archive was written whole."""
    import tarfile
    keep = {"gpu-checks.json", "gpu-results.tgz"}
    names = []
    for d, dirs, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), out)
            if rel not in keep:
                names.append(rel)
    if not names:
        return
    tmp = os.path.join(out, "gpu-results.tgz.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as t:
            for rel in sorted(names):
                t.add(os.path.join(out, rel), arcname=rel)
        os.replace(tmp, os.path.join(out, "gpu-results.tgz"))
    except OSError as e:
        say(f"--pack: could not write {out}/gpu-results.tgz ({e}); the files stay as they are")
        return
    for rel in names:
        os.remove(os.path.join(out, rel))
    for d, dirs, files in sorted(os.walk(out), key=lambda x: -len(x[0])):
        if d != out and not os.listdir(d):
            os.rmdir(d)
    say(f"--pack: {len(names)} files in {out}/gpu-results.tgz (tar xzf it where they come back)")


if __name__ == "__main__":
    sys.exit(main())
