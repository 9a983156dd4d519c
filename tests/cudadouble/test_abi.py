#!/usr/bin/env python3
"""The doubles speak the ABI a real driver speaks at each version (issue 25 item 6).

cuGetProcAddress("cuCtxGetDevice", 13000) returns cuCtxGetDevice_v2(CUdevice *, CUcontext) on a real
CUDA 13 driver; the driver double returned the old one-argument function and the runtime double called
it so, which crashed the real driver (DESIGN.md 10). The C side makes a wrong signature a build error
(every row of the double's table, memshim's hooks and resolved symbols are checked against
cudaTypedefs.h's PFN types); this script checks what the compiler cannot, against the newest
cudaTypedefs.h on the machine (the build's CUDA headers, PyTorch's CUDA wheel's):
  - every row of the double's table names a header typedef (PFN_<name>_v<version>[_ptsz|_ptds]);
  - no ABI is missing: for each name the double serves, every version the header has from the
    name's first row up to the double's driver version has a row, per-thread forms included (a
    missing row hands a caller at that version the previous ABI: the crash above);
  - the function of each row, and each symbol memshim resolves or hooks, is the ABI its name says
    (the unversioned symbol is a name's first ABI, _v2 its second, ...);
  - the runtime double asks for each function at the version whose ABI its field is typed with
    (the newest at or below its own 13000), and the driver double serves that ABI there;
  - memshim's entry-point table asks for each hooked name at the version of the ABI the hook was
    checked against (hooks/driver.c);
  - PyTorch's versioned lookups (c10/cuda/driver_api.h) get the header's ABI where the double
    serves the name;
  - the double compiles against the newest headers (their typedefs, not cudbl.h's stand-ins), and
    cudbl.h's stand-ins read as the newest header writes them;
  - docs/test-double.md's table lists exactly the double's rows.
`--table` prints that table.
"""
import ctypes
import glob
import os
import re
import subprocess
import sys
import sysconfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pyharness import BUILD, ROOT, case, finish, skip  # noqa: E402

DOUBLE_SRC = os.path.join(ROOT, "tests", "cudadouble", "cuda_double.c")
CUDART_SRC = os.path.join(ROOT, "tests", "cudadouble", "cudart_double.c")
CUDBL_H = os.path.join(ROOT, "tests", "cudadouble", "cudbl.h")
DOC = os.path.join(ROOT, "docs", "test-double.md")

# PyTorch 2.15's versioned driver lookups (c10/cuda/driver_api.h, C10_LIBCUDA_DRIVER_API_*: the
# version is what it passes to cudaGetDriverEntryPointByVersion). Checked against the installed
# wheel's header when there is one.
TORCH_LOOKUPS = [(n, 12000) for n in (
    "cuDeviceGet", "cuDeviceGetAttribute", "cuMemGetAddressRange", "cuMemAddressReserve", "cuMemRelease",
    "cuMemMap", "cuMemAddressFree", "cuMemSetAccess", "cuMemUnmap", "cuMemCreate",
    "cuMemGetAllocationGranularity", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle", "cuMemGetAllocationPropertiesFromHandle", "cuMemsetD32Async",
    "cuStreamWriteValue32", "cuGetErrorString")] + \
    [(n, 12030) for n in ("cuMulticastAddDevice", "cuMulticastBindMem", "cuMulticastCreate", "cuMulticastUnbind")] + \
    [(n, 12080) for n in ("cuCtxFromGreenCtx", "cuCtxGetCurrent", "cuCtxPopCurrent", "cuCtxPushCurrent",
                          "cuCtxSetCurrent", "cuGreenCtxCreate", "cuGreenCtxDestroy", "cuGreenCtxStreamCreate",
                          "cuDevSmResourceSplitByCount", "cuDeviceGetDevResource", "cuDevResourceGenerateDesc")] + \
    [(n, 12090) for n in ("cuLogsRegisterCallback", "cuLogsUnregisterCallback")]

TYPEDEF = re.compile(r"typedef\s+CUresult\s*\(\s*CUDAAPI\s*\*\s*PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?\s*\)\s*\(([^;]*?)\)\s*;")


def norm(params):
    return " ".join(params.split())


def parse_typedefs(text):
    """{name: {version: {suffix: params}}} ('' is the plain form, '_ptsz'/'_ptds' per-thread)."""
    out = {}
    for m in TYPEDEF.finditer(text):
        out.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3) or ""] = norm(m.group(4))
    return out


