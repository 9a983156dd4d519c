#!/usr/bin/env python3
"""make mutants, part 2: mutants a machine makes (issue 18, docs/testing.md).

The hand-written list (tests/mutants/mutants.txt, run_mutants.py) models the realistic bugs we
thought of. This run measures what we did not think of: universalmutator (`mutate`, regexp rules
for C, C++ and Python) generates every mutant of every product file, a seeded sample of them is
taken per file, and each sampled mutant is built and run against the suites that exercise that
file until one fails.

Per file:
  1. universalmutator's generator (the rules `mutate FILE LANG` applies) lists every mutant.
  2. They are put in a stable order: a hash of (seed, file, the changed text, which occurrence of
     that text), so the sample does not move when unrelated lines are added above it.
  3. Walking that order, a candidate is dropped when it does not compile (C, C++: the file's own
     compile command from the Makefile; Python: compile()), and is EQUIVALENT by construction when
     it compiles to the same thing as the original (trivial compiler equivalence: the same object
     bytes at -O2 -g0 for C and C++, the same AST for Python: a change in a comment, in
     whitespace, or one the optimizer removes). Candidates are drawn until the file has its
     quota of mutants that compile to something else.
  4. Each of those is applied to a scratch copy of the tree (run_mutants.py's machinery: a
     temporary directory beside a link to ../shared, private memory capped), the targets its
     suites need are rebuilt, and its suites (SUITES_FOR below, the ones that exercise the file,
     fastest first) run until one fails: killed. All pass: the mutant survived, unless
     tests/mutants/equivalent.txt says, with the reason, why it cannot be told from the original.

The score of a file is killed / (killed + survived) over its sampled mutants that are not
equivalent; every file must reach 90%. The table (also build/mutants/generated.md) lists per file
what was sampled, killed, equivalent, survived, the score, and every survivor with its id.

    tests/mutants/gen_mutants.py                     # every product file
    tests/mutants/gen_mutants.py --files shim/peers.c,hooks/entry.c
    tests/mutants/gen_mutants.py --only shim/peers.c#1a2b3c4d   # re-run given mutants (a survivor)
    tests/mutants/gen_mutants.py --list              # the sample per file, run nothing
    tests/mutants/gen_mutants.py --show ID           # the diff of one mutant

Needs universalmutator (`pip install universalmutator`; `make mutants` installs it when it is
missing, scripts/setup.sh --with-mutants too). Not part of make check."""
import argparse
import ast
import contextlib
import io
import difflib
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_mutants as rm  # noqa: E402  (scratch copy, capped runs, suite discovery, failure parsing)

ROOT = rm.ROOT
EQUIV = os.path.join(HERE, "equivalent.txt")
SCORE_MIN = 0.90
SEED = 18

# Every product file (issue 18: shim/, hooks/ with hooks/python/, policy/, report/, the report
# tool). Headers hold declarations and a few one-line inlines; their mutants are build failures
# or changes every .c sees, and they are not sampled.
PRODUCT_GLOBS = ["shim/*.c", "shim/*.cpp", "shim/record/*.c", "hooks/*.c", "hooks/python/sitecustomize.py",
                 "hooks/python/memshim/*.py", "policy/*.c", "policy/base/*.c", "policy/pool/*.c", "report/*.c",
                 "report/trace/*.c", "report/replay/*.c", "report/replay/models/*.c", "scripts/memshim-report"]

