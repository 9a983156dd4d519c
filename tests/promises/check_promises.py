#!/usr/bin/env python3
"""Every documented promise has a test that names it (issue 18, item 3; docs/testing.md).

The promises are extracted from the docs by fixed rules, never listed by hand:
  env:MEMSHIM_X          every variable of docs/configuration.md's option table (generated from
                         policy/options.c), and every MEMSHIM_* name README.md or docs/*.md mention
  env:MEMSHIM_X=value    every allowed value of an enum option (the table's backquoted values)
  report:path            every leaf field of docs/report.schema.json (arrays as `a[].b`)
  report:path=value      every value of a field's enum in the schema (kinds, reasons, verdicts...)
  fallback:slug          every row of docs/pytorch.md's "Fallbacks to segment mode" table
  advice:kind            every rule of docs/reports.md's advice table (#advice)
  reason:word            every epoch reason named in docs/reports.md's schema section
  never:FILE#words       every sentence of README.md and docs/*.md that says something never
                         happens (the word "never" outside code spans and code blocks; not the
                         option value of MEMSHIM_EMPTY_CACHE/MEMSHIM_GC in a list of values),
                         named by the words around it (issue 31)

tests/promises/index.txt maps each promise to the tests that cover it, by name:
    PROMISE-ID | tests/FILE | TEST NAME
or, for a `never:` sentence that is not a claim about what memshim does (a measurement's story,
another program's behaviour, the test double's, a rule of the tests themselves), says why:
    PROMISE-ID | n/a | WHY
A name must be a real test of that file: a C test's TEST(name), or a substring of the name
string of a Python case() call (read with the ast module, f-string text parts
included), or, in a shell suite, of a line that names a check. Report fields that
tests/reports/test_report_truth.py's FIELDS table declares (path -> its check against ground
truth) are covered by that table, found by reading it, not by an index line.

The check fails, listing each, on: a promise with no covering test; an index line whose test does
not exist; an index line for a promise the docs no longer make (stale). Prints
"N passed, N failed"."""
import ast
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INDEX = os.path.join(HERE, "index.txt")


def read(rel):
    return open(os.path.join(ROOT, rel), encoding="utf-8").read()


def slug(text):
    text = re.sub(r"`([^`]*)`", r"\1", text)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60].rstrip("-")


def table_after(md, heading_re):
    """Rows (lists of cells) of the first markdown table after the line matching heading_re."""
    lines = md.splitlines()
    start = next((i for i, l in enumerate(lines) if re.search(heading_re, l)), None)
    if start is None:
        return None
    rows, seen = [], False
    for l in lines[start + 1:]:
        if l.startswith("|"):
            seen = True
            cells = [c.strip() for c in l.strip().strip("|").split("|")]
            if not all(re.fullmatch(r"-+", c) for c in cells):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def schema_promises(schema):
    out = set()

    def walk(node, path):
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            walk(schema["$defs"].get(node["$ref"].split("/")[-1], {}), path)
        for k in ("anyOf", "oneOf", "allOf"):
            for sub in node.get(k, []):
                walk(sub, path)
        for e in node.get("enum", []) if path else []:
            if isinstance(e, str):
                out.add(f"report:{path}={e}")
        props = node.get("properties") or {}
        for k, v in props.items():
            p = f"{path}.{k}" if path else k
            walk(v, p)
            if not leaf_has_children(v):
                out.add(f"report:{p}")
        if isinstance(node.get("items"), dict):
            it = node["items"]
            if leaf_has_children(it):
                walk(it, path + "[]")
            else:
                out.add(f"report:{path}[]")
                out.discard(f"report:{path}")
        if isinstance(node.get("additionalProperties"), dict) and path:
            out.add(f"report:{path}.*")

    def leaf_has_children(v):
        if not isinstance(v, dict):
            return False
        if "$ref" in v:
            return leaf_has_children(schema["$defs"].get(v["$ref"].split("/")[-1], {}))
        if v.get("properties") or (isinstance(v.get("items"), dict) and leaf_has_children(v["items"])):
            return True
        if isinstance(v.get("items"), dict):
            return True  # an array of scalars: promised as path[]
        return any(leaf_has_children(s) for k in ("anyOf", "oneOf", "allOf") for s in v.get(k, []))

    walk(schema, "")
    return out


