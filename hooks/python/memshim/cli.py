"""The `memshim` command (docs/install.md): run a job under memshim, say where the library is,
check what a job on this machine would get, and the report and replay tools.

    memshim run [--limit 40G] [--report-dir DIR] [--mode M] [--snapshot FILE] ... [--] CMD ARGS
    memshim lib
    memshim doctor [--json]
    memshim report ARGS      (memshim-report: docs/reports.md)
    memshim replay ARGS      (memshim-replay: docs/replay.md)
    memshim build-glue       (rebuild the PyTorch glue for the PyTorch installed now)

`python -m memshim` is the same command. It never loads libmemshim.so into a job itself: `run`
sets LD_PRELOAD and execs, so every process the command starts (torchrun's and srun's ranks,
subprocesses) inherits the library through the environment. A bad flag value is a usage error
(exit 2) before anything starts; the job's own environment is the library's to judge.
"""
import ctypes
import json
import os
import re
import subprocess
import sys

PROG = "memshim"
EXIT_USAGE = 2
HERE = os.path.dirname(os.path.abspath(__file__))
PATH_OPTIONS = ("MEMSHIM_REPORT_DIR", "MEMSHIM_SNAPSHOT", "MEMSHIM_LOG_FILE", "MEMSHIM_TRACE_FILE")
# Used when memshim-options cannot be run (a broken install): the options `run` always offers.
FALLBACK_OPTIONS = ("MEMSHIM_MODE", "MEMSHIM_LIMIT", "MEMSHIM_REPORT_DIR", "MEMSHIM_SNAPSHOT", "MEMSHIM_LOG",
                    "MEMSHIM_LOG_FILE", "MEMSHIM_EPOCH", "MEMSHIM_CONF")