# The suites that exercise each file, in the order they run (the quickest that can see a bug in
# that file first). Names are prefixes of the suite names of run_mutants.discover_suites: "unit
# test_X" for a unit binary, else the name tests/run.sh gives the suite. The first matching
# prefix entry wins; a file no entry names is an error (a new file must be given its suites).
SUITES_FOR = [
    # (issue 19 split policy/pool.c into policy/pool/; the spill code, issue 20, has its own suites)
    ("policy/pool/spill.c", ["unit test_spill", "spill to host", "replay (CLI"]),
    ("policy/pool/", ["unit test_pool", "unit test_hotpath", "unit test_pool_threads", "unit test_torch",
                      "unit test_spill", "unit test_stress", "unit test_capture", "preload", "reports",
                      "replay --check", "replay (CLI"]),
    ("policy/dev_sim.c", ["unit test_pool", "replay (CLI", "replay --check"]),
    ("policy/dev_cuda.c", ["unit test_stress", "preload", "reports"]),
    ("policy/drvcost.c", ["unit test_drvcost", "replay (CLI", "reports"]),
    ("policy/base/options.c", ["unit test_options", "preload", "reports"]),
    ("policy/base/hotclock.c", ["unit test_hotpath", "reports", "preload"]),
    ("policy/base/log.c", ["unit test_options", "preload"]),
    ("policy/base/paths.c", ["unit test_options", "preload", "reports", "PyTorch snapshots"]),
    ("policy/base/cuda_real.c", ["preload", "reports"]),
    ("shim/torch_glue.cpp", ["differential (PyTorch's own", "pytorch on CPU"]),
    ("shim/torch.c", ["unit test_torch", "differential (PyTorch's own", "differential (snapshot", "preload",
                      "PyTorch snapshots"]),
    ("shim/capture.c", ["unit test_capture", "unit test_torch", "preload"]),
    ("shim/core.c", ["unit test_torch", "unit test_hotpath", "preload", "demo", "reports", "python GC",
                     "allocation sites", "PyTorch snapshots"]),
    ("shim/sites.c", ["allocation sites", "reports", "PyTorch snapshots", "unit test_hotpath"]),
    ("shim/pyframes.c", ["allocation sites", "reports", "PyTorch snapshots"]),
    ("shim/peers.c", ["preload"]),
    ("shim/watch.c", ["preload", "reports"]),
    ("shim/selfcheck.c", ["reliability"]),
    # the shim hands report.c its data (issue 19): what report.c's suites read
    ("shim/report_feed.c", ["demo", "reports", "report tool (memshim", "unit test_torch", "spill to host"]),
    ("shim/record/history.c", ["unit test_snapwrite", "PyTorch snapshots", "differential (snapshot"]),
    ("shim/record/snapwrite.c", ["unit test_snapwrite", "PyTorch snapshots", "differential (snapshot"]),
    ("hooks/driver.c", ["preload", "reports"]),
    ("hooks/entry.c", ["preload", "reports"]),
    ("hooks/runtime.c", ["preload", "reports"]),
    ("report/report.c", ["unit test_report", "demo", "reports", "report tool (memshim", "unit test_torch", "spill to host"]),
    ("report/replay/models/", ["unit test_models", "replay (torch models", "replay (CLI"]),
    ("report/replay/devtime.c", ["replay (CLI"]),  # memshim-replay --device timing
    ("report/replay/", ["replay (CLI", "replay (torch models", "replay --check"]),
    ("report/trace/pkwrite.c", ["unit test_snapwrite", "PyTorch snapshots"]),
    ("report/trace/", ["unit test_trace", "unit test_profiler", "replay (CLI", "replay (torch models"]),
    ("hooks/python/memshim/report.py", ["report tool (memshim", "report tool (advice", "differential (reports",
                                        "demo"]),
    ("scripts/memshim-report", ["report tool (memshim", "report tool (advice", "demo"]),
    ("hooks/python/memshim/cli.py", ["pip package"]),
    ("hooks/python/memshim/_build.py", ["pip package"]),
    ("hooks/python/memshim/__main__.py", ["pip package"]),
    ("hooks/python/memshim/_history.py", ["PyTorch snapshots", "pytorch on CPU"]),
    # the start-up hook's pip branch runs only in a python without memshim.pth (another environment)
    ("hooks/python/sitecustomize.py", ["pytorch on CPU", "PyTorch snapshots", "pip package"]),
    # (the scenario suite also runs the hook, but takes 7 minutes under load and times out there)
    ("hooks/python/", ["pytorch on CPU", "PyTorch snapshots"]),
]
# What make must rebuild before a suite runs on a mutated C file: a unit binary links the core
# archives; every other suite uses the library, the tools or the glue (`all`).
def make_targets(suites):
    t = ["all"]
    for s in suites:
        if s.startswith("unit "):
            t.append("build/tests/" + s.split()[1])
    return t


def lang_of(path):
    if path.endswith(".c"):
        return "c"
    if path.endswith(".cpp"):
        return "cpp"
    return "python"


def product_files(root):
    files = []
    for g in PRODUCT_GLOBS:
        files += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, g)))
    return files


def suites_for(path):
    for prefix, names in SUITES_FOR:
        if path.startswith(prefix):
            return names
    raise SystemExit(f"gen_mutants: no suites named for {path}: add it to SUITES_FOR")