POLICY_VALUES = ("oom", "epoch", "threshold", "idle")


def never_sentences(md):
    """The sentences (and table cells, list items) of a markdown text that contain the word
    "never" as a claim: code blocks and code spans left out, and "never" as one value in a list
    of the empty-cache or GC policies' values."""
    paras, block, code = [], [], False

    def flush():
        if block:
            paras.append(" ".join(x.strip() for x in block))
            block.clear()
    for line in md.splitlines():
        if line.startswith("```"):
            code = not code
            flush()
            continue
        if code or (line.startswith("    ") and not block) or not line.strip():
            flush()
            continue
        if line.startswith(("|", "#")) or re.match(r"^\s*([-*]|\d+\.)\s", line):
            flush()
        block.append(line)
    flush()
    out = []
    for para in paras:
        para = re.sub(r"`[^`]*`", "CODE", para)
        for sent in re.split(r"(?<=[.;:!?])\s+(?=[A-Z(*])|\s\|\s", para):
            words = re.findall(r"[A-Za-z0-9_%'-]+", sent)
            at = [i for i, w in enumerate(words) if w.lower() == "never"]
            at = [i for i in at if not any(w.lower() in POLICY_VALUES for w in words[max(0, i - 1):i + 2])]
            if at:
                out.append((sent.strip(), words, at[0]))
    return out


def extract():
    """{promise id: where the docs make it}"""
    prom = {}
    conf = read("docs/configuration.md")
    rows = table_after(conf, r"^## Options")
    if not rows:
        raise SystemExit("check_promises: no option table under '## Options' in docs/configuration.md")
    for cells in rows:
        m = re.fullmatch(r"`(MEMSHIM_[A-Z0-9_]+)`", cells[0])
        if not m:
            continue
        var = m.group(1)
        prom[f"env:{var}"] = "docs/configuration.md (option table)"
        if cells[1] == "enum":
            for v in re.findall(r"`([^`]+)`", cells[3]):
                prom[f"env:{var}={v}"] = "docs/configuration.md (allowed values)"
    for rel in ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")):
        for var in re.findall(r"(?<![A-Za-z0-9_])MEMSHIM_[A-Z][A-Z0-9_]*[A-Z0-9]", read(rel)):
            prom.setdefault(f"env:{var}", rel)
    schema = json.loads(read("docs/report.schema.json"))
    for p in schema_promises(schema):
        prom[p] = "docs/report.schema.json"
    frows = table_after(read("docs/pytorch.md"), r"\*\*Fallbacks to segment mode\*\*")
    if not frows:
        raise SystemExit("check_promises: no fallback table after '**Fallbacks to segment mode**' in docs/pytorch.md")
    for cells in frows:
        prom[f"fallback:{slug(cells[0])}"] = "docs/pytorch.md (fallbacks)"
    arows = table_after(read("docs/reports.md"), r"^### Advice")
    if not arows:
        raise SystemExit("check_promises: no advice table under '### Advice' in docs/reports.md")
    for cells in arows:
        m = re.fullmatch(r"`([a-z-]+)`", cells[0])
        if m:
            prom[f"advice:{m.group(1)}"] = "docs/reports.md#advice"
    for rel in ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")):
        for sent, words, i in never_sentences(read(rel)):
            base = f"never:{rel}#" + slug(" ".join(words[max(0, i - 3):i + 4]))
            pid, k = base, 2
            while pid in prom:
                pid, k = f"{base}-{k}", k + 1
            prom[pid] = f"{rel}: {sent[:200]}"
    return prom