def cuda_version(inc):
    try:
        m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", open(os.path.join(inc, "cuda.h")).read())
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def build_cuda_inc():
    """The Makefile's CUDA_INC: CUDA_INC, else CUDA_HOME/include, else /usr/local/cuda[-*]/include."""
    if os.environ.get("CUDA_INC"):
        return os.environ["CUDA_INC"]
    home = os.environ.get("CUDA_HOME") or next(iter(glob.glob("/usr/local/cuda") + sorted(glob.glob("/usr/local/cuda-*"))), "")
    return os.path.join(home, "include")


def header_sets():
    """Every include folder here with cuda.h and cudaTypedefs.h: the build's, PyTorch's wheels'."""
    cands = [build_cuda_inc()]
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "triton/backends/nvidia/include"):
            cands.append(os.path.join(sp, sub))
    seen, out = set(), []
    for c in cands:
        c = os.path.realpath(c)
        if c not in seen and os.path.isfile(os.path.join(c, "cudaTypedefs.h")) and cuda_version(c):
            seen.add(c)
            out.append(c)
    return out


def regular_versions(hdr, name):
    return sorted(v for v, forms in hdr.get(name, {}).items() if "" in forms)


def abi_symbol(hdr, name, version, suffix):
    """The driver's symbol for the ABI of `name` current at `version`: the name for its first ABI,
    name_v2 for the second, ...; a per-thread form adds _ptsz/_ptds to the ABI it wraps."""
    regs = [v for v in regular_versions(hdr, name) if v <= version]
    if not regs:
        return None
    k = len(regs)
    return name + (f"_v{k}" if k > 1 else "") + suffix


def double_rows_from_lib(lib):
    rows, i = [], 0
    name, ver, pt = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int()
    while lib.cudbl_proc_row(i, ctypes.byref(name), ctypes.byref(ver), ctypes.byref(pt)):
        rows.append((name.value.decode(), ver.value, bool(pt.value)))
        i += 1
    return rows


ROW_RE = re.compile(r"^\s*(P|PS|PTSZ_ROW|PTDS_ROW)\((\w+), (\d+), (\w+)\)|^\s*ROW_\(\"(\w+)\", (\d+), PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?, (\w+), (\d)\)", re.M)


def double_rows_from_source(text):
    """[(name, version, symbol, typedef name, typedef version, suffix)] from the table's source."""
    body = text[text.index("static const struct proc_entry proc_table[] = {"):]
    body = body[:body.index("};")]
    out = []
    for m in ROW_RE.finditer(body):
        if m.group(1):
            kind, name, ver, fn = m.group(1), m.group(2), int(m.group(3)), m.group(4)
            if kind == "PS":
                out.append((name, ver, fn, name, ver, ""))
                out.append((name, ver, fn + "_ptsz", name, ver, "_ptsz"))
            else:
                sfx = {"P": "", "PTSZ_ROW": "_ptsz", "PTDS_ROW": "_ptds"}[kind]
                out.append((name, ver, fn, name, ver, sfx))
        else:
            out.append((m.group(5), int(m.group(6)), m.group(10), m.group(7), int(m.group(8)), m.group(9) or ""))
    return out


def runtime_double_funcs(text):
    return [(f, n, int(v)) for f, n, v in re.findall(r"X\((\w+), (cu\w+), (\d+)\)", text)]


def served_at(rows, name, version, per_thread=False):
    """The version of the row the double's lookup picks (None: not found)."""
    best = [v for n, v, pt in rows if n == name and not pt and v <= version]
    best_pt = [v for n, v, pt in rows if n == name and pt and v <= version]
    if per_thread and best_pt:
        return ("pt", max(best_pt))
    return ("", max(best)) if best else None


def doc_rows():
    try:
        text = open(DOC).read()
    except OSError:
        return None
    m = re.search(r"<!-- proc-table -->\n(.*?)<!-- /proc-table -->", text, re.S)
    if not m:
        return None
    out = set()
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].isdigit():
            out.add((cells[0].strip("`"), int(cells[1]), cells[2].split()[0].strip("`")))
    return out