def quota(path, text):
    """The sample size of a file: 2. A survivor costs every suite of its file (one to several
    minutes on 2 shared cores), and a third of the first run's mutants survived: 2 per file (92
    over the product) is what finishes in about an hour. --quota N asks for more."""
    return QUOTA


QUOTA = 2


def norm(s):
    return " ".join(s.split())


# ---- generating -------------------------------------------------------------------------------
def generate(src_abs, lang, workdir=None):
    """Every mutant universalmutator's rules make of one file: [(orig_text, new_text, line_no,
    nlines)], the changed line and what replaces it (one line, or two for its inserted 'break;' /
    'continue;'). universalmutator's own generator (mutator.mutants_regexp, the rules `mutate FILE
    LANG` uses: universal, the language's, c_like for C and C++), called as a library: `mutate`
    writes a full copy of the file per mutant, gigabytes for pool.c."""
    from universalmutator import mutator
    rules = {"c": ["universal.rules", "c.rules", "c_like.rules"],
             "cpp": ["universal.rules", "cpp.rules", "c_like.rules"],
             "python": ["universal.rules", "python.rules"]}[lang]
    source = open(src_abs, encoding="utf-8").readlines()
    with contextlib.redirect_stdout(io.StringIO()):
        muts = mutator.mutants_regexp(source, ruleFiles=rules, ignorePatterns=[], ignoreStringOnly=True)
    out = []
    for lineno, new_line, _rule, _lr in muts:
        if source[lineno - 1] == new_line:
            continue  # what mutate's makeMutant skips as identical
        out.append((source[lineno - 1], new_line, lineno, 1))
    return out


def mutant_id(path, seed, orig_text, new_text, occurrence):
    h = hashlib.sha256(f"{seed}\0{path}\0{norm(orig_text)}\0{norm(new_text)}\0{occurrence}".encode())
    return h.hexdigest()[:8]


def ordered(path, seed, muts):
    """Stable ids and order: by hash, so the sample survives code motion elsewhere in the file."""
    seen = {}
    res = []
    for orig_text, new_text, line, nlines in sorted(muts, key=lambda m: (m[2], m[1])):
        k = (norm(orig_text), norm(new_text))
        occ = seen.get(k, 0)
        seen[k] = occ + 1
        mid = mutant_id(path, seed, orig_text, new_text, occ)
        res.append({"id": f"{path}#{mid}", "file": path, "orig": orig_text, "new": new_text, "line": line,
                    "nlines": nlines, "occ": occ})
    res.sort(key=lambda m: m["id"])
    return res


def apply_text(text_lines, m):
    i = m["line"] - 1
    assert "".join(text_lines[i:i + m["nlines"]]) == m["orig"], m["id"]
    return "".join(text_lines[:i]) + m["new"] + "".join(text_lines[i + m["nlines"]:])