def note(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


# ---- where things are ---------------------------------------------------------------------------

def layout():
    """Paths of memshim's parts for this copy of the package: the pip package (memshim/_lib), the
    `make install` layout (lib/memshim-python/memshim beside lib/libmemshim.so) or the source tree
    (hooks/python/memshim, build/)."""
    pip = os.path.join(HERE, "_lib")
    if os.path.isfile(os.path.join(pip, "libmemshim.so")):
        return {"kind": "pip", "lib": os.path.join(pip, "libmemshim.so"), "dir": pip,
                "glue": os.path.join(pip, "libmemshim_torch.so"), "replay": os.path.join(pip, "memshim-replay"),
                "options": os.path.join(pip, "memshim-options"), "glue_src": os.path.join(pip, "torch_glue.cpp"),
                "startup": os.path.join(HERE, "_startup"), "build_info": os.path.join(pip, "build-info.json")}
    inst = os.path.realpath(os.path.join(HERE, "..", ".."))
    if os.path.isfile(os.path.join(inst, "libmemshim.so")):
        bin_dir = os.path.join(inst, "..", "bin")
        return {"kind": "make install", "lib": os.path.join(inst, "libmemshim.so"), "dir": inst,
                "glue": os.path.join(inst, "libmemshim_torch.so"),
                "replay": os.path.realpath(os.path.join(bin_dir, "memshim-replay")),
                "options": os.path.realpath(os.path.join(bin_dir, "memshim-options")), "glue_src": None,
                "startup": os.path.join(inst, "memshim-python"), "build_info": None}
    root = os.path.realpath(os.path.join(HERE, "..", "..", ".."))
    build = os.path.join(root, os.environ.get("BUILD", "build"))
    return {"kind": "source tree", "lib": os.path.join(build, "libmemshim.so"), "dir": build,
            "glue": os.path.join(build, "libmemshim_torch.so"), "replay": os.path.join(build, "memshim-replay"),
            "options": os.path.join(build, "memshim-options"), "glue_src": os.path.join(root, "shim", "torch_glue.cpp"),
            "startup": os.path.join(root, "hooks", "python"), "build_info": None}


def need_lib(where):
    if not os.path.isfile(where["lib"]):
        note(f"libmemshim.so is missing ({where['lib']}; {where['kind']} layout): "
             + ("run make" if where["kind"] == "source tree" else "reinstall memshim"))
        return False
    return True


# ---- the option table, through memshim-options --------------------------------------------------

def option_table(where):
    """[(name, default)] of every MEMSHIM_* option, read from memshim-options (the option table
    of policy/base/options.c), so `run` offers a flag for each and stays in step with the library."""
    try:
        p = subprocess.run([where["options"], "--check"], capture_output=True, text=True, timeout=30,
                           env={k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")})
        rows = [ln.split("\t")[0].split("=", 1) for ln in p.stdout.splitlines() if ln.startswith("MEMSHIM_")]
        if rows:
            return [(n, v) for n, v in rows]
    except (OSError, subprocess.SubprocessError):
        pass
    return [(n, "") for n in FALLBACK_OPTIONS]


def check_settings(where, settings):
    """Warnings memshim-options gives for exactly these settings (the library's own parser), or []."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update(settings)
    try:
        p = subprocess.run([where["options"], "--check"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return []
    if p.returncode == 0:
        return []
    return [ln for ln in p.stderr.splitlines() if "warning" in ln or "error" in ln] or p.stderr.splitlines()


def settings_in_force(where, env=None):
    """[(name, value, source)] as libmemshim.so would read this environment."""
    try:
        p = subprocess.run([where["options"], "--check"], capture_output=True, text=True, timeout=30,
                           env=os.environ if env is None else env)
    except (OSError, subprocess.SubprocessError) as e:
        return None, [f"cannot run {where['options']} ({e})"]
    out = []
    for ln in p.stdout.splitlines():
        m = re.match(r"(MEMSHIM_\w+)=(.*)\t# (.*)$", ln)
        if m:
            out.append(m.groups())
    return out, [ln for ln in p.stderr.splitlines() if "warning" in ln or "error" in ln]


# ---- run ----------------------------------------------------------------------------------------

def flag_of(name):
    return "--" + name[len("MEMSHIM_"):].lower().replace("_", "-")


def run_usage(table):
    flags = "\n".join(f"  {flag_of(n) + ' VALUE':<28} {n} (default {d or 'unset'})" for n, d in table)
    return (f"usage: {PROG} run [OPTIONS] [--] CMD [ARGS...]\n\n"
            "Runs CMD with libmemshim.so preloaded (LD_PRELOAD, ahead of what it already holds) and the\n"
            "MEMSHIM_* settings below; every process CMD starts inherits both (torchrun and srun ranks too).\n"
            "Paths (--report-dir, --snapshot, --log-file, --trace-file) are made absolute first.\n"
            "Each option sets the variable of the same name (docs/configuration.md):\n" + flags + "\n")


def preload_value(lib, old):
    """LD_PRELOAD with `lib` first; other libmemshim.so entries dropped (two memshims would each
    interpose the other). Returns (value, dropped)."""
    parts = [p for p in re.split(r"[: ]+", old or "") if p]
    real = os.path.realpath(lib)
    keep, dropped = [], []
    for p in parts:
        if os.path.basename(p) == "libmemshim.so":
            if os.path.realpath(p) != real:
                dropped.append(p)
            continue
        keep.append(p)
    return ":".join([lib] + keep), dropped


def cmd_run(argv, where):
    table = option_table(where)
    names = {flag_of(n): n for n, _ in table}
    settings, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            sys.stdout.write(run_usage(table))
            return 0
        if not a.startswith("-"):
            break
        flag, eq, val = a.partition("=")
        if flag not in names:
            note(f"run: unknown option {flag} (see `{PROG} run --help`)")
            return EXIT_USAGE
        if not eq:
            if i + 1 >= len(argv):
                note(f"run: {flag} needs a value")
                return EXIT_USAGE
            i += 1
            val = argv[i]
        name = names[flag]
        if name in PATH_OPTIONS and val and not val.startswith("/"):
            val = os.path.abspath(val)  # the ranks may start elsewhere; %p and %h stay as they are
        settings[name] = val
        i += 1
    cmd = argv[i:]
    if not cmd:
        note(f"run: no command given (`{PROG} run [OPTIONS] -- CMD ARGS`)")
        return EXIT_USAGE
    if not need_lib(where):
        return 1
    bad = check_settings(where, settings)
    if bad:
        note("run: invalid option value; nothing was started:")
        for ln in bad:
            print("  " + ln, file=sys.stderr)
        return EXIT_USAGE
    env = dict(os.environ)
    env.update(settings)
    env["LD_PRELOAD"], dropped = preload_value(where["lib"], env.get("LD_PRELOAD"))
    for p in dropped:
        note(f"run: LD_PRELOAD named another libmemshim.so ({p}); using {where['lib']} only")
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        note(f"run: {cmd[0]}: command not found")
        return 127
    except OSError as e:
        note(f"run: cannot run {cmd[0]}: {e.strerror or e}")
        return 126


# ---- doctor -------------------------------------------------------------------------------------

CU_DEVICE_ATTRIBUTE_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


def probe_driver():
    """The CUDA driver as memshim would find it (dlopen libcuda.so.1): version, devices, VMM."""
    out = {"loaded": False, "version": None, "devices": [], "error": None}
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        out["error"] = f"libcuda.so.1 cannot be loaded ({e})"
        return out
    out["loaded"] = True
    try:
        rc = cu.cuInit(0)
        if rc != 0:
            out["error"] = f"cuInit failed (CUresult {rc}{': no CUDA-capable device' if rc == 100 else ''})"
            return out
        v = ctypes.c_int(0)
        if cu.cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["version"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
        n = ctypes.c_int(0)
        if cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
            out["error"] = "cuDeviceGetCount failed"
            return out
        tm = getattr(cu, "cuDeviceTotalMem_v2", None) or cu.cuDeviceTotalMem
        tm.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        for i in range(n.value):
            dev, name, total, vmm = ctypes.c_int(0), ctypes.create_string_buffer(256), ctypes.c_size_t(0), ctypes.c_int(0)
            cu.cuDeviceGet(ctypes.byref(dev), i)
            cu.cuDeviceGetName(name, 255, dev)
            tm(ctypes.byref(total), dev)
            ok = cu.cuDeviceGetAttribute(ctypes.byref(vmm), CU_DEVICE_ATTRIBUTE_VMM, dev) == 0
            out["devices"].append({"index": i, "name": name.value.decode(errors="replace"),
                                   "total_bytes": total.value, "vmm": bool(vmm.value) if ok else None})
    except (AttributeError, OSError) as e:
        out["error"] = f"the driver lacks a function memshim needs ({e})"
    return out


def probe_torch(where):
    out = {"version": None, "cuda": None, "error": None, "glue": None, "glue_built_for": None, "glue_error": None}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure: no PyTorch for memshim
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    out["version"], out["cuda"] = torch.__version__, torch.version.cuda
    glue = where["glue"]
    out["glue"] = glue
    if not os.path.isfile(glue):
        out["glue_error"] = "missing"
        return out
    try:
        g = ctypes.CDLL(glue)
        g.memshim_glue_torch_version.restype = ctypes.c_char_p
        out["glue_built_for"] = g.memshim_glue_torch_version().decode()
    except (OSError, AttributeError) as e:
        out["glue_error"] = f"cannot be loaded ({e})"
        return out
    if out["glue_built_for"].split("+")[0] != torch.__version__.split("+")[0]:
        out["glue_error"] = f"built for PyTorch {out['glue_built_for']}, this is {torch.__version__}"
    elif not g.memshim_glue_ready():
        out["glue_error"] = "cannot find libmemshim.so's entry points"
    return out


def report_writer(where):
    try:
        lib = ctypes.CDLL(where["lib"])
        fn = lib.memshim_report_writer
        fn.restype = ctypes.c_char_p
        w = fn()
        return w.decode() if w else None, None
    except (OSError, AttributeError) as e:
        return None, f"cannot ask {where['lib']} ({e})"


def rebuild_hint(where):
    if where["kind"] == "pip":
        return (f"`{PROG} build-glue` (needs g++ and the CUDA headers), or reinstall: pip install --force-reinstall "
                "--no-deps --no-build-isolation <memshim source>")
    return "make (in the source tree, where `python3 -c 'import torch'` works), then make install again"


def doctor(where):
    """What a job started here would get: (facts, verdict, tensor_ok)."""
    d = {"memshim": {"layout": where["kind"], "library": where["lib"], "present": os.path.isfile(where["lib"])}}
    if where["build_info"] and os.path.isfile(where["build_info"]):
        try:
            with open(where["build_info"], encoding="utf-8") as f:
                d["memshim"]["build"] = json.load(f)
        except (OSError, ValueError):
            pass
    d["driver"] = probe_driver()
    d["torch"] = probe_torch(where)
    settings, warnings = settings_in_force(where)
    d["settings"] = [{"name": n, "value": v, "source": s} for n, v, s in (settings or [])]
    d["settings_warnings"] = warnings
    eff = {n: v for n, v, _ in (settings or [])}
    writer, werr = report_writer(where) if d["memshim"]["present"] else (None, "libmemshim.so is missing")
    rdir = eff.get("MEMSHIM_REPORT_DIR") or ""
    rep = {"writer": writer, "error": werr, "dir": rdir or None, "writable": None}
    if rdir:
        probe = os.path.abspath(rdir.replace("%p", str(os.getpid())).replace("%h", os.uname().nodename.split(".")[0]))
        while probe != "/" and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        rep["writable"] = os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)
    d["reports"] = rep
    startup = where["startup"]
    d["python_hook"] = {"dir": startup, "present": os.path.isfile(os.path.join(startup or "", "sitecustomize.py"))}

    mode = eff.get("MEMSHIM_MODE", "auto")
    drv, tor = d["driver"], d["torch"]
    from . import _allocconf  # PyTorch's allocator settings, read in PyTorch 2.15's order (no torch here)
    alloc_conf_var, alloc_conf_value = _allocconf.pick()
    alloc_conf_keys = _allocconf.blocking(_allocconf.pairs(alloc_conf_value)) if alloc_conf_var else []
    why = None
    if not d["memshim"]["present"]:
        why = f"libmemshim.so is missing ({where['lib']})"
    elif mode == "off":
        why = "MEMSHIM_MODE=off: memshim passes every call through"
    elif mode == "segment":
        why = "MEMSHIM_MODE=segment: PyTorch keeps its own allocator, memshim serves its segments"
    elif not drv["loaded"] or drv["error"] or not drv["devices"]:
        why = ("no GPU: " + (drv["error"] or "the driver reports no device") +
               "; memshim would pass through (a job runs untouched)")
    elif not all(dev["vmm"] for dev in drv["devices"]):
        why = "a device without CUDA virtual memory management: memshim passes through"
    elif tor["error"]:
        why = f"PyTorch cannot be imported here ({tor['error']})"
    elif tor["glue_error"]:
        why = f"the PyTorch glue {tor['glue']} is {tor['glue_error']}: segment mode; rebuild it with {rebuild_hint(where)}"
    elif mode == "auto" and alloc_conf_keys:
        why = (f"{alloc_conf_var} configures PyTorch's own allocator ({', '.join(alloc_conf_keys)}): segment mode "
               "(MEMSHIM_MODE=tensor overrides)")
    elif not d["python_hook"]["present"]:
        why = f"memshim's Python start-up hook is missing ({startup})"
    ok = why is None
    d["verdict"] = {"tensor_mode": ok, "why_not": why}
    return d


def gib(b):
    return f"{b / 2**30:.1f} GiB"


def doctor_text(d):
    m, drv, tor, rep = d["memshim"], d["driver"], d["torch"], d["reports"]
    out = []
    b = m.get("build") or {}
    out.append(f"memshim: {m['library']} ({m['layout']}{', built for PyTorch ' + str(b.get('torch')) if b else ''})"
               + ("" if m["present"] else " MISSING"))
    if not drv["loaded"]:
        out.append(f"driver: none: {drv['error']}")
    else:
        out.append(f"driver: CUDA {drv['version'] or 'n/a'}, {len(drv['devices'])} device"
                   f"{'s' if len(drv['devices']) != 1 else ''}" + (f" ({drv['error']})" if drv["error"] else ""))
        for dev in drv["devices"]:
            out.append(f"  device {dev['index']}: {dev['name']}, {gib(dev['total_bytes'])}, virtual memory management "
                       + {True: "supported", False: "NOT supported", None: "unknown"}[dev["vmm"]])
    if tor["error"]:
        out.append(f"PyTorch: not importable ({tor['error']})")
    else:
        g = ("loads, matches" if not tor["glue_error"] else tor["glue_error"])
        out.append(f"PyTorch: {tor['version']} (CUDA {tor['cuda'] or 'none'}); glue {tor['glue']}: {g}")
    if rep["writer"] is None:
        out.append(f"reports: cannot be written: no JSON writer ({rep['error'] or 'libjansson.so.4 not found'})")
    elif not rep["dir"]:
        out.append(f"reports: off (MEMSHIM_REPORT_DIR is not set; `{PROG} run --report-dir DIR`); JSON writer: "
                   f"{rep['writer']}")
    else:
        out.append(f"reports: to {rep['dir']} ({'writable' if rep['writable'] else 'NOT writable'}); JSON writer: "
                   f"{rep['writer']}")
    hook = d["python_hook"]
    out.append(f"Python start-up hook: {hook['dir']}" + ("" if hook["present"] else " MISSING"))
    set_ = [s for s in d["settings"] if s["source"] != "default"]
    out.append("settings: " + (f"{len(d['settings']) - len(set_)} at their defaults" if d["settings"] else "n/a")
               + ("; set:" if set_ else ""))
    for s in set_:
        out.append(f"  {s['name']}={s['value']} (from {s['source']})")
    for w in d["settings_warnings"]:
        out.append(f"  {w}")
    v = d["verdict"]
    out.append("verdict: " + ("a PyTorch job started here would run in tensor mode (memshim places every tensor)"
                              if v["tensor_mode"] else f"no tensor mode: {v['why_not']}"))
    return "\n".join(out) + "\n"


def cmd_doctor(argv, where):
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} doctor [--json]\n\nWhat a job on this machine would get: driver, VMM support, devices, "
              "PyTorch and the glue, report writing, the settings in force and where each came from.\n"
              "Exit status 0 when tensor mode would work, 1 otherwise.")
        return 0
    bad = [a for a in argv if a != "--json"]
    if bad:
        note(f"doctor: unknown argument {bad[0]} (usage: {PROG} doctor [--json])")
        return EXIT_USAGE
    d = doctor(where)
    if "--json" in argv:
        sys.stdout.write(json.dumps(d, indent=1) + "\n")
    else:
        sys.stdout.write(doctor_text(d))
    return 0 if d["verdict"]["tensor_mode"] else 1


# ---- the other commands -------------------------------------------------------------------------

def cmd_lib(argv, where):
    if argv:
        note(f"lib takes no arguments (`LD_PRELOAD=$({PROG} lib)`)")
        return EXIT_USAGE
    if not need_lib(where):
        return 1
    print(where["lib"])
    return 0


def cmd_report(argv, where):
    from . import report
    return report.run(argv)


def cmd_replay(argv, where):
    exe = where["replay"]
    if not os.path.isfile(exe):
        note(f"memshim-replay is missing ({exe})")
        return 1
    try:
        os.execv(exe, [exe] + argv)
    except OSError as e:
        note(f"cannot run {exe}: {e.strerror or e}")
        return 126


def cmd_build_glue(argv, where):
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} build-glue\n\nRebuild {where['glue']} (PyTorch's side of tensor mode) for the PyTorch "
              "this Python imports; needs g++ and the CUDA headers (CUDA_HOME, a toolkit, or PyTorch's wheels).")
        return 0
    if argv:
        note("build-glue takes no arguments")
        return EXIT_USAGE
    src = where["glue_src"]
    if not src or not os.path.isfile(src):
        note(f"build-glue: the glue's source is not part of this installation ({where['kind']}): "
             + rebuild_hint(where))
        return 1
    if not os.access(where["dir"], os.W_OK):
        note(f"build-glue: {where['dir']} is not writable: {rebuild_hint(where)}")
        return 1
    from . import _build
    ok, msg = _build.build_glue(src, where["dir"], log=lambda m: print(m, file=sys.stderr))
    (print if ok else note)(msg if ok else f"build-glue: {msg}")
    return 0 if ok else 1


COMMANDS = {"run": cmd_run, "lib": cmd_lib, "doctor": cmd_doctor, "report": cmd_report, "replay": cmd_replay,
            "build-glue": cmd_build_glue}
USAGE = f"""usage: {PROG} COMMAND [ARGS]

  run [OPTIONS] [--] CMD ARGS   run CMD with memshim preloaded (`{PROG} run --help` lists the options)
  lib                           print libmemshim.so's absolute path (LD_PRELOAD=$({PROG} lib))
  doctor [--json]               what a job here would get; exit 0 when tensor mode would work
  report ARGS                   summarise report directories (memshim-report --help)
  replay ARGS                   replay PyTorch snapshots through the pool (memshim-replay --help)
  build-glue                    rebuild the PyTorch glue for the PyTorch installed now
  --version                     memshim's version
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        where = layout()
        ver = None
        if where["build_info"] and os.path.isfile(where["build_info"]):
            try:
                with open(where["build_info"], encoding="utf-8") as f:
                    ver = json.load(f).get("memshim")
            except (OSError, ValueError):
                pass
        print(f"memshim {ver or 'n/a'} ({where['kind']}: {where['lib']})")
        return 0
    fn = COMMANDS.get(argv[0])
    if fn is None:
        note(f"unknown command {argv[0]!r}\n{USAGE}")
        return EXIT_USAGE
    try:
        return fn(argv[1:], layout())
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