def askers(row, rows, rt_funcs, runtime_version, entry_q, dlsyms, torch_lookups):
    """Who gets this row: the runtime double's lookups (at its version), memshim's entry-point
    lookups (at each hook's version), memshim's dlsym of ABI symbols, PyTorch's versioned lookups."""
    name, ver, sym, *_ = row
    pt = sym.endswith(("_ptsz", "_ptds"))
    me = (("pt" if pt else ""), ver)
    who = []
    if any(n == name for _, n, _ in rt_funcs) and not pt and served_at(rows, name, runtime_version) == me:
        who.append(f"runtime double ({runtime_version})")
    for v in sorted({v for n, v, p in entry_q if n == name and p == pt}):
        if served_at(rows, name, v, pt) == me:
            who.append(f"memshim lookup ({v})")
    if sym in dlsyms:
        who.append("memshim dlsym")
    for v in sorted({v for n, v in torch_lookups if n == name}):
        if not pt and served_at(rows, name, v) == me:
            who.append(f"PyTorch 2.15 ({v})")
    return ", ".join(who)


def memshim_dlsyms():
    out = set(re.findall(r'RESOLVE\(\w+, "(\w+)"', open(os.path.join(ROOT, "policy", "base", "cuda_real.c")).read()))
    for rel in ("hooks/driver.c", "hooks/entry.c", "shim/torch.c"):
        out |= set(re.findall(r'dlsym\(\w+(?:\.handle)?, "(cu\w+)"\)', open(os.path.join(ROOT, rel)).read()))
    return out


def entry_table(text):
    """hooks/entry.c's lookups: [(name, version, per-thread)]."""
    return [(n, int(v), f == "per_thread") for n, v, f in
            re.findall(r'\{"(cu\w+)", (\d+), (legacy|per_thread), \w+\}', text)]