# ---- compiling: valid? equivalent by construction? --------------------------------------------
class Compiler:
    """The file's own compile command (make -n -W), at -g0 into a temporary object, so that two
    sources that compile to the same bytes are the same program."""

    def __init__(self, repo, env):
        self.repo, self.env, self.cmds, self.base = repo, env, {}, {}
        self.cache_path = os.path.join(os.path.dirname(repo), "verdicts.json")
        try:
            self.cache = json.load(open(self.cache_path))
        except (OSError, ValueError):
            self.cache = {}

    def command(self, path):
        if path in self.cmds:
            return self.cmds[path]
        target = "build/libmemshim_torch.so" if path.endswith(".cpp") else "build/obj/" + path[:-2] + ".o"
        r = subprocess.run(["make", "-s", "-n", "-W", path, target], cwd=self.repo, env=self.env,
                           capture_output=True, text=True)
        lines = [l for l in r.stdout.replace("\\\n", " ").splitlines() if path in l and not l.startswith("mkdir")]
        if r.returncode or not lines:
            raise SystemExit(f"gen_mutants: cannot find the compile command of {path}:\n{r.stdout}{r.stderr}")
        argv = shlex.split(lines[0])
        argv = [a for a in argv if a not in ("-g", "-MMD", "-MP")] + ["-g0"]
        oi = argv.index("-o")
        del argv[oi:oi + 2]
        if path.endswith(".cpp"):
            argv = [a for a in argv if not a.startswith(("-L", "-l", "-Wl,")) and a != "-shared"] + ["-c"]
        self.cmds[path] = argv
        return argv

    def compile(self, path, src_text):
        """Object bytes of src_text compiled as `path` (in place, then restored), or None."""
        argv = self.command(path)
        full = os.path.join(self.repo, path)
        keep = open(full, encoding="utf-8").read()
        fd, obj = tempfile.mkstemp(suffix=".o")
        os.close(fd)
        try:
            with open(full, "w", encoding="utf-8") as f:
                f.write(src_text)
            # no -w: warnings the build makes errors (-Werror=return-type...) refuse the mutant here too
            r = subprocess.run(argv + ["-o", obj], cwd=self.repo, env=self.env, capture_output=True)
            if r.returncode:
                return None
            return open(obj, "rb").read()
        finally:
            with open(full, "w", encoding="utf-8") as f:
                f.write(keep)
            os.unlink(obj)

    def verdict(self, path, orig_text, mut_text):
        """'invalid', 'equivalent' (the same object or AST) or 'ok'; remembered in the scratch
        directory by the contents' hash, so a second run compiles nothing it has seen."""
        key = hashlib.sha256((path + "\0" + orig_text + "\0" + mut_text).encode()).hexdigest()
        if key not in self.cache:
            self.cache[key] = self._verdict(path, orig_text, mut_text)
            with open(self.cache_path + ".tmp", "w") as f:
                json.dump(self.cache, f)
            os.replace(self.cache_path + ".tmp", self.cache_path)
        return self.cache[key]

    def _verdict(self, path, orig_text, mut_text):
        if lang_of(path) == "python":
            try:
                compile(mut_text, path, "exec")
                a = code_ast(mut_text)
            except (SyntaxError, ValueError):
                return "invalid"
            if path not in self.base:
                self.base[path] = code_ast(orig_text)
            return "equivalent" if a == self.base[path] else "ok"
        if path not in self.base:
            self.base[path] = self.compile(path, orig_text)
            if self.base[path] is None:
                raise SystemExit(f"gen_mutants: {path} does not compile unmutated")
        o = self.compile(path, mut_text)
        if o is None:
            return "invalid"
        return "equivalent" if o == self.base[path] else "ok"


def code_ast(text):
    """The AST without docstrings: a change inside one is documentation, not behaviour."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            b = node.body
            if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) and isinstance(
                    b[0].value.value, str):
                node.body = b[1:] or [ast.Pass()]
    return ast.dump(tree)


def sample_file(repo, comp, path, seed, workdir):
    src = os.path.join(repo, path)
    text = open(src, encoding="utf-8").read()
    lines = text.splitlines(keepends=True)
    muts = ordered(path, seed, generate(src, lang_of(path)))
    want = quota(path, text)
    chosen, tce, invalid = [], [], 0
    for m in muts:
        if len(chosen) >= want or invalid + len(tce) + len(chosen) > 600:
            break
        mt = apply_text(lines, m)
        v = comp.verdict(path, text, mt)
        if v == "invalid":
            invalid += 1
        elif v == "equivalent":
            m["status"], m["why"] = "equivalent", "compiles to the same " + (
                "AST (docstrings apart)" if lang_of(path) == "python" else "object code") + " as the original"
            tce.append(m)
        else:
            chosen.append(m)
    return {"file": path, "generated": len(muts), "invalid": invalid, "tce": tce, "chosen": chosen,
            "quota": want, "lines": len(lines)}


# ---- the committed list of equivalent mutants -----------------------------------------------
def read_equivalents(path=EQUIV):
    """[id] blocks with `why:` (the reason), and `line:`/`becomes:` (the mutated line and what it
    becomes, for a reader and to notice a stale entry). Returns {id: entry}."""
    ents, cur = {}, None
    if not os.path.exists(path):
        return ents
    for n, raw in enumerate(open(path, encoding="utf-8"), 1):
        line = raw.rstrip("\n")
        if not line.strip() or line.startswith("#"):
            continue
        m = re.match(r"^\[(\S+#[0-9a-f]{8})\]$", line)
        if m:
            cur = {"id": m.group(1), "n": n}
            ents[cur["id"]] = cur
            continue
        m = re.match(r"^(line|becomes|why):\s?(.*)$", line)
        if not m or cur is None:
            raise SystemExit(f"{path}:{n}: cannot read '{line}'")
        cur[m.group(1)] = cur.get(m.group(1), "") + m.group(2)
    for e in ents.values():
        if not e.get("why"):
            raise SystemExit(f"{path}:{e['n']}: [{e['id']}] has no 'why:'")
    return ents


# ---- running ----------------------------------------------------------------------------------
def run_mutant(repo, env, m, suites_by_name):
    path = os.path.join(repo, m["file"])
    orig = open(path, encoding="utf-8").read()
    lines = orig.splitlines(keepends=True)
    t0 = time.monotonic()
    names = suites_for(m["file"])
    order = []
    for want in names:
        hit = [s for s in suites_by_name if s[0].startswith(want)]
        if not hit:
            raise SystemExit(f"gen_mutants: no suite named '{want}*' (SUITES_FOR, {m['file']})")
        order += [s for s in hit if s not in order]
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(apply_text(lines, m))
        if lang_of(m["file"]) != "python":
            brc, bout, _, _ = rm.sh(["make", "-j2"] + make_targets([s[0] for s in order]), repo, 900, env)
            if brc:
                m["status"], m["why"] = "invalid", "does not build: " + " ".join(
                    l.strip() for l in bout.splitlines() if "error" in l)[:200]
                return
        for name, cmd, backstop, _ in order:
            rc, out, dt, to = rm.sh(cmd, repo, backstop, env)
            why = rm.suite_failed(rc, out, to)
            if why:
                m["status"], m["by"], m["why"] = "killed", name, why
                return
        m["status"], m["why"] = "survived", "passes: " + ", ".join(s[0] for s in order)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(orig)
        m["secs"] = time.monotonic() - t0


def read_previous(path):
    """{id: result} from an earlier run's log: its '[k/N] ID line L: STATUS ...' lines."""
    prev = {}
    pat = re.compile(r"^\[\d+/\d+\] (\S+#[0-9a-f]{8}) line \d+: (killed|survived|invalid|equivalent)"
                     r"(?: by (.+?): (.*))?(?:: (.*))? \((\d+) s\)$")
    for line in open(path, encoding="utf-8", errors="replace"):
        m = pat.match(line.rstrip("\n"))
        if m:
            st = m.group(2)
            prev[m.group(1)] = {"status": st, "by": m.group(3), "why": m.group(4) or m.group(5) or "",
                                "secs": float(m.group(6))}
            if st == "equivalent":  # listed then; the list decides again now
                prev[m.group(1)]["status"] = "survived"
    return prev


