#!/usr/bin/env python3
"""The house's floors, checked from the code (issue 19): every quoted #include of every product C
file resolved as the compiler resolves it (the including file's folder, then the Makefile's -I
folders in their order), the header counted by the top folder that holds it, and

  1. no folder includes a folder above it. The floors, top first:
         hooks/  ->  shim/  ->  report/  ->  policy/     (and shim/ -> policy/ straight)
     hooks/ calls the shim and the pool; the shim runs the pools and fills the reports; report/
     formats what it is handed and reads the trace formats; policy/ (the pool, its device
     backends, policy/base: msh.h with the log and the options, the driver table, the clocks)
     includes nothing outside itself. A strict order, so no two top folders include each other
     either (named apart below). shim/memshim.h, the public API, belongs to no floor;
  2. no product C file is over MAX_LINES lines (mimalloc's one small file per concern);
  3. every product C file opens with a comment saying what it is for, and the pool's files
     (policy/pool/, docs/pool.md: "each file opening with what it owns and what it must never
     do") say in it what they must never do.

Prints one line per breach (file:line: what, and why it breaks the floors), then
"N passed, N failed". Exit 1 on any breach. Reads only the tree: `python3 tests/layers/check_layers.py`
from anywhere; `--root DIR` checks another checkout.
"""
import argparse
import os
import re
import sys

FLOORS = ["hooks", "shim", "report", "policy"]  # top first: a folder may include only those after it
NO_FLOOR = {"shim/memshim.h"}
SOURCES = (".c", ".h", ".cpp")
MAX_LINES = 1500
# Files allowed over MAX_LINES for now, each with why (none since policy/pool.c was split into
# policy/pool/, issue 19); the check fails on an entry that no longer needs to be here.
LONG_OK = {}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
OPENING = re.compile(r"\s*/\*(.*?)\*/", re.S)
SAYS_NEVER = ("policy/pool/",)  # folders whose files' opening comments say what they must never do


def include_dirs(root):
    """The -I folders of the Makefile's CFLAGS that lie inside the product's floors, in order."""
    text = open(os.path.join(root, "Makefile"), encoding="utf-8").read()
    text = text.replace("\\\n", " ")
    dirs = []
    for line in text.splitlines():
        if not re.match(r"^\s*CFLAGS\s*\+?=", line):
            continue
        for d in re.findall(r"(?:^|\s)-I([^\s$]+)", line):
            d = os.path.normpath(d)
            if d.split("/")[0] in FLOORS and d not in dirs:
                dirs.append(d)
    return dirs


def product_files(root):
    for top in FLOORS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(SOURCES):
                    yield os.path.relpath(os.path.join(dirpath, f), root)


def resolve(root, src, name, dirs):
    for d in [os.path.dirname(src)] + dirs:
        cand = os.path.normpath(os.path.join(d, name))
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return None


def floor(path):
    if path in NO_FLOOR:
        return None
    top = path.split("/")[0]
    return top if top in FLOORS else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    dirs = include_dirs(root)
    passed = failed = 0
    pairs = {}  # (from floor, to floor) -> first "file:line" that includes so

    def breach(msg):
        nonlocal failed
        failed += 1
        print(f"FAIL {msg}")

    for src in product_files(root):
        lines = open(os.path.join(root, src), encoding="utf-8", errors="replace").read().splitlines()
        if src.endswith((".c", ".cpp")):
            if len(lines) > MAX_LINES and src not in LONG_OK:
                breach(f"{src}: {len(lines)} lines, over {MAX_LINES}: split it by concern")
            else:
                passed += 1
        opening = OPENING.match("\n".join(lines))
        if not opening:
            breach(f"{src}: does not open with a comment saying what it is for")
        elif src.startswith(SAYS_NEVER) and src.endswith(".c") and "never" not in opening.group(1).lower():
            breach(f"{src}: its opening comment does not say what it must never do")
        else:
            passed += 1
        mine = floor(src)
        for n, text in enumerate(lines, 1):
            m = INCLUDE.match(text)
            if not m:
                continue
            hdr = resolve(root, src, m.group(1), dirs)
            if hdr is None:
                breach(f'{src}:{n}: #include "{m.group(1)}" is found in none of its folder and {" ".join(dirs)}')
                continue
            theirs = floor(hdr)
            if mine is None or theirs is None or mine == theirs:
                passed += 1
                continue
            pairs.setdefault((mine, theirs), f"{src}:{n}")
            if FLOORS.index(theirs) < FLOORS.index(mine):
                breach(f'{src}:{n}: #include "{m.group(1)}" ({hdr}): {mine}/ includes {theirs}/, a floor above it '
                       f'(floors, top first: {" -> ".join(FLOORS)})')
            else:
                passed += 1
    for (a, b), where in sorted(pairs.items()):
        if a < b and (b, a) in pairs:
            breach(f"{a}/ and {b}/ include each other: {where} and {pairs[(b, a)]}")
    for f in sorted(LONG_OK):
        p = os.path.join(root, f)
        if os.path.isfile(p) and sum(1 for _ in open(p, encoding="utf-8", errors="replace")) <= MAX_LINES:
            breach(f"{f}: allowed over {MAX_LINES} lines but no longer is: remove it from LONG_OK")
    graph = ", ".join(f"{a} -> {b}" for a, b in sorted(pairs, key=lambda p: (FLOORS.index(p[0]), FLOORS.index(p[1]))))
    print(f"floors: {graph or '(no include crosses a folder)'}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
