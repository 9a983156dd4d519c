#!/usr/bin/env python3
"""check_layers.py catches what it is for: on a scratch copy of the product folders and the
Makefile, the tree as it is passes; an include that runs up a floor, one that makes two top
folders include each other, a header found nowhere and a product C file over the line limit each
fail, naming the file and line."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CHECK = os.path.join(ROOT, "tests", "layers", "check_layers.py")
P = F = 0


def case(name, ok, detail=""):
    global P, F
    if ok:
        P += 1
        print(f"ok {name}")
    else:
        F += 1
        print(f"FAIL {name}\n    {detail}")


def run(tree):
    p = subprocess.run([sys.executable, CHECK, "--root", tree], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def scratch(tmp):
    tree = tempfile.mkdtemp(dir=tmp)
    shutil.copy(os.path.join(ROOT, "Makefile"), tree)
    for top in ("hooks", "shim", "report", "policy"):
        shutil.copytree(os.path.join(ROOT, top), os.path.join(tree, top),
                        ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return tree


def add_include(tree, path, header):
    p = os.path.join(tree, path)
    text = open(p).read()
    anchor = '#include "msh.h"\n'
    assert anchor in text, path
    text = text.replace(anchor, anchor + f'#include "{header}"\n', 1)
    open(p, "w").write(text)
    return text.splitlines().index(f'#include "{header}"') + 1


def main():
    with tempfile.TemporaryDirectory() as tmp:
        rc, out = run(scratch(tmp))
        case("the tree as it is passes", rc == 0 and "0 failed" in out, out[-1500:])

        tree = scratch(tmp)
        line = add_include(tree, "policy/dev_sim.c", "core.h")
        rc, out = run(tree)
        case("policy/ including shim/'s core.h fails, naming the file and line",
             rc == 1 and f"policy/dev_sim.c:{line}:" in out and "a floor above it" in out, out[-1500:])
        case("... and names the two folders that now include each other",
             "policy/ and shim/ include each other" in out, out[-1500:])

        tree = scratch(tmp)
        line = add_include(tree, "report/report.c", "sites.h")
        rc, out = run(tree)
        case("report/ reading a shim header fails", rc == 1 and f"report/report.c:{line}:" in out, out[-1500:])

        tree = scratch(tmp)
        add_include(tree, "policy/dev_sim.c", "trace.h")
        rc, out = run(tree)
        case("policy/ including report/trace's trace.h fails", rc == 1 and "policy/ includes report/" in out,
             out[-1500:])

        tree = scratch(tmp)
        add_include(tree, "policy/dev_sim.c", "no_such_header.h")
        rc, out = run(tree)
        case("a quoted include found in no -I folder fails", rc == 1 and "no_such_header.h" in out, out[-1500:])

        tree = scratch(tmp)
        with open(os.path.join(tree, "shim", "too_long.c"), "w") as f:
            f.write("/* too_long.c */\n" + "int x;\n" * 1500)
        rc, out = run(tree)
        case("a product C file over 1500 lines fails", rc == 1 and "shim/too_long.c: 1501 lines" in out, out[-1500:])

        tree = scratch(tmp)  # issue 31: the pool's files say what they must never do (docs/pool.md)
        p = os.path.join(tree, "policy", "pool", "check.c")
        text = open(p).read()
        head, rest = text.split("*/", 1)
        open(p, "w").write(re.sub(r"(?i)never", "not", head) + "*/" + rest)
        with open(os.path.join(tree, "shim", "bare.c"), "w") as f:
            f.write("int bare;\n")
        rc, out = run(tree)
        case("a pool file whose opening comment says nothing it must never do fails, and so does a file with no "
             "opening comment", rc == 1 and "policy/pool/check.c: its opening comment does not say what it must never do"
             in out and "shim/bare.c: does not open with a comment" in out, out[-1500:])

        tree = scratch(tmp)
        add_include(tree, "hooks/entry.c", "pool.h")
        rc, out = run(tree)
        case("a folder including one below it passes (hooks/ -> policy/)", rc == 0, out[-1500:])
    print(f"{P} passed, {F} failed")
    return 1 if F else 0


if __name__ == "__main__":
    sys.exit(main())