def truth_fields():
    """The FIELDS table of tests/reports/test_report_truth.py: paths each with a check."""
    tree = ast.parse(read("tests/reports/test_report_truth.py"))
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "FIELDS" for t in n.targets):
            keys = {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
            # **{f"driver.calls.{k}": ... for k in ...}: the key's fixed prefix, then any name
            for k, v in zip(n.value.keys, n.value.values):
                if k is None and isinstance(v, ast.DictComp) and isinstance(v.key, ast.JoinedStr):
                    first = v.key.values[0]
                    if isinstance(first, ast.Constant):
                        keys.add(first.value + "*")
            return keys
    raise SystemExit("check_promises: tests/reports/test_report_truth.py has no FIELDS table")


def covered_by_fields(pid, fields):
    if not pid.startswith("report:") or "=" in pid:
        return False
    path = pid[len("report:"):]
    if path in fields:
        return True
    return any(f.endswith("*") and (path.startswith(f[:-1]) or path == f[:-2]) for f in fields)


NAME_CALLS = ("case", "check")  # a Python test's name is what it reports: case(name, ok); never a skip


def test_names(rel, cache={}):
    """Every test name a test file declares (see the module docstring)."""
    if rel in cache:
        return cache[rel]
    src = read(rel)
    names = []
    if rel.endswith((".c", ".cpp", ".h")):
        names = re.findall(r"^TEST\((\w+)\)", src, re.M)
        names += re.findall(r'check\("([^"]+)"', src)
    elif rel.endswith(".py"):
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in NAME_CALLS and n.args:
                a = n.args[0]
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    names.append(a.value)
                elif isinstance(a, ast.JoinedStr):
                    names.append("{}".join(v.value if isinstance(v, ast.Constant) else "" for v in a.values))
                elif isinstance(a, ast.BinOp):  # "..." + "..."
                    names.append("".join(c.value for c in ast.walk(a) if isinstance(c, ast.Constant)
                                         and isinstance(c.value, str)))
    elif rel.endswith(".sh"):
        names = [l for l in src.splitlines() if re.search(r"\b(check|ok|expect|case|run_case)\b", l)]
    cache[rel] = names
    return names


def read_index():
    entries = []
    for n, raw in enumerate(open(INDEX, encoding="utf-8"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 3 or not all(parts):
            raise SystemExit(f"{INDEX}:{n}: expected 'PROMISE | tests/FILE | TEST NAME', got '{line}'")
        entries.append((n, *parts))
    return entries


def main():
    prom = extract()
    fields = truth_fields()
    entries = read_index()
    covered, problems = {}, []
    na = set()
    for n, pid, rel, name in entries:
        if pid not in prom:
            problems.append(f"index.txt:{n}: '{pid}' is not a promise the docs make (stale: remove or rename it)")
            continue
        if rel == "n/a":
            if not pid.startswith("never:"):
                problems.append(f"index.txt:{n}: {pid}: only a never: sentence may be n/a (with why)")
            else:
                na.add(pid)
            continue
        if not rel.startswith("tests/") or not os.path.isfile(os.path.join(ROOT, rel)):
            problems.append(f"index.txt:{n}: {pid}: no test file {rel}")
            continue
        names = test_names(rel)
        hit = [t for t in names if (t == name if rel.endswith((".c", ".cpp")) and re.fullmatch(r"\w+", name)
                                    else name in t)]
        if not hit:
            problems.append(f"index.txt:{n}: {pid}: {rel} has no test named '{name}'")
            continue
        covered.setdefault(pid, []).append(f"{rel}: {name}")
    missing = []
    for pid in sorted(prom):
        if pid in covered or pid in na or covered_by_fields(pid, fields):
            continue
        missing.append(f"{pid}  (promised in {prom[pid]})")
    by_fields = sum(1 for p in prom if p not in covered and covered_by_fields(p, fields))
    tests = {c for v in covered.values() for c in v}
    passed = len(prom) - len(missing)
    for m in missing:
        print(f"FAIL promise without a test: {m}")
    for p in problems:
        print(f"FAIL {p}")
    kinds = {}
    for p in prom:
        kinds[p.split(":")[0]] = kinds.get(p.split(":")[0], 0) + 1
    print(f"{len(prom)} promises ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}): {len(covered)} named "
          f"in index.txt by {len(tests)} tests, {by_fields} by test_report_truth.py's FIELDS, {len(na)} never: "
          f"sentences that are no claim about memshim (n/a, with why); "
          f"{len(missing)} without a test, {len(problems)} broken index lines")
    print(f"{passed + len(entries) - len(problems)} passed, {len(missing) + len(problems)} failed, 0 skipped")
    return 1 if missing or problems else 0


if __name__ == "__main__":
    if "--list" in sys.argv:
        for pid, where in sorted(extract().items()):
            print(f"{pid}\t{where}")
        sys.exit(0)
    sys.exit(main())