def main():
    lib_path = os.path.join(BUILD, "double", "libcuda.so.1")
    if not os.path.exists(lib_path):
        skip("the doubles' ABI", f"{lib_path} is not built (make double)")
        finish()
    lib = ctypes.CDLL(lib_path)
    drv_ver = ctypes.c_int()
    lib.cuDriverGetVersion(ctypes.byref(drv_ver))
    DRIVER_VERSION = drv_ver.value
    src = open(DOUBLE_SRC).read()
    rows = double_rows_from_lib(lib)
    rows_src = double_rows_from_source(src)
    rt_text = open(CUDART_SRC).read()
    rt_funcs = runtime_double_funcs(rt_text)
    RUNTIME_VERSION = int(re.search(r"#define RUNTIME_VERSION (\d+)", rt_text).group(1))
    entry_q = entry_table(open(os.path.join(ROOT, "hooks", "entry.c")).read())

    sets = header_sets()
    if not sets:
        skip("the doubles' ABI", "no cudaTypedefs.h found (CUDA headers)")
        finish()
    newest = max(sets, key=cuda_version)
    HV = cuda_version(newest)
    hdr = parse_typedefs(open(os.path.join(newest, "cudaTypedefs.h")).read())
    print(f"headers: {newest} (CUDA_VERSION {HV}); the double reports driver version {DRIVER_VERSION}")
    top = min(DRIVER_VERSION, HV)

    if "--table" in sys.argv:
        print("| Name | From version | Function returned | Asked for by |")
        print("|---|---|---|---|")
        dl = memshim_dlsyms()
        for row in rows_src:
            name, ver, sym = row[:3]
            pt = " (per-thread)" if sym.endswith(("_ptsz", "_ptds")) else ""
            print(f"| `{name}` | {ver} | `{sym}`{pt} | "
                  f"{askers(row, rows, rt_funcs, RUNTIME_VERSION, entry_q, dl, TORCH_LOOKUPS)} |")
        return

    # 1. the library's rows are the source's rows (the parse below reads what the double serves)
    case("the double's table as parsed from its source is the table it serves (cudbl_proc_row)",
         sorted((n, v, s.endswith(("_ptsz", "_ptds"))) for n, v, s, *_ in rows_src) == sorted(rows),
         f"{len(rows_src)} parsed, {len(rows)} served")

    # 2. each row names a header typedef of its own name, or an alias the header writes as a macro
    bad = []
    for name, ver, sym, tname, tver, sfx in rows_src:
        if tver > HV:
            continue
        if sfx not in hdr.get(tname, {}).get(tver, {}):
            bad.append(f"{name} @ {ver}: no PFN_{tname}_v{tver}{sfx} in {newest}/cudaTypedefs.h")
        if tname != name and not re.search(rf"#define\s+{name}\s+{tname}\b", open(os.path.join(newest, "cuda.h")).read()):
            bad.append(f"{name} @ {ver} is served as {tname}, but cuda.h does not #define {name} as {tname}")
    case("every row of the double's table is a cudaTypedefs.h ABI (or a cuda.h alias)", not bad, "\n    ".join(bad))

    # 3. completeness: every header version from a name's first row to the driver version has a row
    missing = []
    for name in sorted({r[0] for r in rows}):
        first = min(v for n, v, pt in rows if n == name and not pt)
        have = {(v, pt) for n, v, pt in rows if n == name}
        for v, forms in sorted(hdr.get(name, {}).items()):
            if not first <= v <= top:
                continue
            if "" in forms and (v, False) not in have:
                missing.append(f"{name} @ {v}: {abi_symbol(hdr, name, v, '')} ({forms['']})")
            for sfx in ("_ptsz", "_ptds"):
                if sfx in forms and (v, True) not in have:
                    missing.append(f"{name} @ {v} per-thread: {abi_symbol(hdr, name, v, sfx)}")
    case(f"no ABI missing between a name's first row and {top} (a missing row serves the previous signature)",
         not missing, "\n    ".join(missing))
    if HV < DRIVER_VERSION:
        skip(f"ABIs between CUDA {HV} and the double's {DRIVER_VERSION}",
             f"the newest cudaTypedefs.h here is {HV}'s (PyTorch's CUDA 13 wheel has a newer one)")

    # 4. each row's function is the ABI its symbol says
    bad = []
    for name, ver, sym, tname, tver, sfx in rows_src:
        if tver > HV:
            continue
        want = abi_symbol(hdr, tname, tver, sfx)
        if sym != want:
            bad.append(f"{name} @ {ver}: row function {sym}, the header's ABI there is {want}")
    case("each row's function is the symbol of that version's ABI (cuCtxGetDevice_v2 at 13000)", not bad,
         "\n    ".join(bad))

    # 5. memshim's resolved symbols and hooks: symbol <-> typedef version
    checked, bad = 0, []
    sources = {
        "policy/base/cuda_real.c": r'RESOLVE\(\w+, "(\w+)", PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?\)',
        "hooks/driver.c": r"HOOK_ADDR\((\w+), PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?\)|MSH_ABI_ASSERT\(real_(\w+), PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?,",
        "shim/torch.c": r'MSH_ABI_ASSERT\(\w+, PFN_(\w+?)_v(\d+)(_ptsz|_ptds)?,\s*"(\w+)"\)',
    }
    for rel, pat in sources.items():
        for m in re.finditer(pat, open(os.path.join(ROOT, rel)).read()):
            g = [x for x in m.groups()]
            if rel == "shim/torch.c":
                tname, tver, sfx, sym = g[0], int(g[1]), g[2] or "", g[3]
            else:
                g = g[:4] if g[0] else g[4:]
                sym, tname, tver, sfx = g[0], g[1], int(g[2]), g[3] or ""
            checked += 1
            if tver > HV:
                continue
            want = abi_symbol(hdr, tname, tver, sfx)
            if sfx not in hdr.get(tname, {}).get(tver, {}) or sym != want:
                bad.append(f"{rel}: {sym} checked against PFN_{tname}_v{tver}{sfx}; that ABI's symbol is {want}")
    case(f"memshim's {checked} resolved symbols and hooks are typed as the ABI their names are", checked >= 70 and not bad,
         "\n    ".join(bad) or f"only {checked} found")

    # 6. memshim's entry-point table asks at the version of the ABI each hook was checked against
    drv_c = open(os.path.join(ROOT, "hooks", "driver.c")).read()
    hook_abi = {h: (n, int(v), s or "") for h, n, v, s in re.findall(r"HOOK_ADDR\((\w+), PFN_(\w+?)_v(\d+)(_ptsz)?\)", drv_c)}
    ent = open(os.path.join(ROOT, "hooks", "entry.c")).read()
    bad = []
    alias = dict(re.findall(r"\*?(\w+) = \(void \*\)(\w+)", ent))     # hk_v2 -> hk_cuGetProcAddress_v2
    local_abi = {f: (n, int(v), s or "") for f, n, v, s in
                 re.findall(r"MSH_ABI_ASSERT\(&(\w+), PFN_(\w+?)_v(\d+)(_ptsz)?,", ent)}
    for name, ver, pt, hook in re.findall(r'\{"(cu\w+)", (\d+), (legacy|per_thread), (\w+)\}', ent):
        abi = hook_abi.get(hook[len("msh_hk_"):]) if hook.startswith("msh_hk_") else local_abi.get(alias.get(hook))
        want = (name, int(ver), "_ptsz" if pt == "per_thread" else "")
        if abi != want:
            bad.append(f'{{"{name}", {ver}, {pt}, {hook}}}: the hook is checked against {abi}')
    case(f"hooks/entry.c asks for each of its {len(entry_q)} hooked names at its hook's ABI version",
         len(entry_q) >= 20 and not bad, "\n    ".join(bad))

    # 7. the runtime double: each field's version is the newest ABI at RUNTIME_VERSION, served so
    bad = []
    for field, name, ver in rt_funcs:
        regs = [v for v in regular_versions(hdr, name) if v <= RUNTIME_VERSION]
        if not regs or ver != max(regs):
            bad.append(f"{field}: {name} typed at {ver}, the header's ABI at {RUNTIME_VERSION} is {max(regs) if regs else None}")
        got = served_at(rows, name, RUNTIME_VERSION)
        if got != ("", ver):
            bad.append(f"{field}: the driver double serves {name} at {RUNTIME_VERSION} as {got}, not its {ver} ABI")
    case(f"the runtime double's {len(rt_funcs)} driver functions are typed and served as at {RUNTIME_VERSION}",
         len(rt_funcs) >= 40 and not bad, "\n    ".join(bad))

    # 8. PyTorch's lookups: the list above is the installed wheel's, and each served name gets the
    #    header's ABI at PyTorch's version
    torch_h = None
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        p = os.path.join(sp, "torch", "include", "c10", "cuda", "driver_api.h")
        if os.path.isfile(p):
            torch_h = p
            break
    if torch_h:
        found = [(n, int(v)) for n, v in re.findall(r"_\((cu\w+),\s*(\d+)\)", open(torch_h).read())]
        case("PyTorch's versioned lookups are the ones this check knows (the installed wheel's driver_api.h)",
             sorted(found) == sorted(TORCH_LOOKUPS),
             f"wheel: {sorted(set(found) ^ set(TORCH_LOOKUPS))}")
    else:
        skip("PyTorch's versioned lookups against the installed wheel", "no torch/include/c10/cuda/driver_api.h")
    bad, served = [], 0
    for name, ver in TORCH_LOOKUPS:
        got = served_at(rows, name, ver)
        if got is None:
            continue
        served += 1
        regs = [v for v in regular_versions(hdr, name) if v <= ver]
        if not regs or got[1] != max(regs):
            bad.append(f"{name} @ {ver}: served as the {got[1]} ABI, the header's is {max(regs) if regs else None}")
    case(f"PyTorch's lookups the double serves ({served} of {len(TORCH_LOOKUPS)}) get the header's ABI", served >= 15 and not bad,
         "\n    ".join(bad))

    # 9. the double against the newest headers: their typedefs check every row; cudbl.h's stand-ins
    #    for newer ABIs read as the newest header writes them
    build_inc = os.path.realpath(build_cuda_inc())
    if HV > cuda_version(build_inc):
        errs = []
        for f in (DOUBLE_SRC, CUDART_SRC):
            p = subprocess.run(["cc", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                                "-I", newest, "-idirafter", build_inc, f], capture_output=True, text=True)
            if p.returncode:
                errs.append(f"{os.path.basename(f)}: {p.stderr[-1500:]}")
        case(f"the doubles compile against CUDA {HV}'s headers (every row checked by its own typedef)", not errs,
             "\n    ".join(errs))
    else:
        skip("the doubles against newer headers", f"the build's headers ({build_inc}) are the newest here")
    stand_ins = parse_typedefs(open(CUDBL_H).read())
    stand_ins.update(parse_typedefs(src))
    bad, n = [], 0
    for name, vers in stand_ins.items():
        for v, forms in vers.items():
            for sfx, params in forms.items():
                if v > HV:
                    continue
                n += 1
                theirs = hdr.get(name, {}).get(v, {}).get(sfx)
                if theirs != params:
                    bad.append(f"PFN_{name}_v{v}{sfx}: ({params}), the header: ({theirs})")
    case(f"the double's {n} stand-in typedefs read as cudaTypedefs.h {HV} writes them", n >= 6 and not bad,
         "\n    ".join(bad))

    # 10. the documented table is the double's
    doc = doc_rows()
    mine = {(n, v, s) for n, v, s, *_ in rows_src}
    case("docs/test-double.md's lookup table lists exactly the double's rows (tests/cudadouble/test_abi.py --table)",
         doc == mine, "missing from the doc: %s; not in the double: %s" %
         (sorted(mine - (doc or set()))[:8], sorted((doc or set()) - mine)[:8]))
    finish()


if __name__ == "__main__":
    main()