def diff_of(m):
    return "".join(difflib.unified_diff(m["orig"].splitlines(keepends=True), m["new"].splitlines(keepends=True),
                                        f"a/{m['file']}:{m['line']}", f"b/{m['file']}:{m['line']}", n=0))


def one_line(s):
    return norm(s)[:110].replace("|", "\\|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--quota", type=int, default=2, help="mutants sampled per file (default %(default)s)")
    ap.add_argument("--files", help="comma-separated product files (default: all)")
    ap.add_argument("--only", help="comma-separated mutant ids (FILE#hash): run just these")
    ap.add_argument("--list", action="store_true", help="print the sample per file, run nothing")
    ap.add_argument("--show", help="print the diff of the mutants with these ids")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--scratch", help="use (and keep) this scratch directory: a second run rebuilds only what changed")
    ap.add_argument("--previous", help="the log of an earlier full run: its results stand for every mutant "
                                       "not given with --only (re-run the survivors after their tests)")
    ap.add_argument("--report", default=os.path.join(ROOT, "build", "mutants", "generated.md"))
    a = ap.parse_args()
    globals()["QUOTA"] = a.quota
    try:
        import universalmutator  # noqa: F401
    except ImportError:
        print("gen_mutants: universalmutator's `mutate` is not installed: pip install universalmutator "
              "(or: bash scripts/setup.sh --with-mutants)", file=sys.stderr)
        return 2
    files = product_files(ROOT)
    if a.previous and not a.only:
        raise SystemExit("gen_mutants: --previous goes with --only (the mutants to run again)")
    if (a.only and not a.previous) or a.show:
        ids = (a.only or a.show).split(",")
        files = sorted({i.split("#")[0] for i in ids})
    elif a.files:
        files = a.files.split(",")
    for f in files:
        if not os.path.isfile(os.path.join(ROOT, f)):
            raise SystemExit(f"gen_mutants: no such product file: {f}")
        suites_for(f)
    equiv = read_equivalents()

    signal.signal(signal.SIGTERM, rm.stop)
    t_start = time.monotonic()
    tmp = os.path.abspath(a.scratch) if a.scratch else tempfile.mkdtemp(prefix="memshim-genmut-")
    os.makedirs(tmp, exist_ok=True)
    try:
        return run_all(a, files, equiv, tmp, t_start)
    except KeyboardInterrupt as e:
        p = rm.CHILD.get("p")
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        print(f"gen_mutants: stopped ({e})", file=sys.stderr)
        return 130
    finally:
        if a.keep or a.scratch:
            print(f"gen_mutants: scratch copy kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run_all(a, files, equiv, tmp, t_start):
    repo = os.path.join(tmp, "memshim")
    rm.copy_tree(repo)
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared) and not os.path.lexists(os.path.join(tmp, "shared")):
        os.symlink(shared, os.path.join(tmp, "shared"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
    # a loaded machine (other work beside the run) must not turn a slow PyTorch import into a kill
    env.update(BUILD="build", FUZZ_SECONDS="5", MSH_TEST_TIMEOUT=os.environ.get("MSH_TEST_TIMEOUT", "150"))
    need_build = not (a.list or a.show)
    if need_build:
        rc, out, dt, _ = rm.sh(["make", "-j2", "tests"], repo, 1800, env)
        if rc:
            print(out[-3000:])
            raise SystemExit("gen_mutants: the unmutated scratch copy does not build")
    comp = Compiler(repo, env)
    samples = []
    for f in files:
        t0 = time.monotonic()
        s = sample_file(repo, comp, f, a.seed, os.path.join(tmp, "gen", f.replace("/", "_")))
        s["sample_secs"] = time.monotonic() - t0
        samples.append(s)
        if not a.list:
            print(f"gen_mutants: {f}: {s['generated']} generated, {len(s['chosen'])} sampled "
                  f"({s['sample_secs']:.0f} s)", flush=True)
        if a.list:
            print(f"{f}: {s['generated']} generated, {s['invalid']} did not compile, {len(s['tce'])} equivalent "
                  f"by construction, {len(s['chosen'])} sampled (quota {s['quota']})")
            for m in s["chosen"]:
                print(f"    {m['id']}  line {m['line']}: {norm(m['orig'])[:100]}  ->  {norm(m['new'])[:100]}")
    if a.list:
        return 0
    if a.show:
        for s in samples:
            for m in s["chosen"] + s["tce"]:
                if m["id"] in a.show.split(","):
                    print(diff_of(m))
        return 0

    if a.only:
        want = set(a.only.split(","))
        missing = want - {m["id"] for s in samples for m in s["chosen"]}
        if missing:
            raise SystemExit(f"gen_mutants: not in the sample: {', '.join(sorted(missing))}")
        if a.previous:  # every other mutant keeps the earlier run's result
            prev = read_previous(a.previous)
            for s in samples:
                for m in s["chosen"]:
                    if m["id"] not in want:
                        if m["id"] not in prev:
                            raise SystemExit(f"gen_mutants: {m['id']} is not in {a.previous} (another seed or tree?)")
                        m.update(prev[m["id"]], kept=True)
        else:
            for s in samples:
                s["chosen"] = [m for m in s["chosen"] if m["id"] in want]
                s["tce"] = []

    suites = rm.discover_suites(repo)
    needed = []
    for s in samples:
        if any(not m.get("kept") for m in s["chosen"]):
            for want in suites_for(s["file"]):
                needed += [x for x in suites if x[0].startswith(want) and x not in needed]
    print(f"gen_mutants: {sum(len(s['chosen']) for s in samples)} mutants over {len(samples)} files; "
          f"checking that the {len(needed)} suites they use pass unmutated", flush=True)
    t0 = time.monotonic()
    for name, cmd, backstop, _ in needed:
        rc, out, dt, to = rm.sh(cmd, repo, backstop, env)
        why = rm.suite_failed(rc, out, to)
        if why:
            print(out[-3000:])
            raise SystemExit(f"gen_mutants: the UNMUTATED code fails suite '{name}': {why}; fix that first")
    baseline = time.monotonic() - t0
    print(f"gen_mutants: they pass unmutated ({baseline:.0f} s)", flush=True)

    total = sum(1 for s in samples for m in s["chosen"] if not m.get("kept"))
    k = 0
    for s in samples:
        for m in s["chosen"]:
            if m.get("kept"):  # the earlier run's result (--previous)
                if m["status"] == "survived" and m["id"] in equiv:
                    m["status"], m["why"] = "equivalent", equiv[m["id"]]["why"]
                    equiv[m["id"]]["used"] = True
                continue
            k += 1
            run_mutant(repo, env, m, suites)
            if m["status"] == "survived" and m["id"] in equiv:
                m["status"], m["why"] = "equivalent", equiv[m["id"]]["why"]
                equiv[m["id"]]["used"] = True
            elif m["status"] == "killed" and m["id"] in equiv:
                m["note"] = "listed as equivalent but killed: remove it from equivalent.txt"
            print(f"[{k}/{total}] {m['id']} line {m['line']}: {m['status']}"
                  + (f" by {m['by']}: {m['why'][:120]}" if m["status"] == "killed" else f": {m.get('why', '')[:160]}")
                  + f" ({m['secs']:.0f} s)", flush=True)
    if any(lang_of(s["file"]) != "python" for s in samples):
        rm.sh(["make", "-j2", "tests"], repo, 900, env)
    return report(a, samples, equiv, baseline, t_start)


def report(a, samples, equiv, baseline, t_start):
    rows = ["| file | lines | generated | did not compile | same code | sampled | killed | equivalent | survived | score |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    tot = dict(gen=0, invalid=0, tce=0, sampled=0, killed=0, equiv=0, surv=0)
    bad, survivors, notes = [], [], []
    for s in samples:
        ms = s["chosen"]
        killed = [m for m in ms if m.get("status") == "killed"]
        eq = [m for m in ms if m.get("status") == "equivalent"]
        surv = [m for m in ms if m.get("status") == "survived"]
        inv = s["invalid"] + len([m for m in ms if m.get("status") == "invalid"])
        counted = len(killed) + len(surv)
        score = len(killed) / counted if counted else 1.0
        if score < SCORE_MIN:
            bad.append(s["file"])
        survivors += surv
        notes += [m for m in ms if m.get("note")]
        rows.append(f"| `{s['file']}` | {s['lines']} | {s['generated']} | {inv} | {len(s['tce'])} | {len(ms)} | "
                    f"{len(killed)} | {len(eq)} | {len(surv)} | {100 * score:.0f}% |")
        for k, v in (("gen", s["generated"]), ("invalid", inv), ("tce", len(s["tce"])), ("sampled", len(ms)),
                     ("killed", len(killed)), ("equiv", len(eq)), ("surv", len(surv))):
            tot[k] += v
    counted = tot["killed"] + tot["surv"]
    secs = time.monotonic() - t_start
    rows.append(f"| all {len(samples)} files | | {tot['gen']} | {tot['invalid']} | {tot['tce']} | {tot['sampled']} | "
                f"{tot['killed']} | {tot['equiv']} | {tot['surv']} | {100 * tot['killed'] / max(1, counted):.1f}% |")
    rows.append("")
    if a.previous:
        rows.append(f"Results of {a.previous} for every mutant but the {sum(1 for s in samples for m in s['chosen'] if not m.get('kept'))} "
                    f"run again now (--only).")
    rows.append(f"Seed {a.seed}. Run time {secs / 60:.1f} min on {os.cpu_count()} CPUs (scratch build and the "
                f"unmutated suites, {baseline:.0f} s, included). did not compile: drawn, not buildable, not "
                f"sampled; same code: drawn, compiles to the same object (C, C++) or AST (Python, docstrings "
                f"apart) as the original, not sampled; equivalent: sampled, survived, and listed with its reason "
                f"in tests/mutants/equivalent.txt. Score: killed / (killed + survived); every file must reach "
                f"{100 * SCORE_MIN:.0f}%.")
    for m in survivors:
        rows.append(f"- survivor `{m['id']}` line {m['line']}: `{one_line(m['orig'])}` -> `{one_line(m['new'])}`")
    for m in notes:
        rows.append(f"- `{m['id']}`: {m['note']}")
    if not a.only and not a.files:
        for e in equiv.values():
            if not e.get("used"):
                rows.append(f"- equivalent.txt: [{e['id']}] matched no surviving sampled mutant (stale? remove it)")
    text = "\n".join(rows)
    print("\n" + text)
    os.makedirs(os.path.dirname(a.report), exist_ok=True)
    with open(a.report, "w") as f:
        f.write(text + "\n")
    if bad:
        print(f"gen_mutants: below {100 * SCORE_MIN:.0f}%: {', '.join(bad)}")
    return 1 if bad or notes else 0


if __name__ == "__main__":
    sys.exit(main())
