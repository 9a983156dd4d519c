"""Checks memshim reports against docs/report.schema.json (JSON Schema draft 2020-12) and the rules a
schema cannot state (percentiles in order, sites sorted). Shared by the tests that produce reports.

    from schema_check import report_problems
    problems = report_problems(report_dict)   # [] when the report is valid
"""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(ROOT, "docs", "report.schema.json")
_validator = None


def validator():
    global _validator
    if _validator is None:
        import jsonschema  # python3-jsonschema; scripts/setup.sh installs it
        with open(SCHEMA_PATH) as f:
            schema = json.load(f)
        jsonschema.Draft202012Validator.check_schema(schema)
        _validator = jsonschema.Draft202012Validator(schema)
    return _validator


def report_problems(r):
    out = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:160]}" for e in validator().iter_errors(r)]
    if out:
        return out
    for k in ("alloc_ns", "free_ns"):
        p = r["latency"][k]
        vals = [p[x] for x in ("p50", "p90", "p99", "max")]
        if p["count"] and not all(a <= b for a, b in zip(vals, vals[1:])):
            out.append(f"latency.{k}: percentiles out of order {vals}")
        if not p["count"] and any(v is not None for v in vals):
            out.append(f"latency.{k}: figures without calls")
    b = [s["bytes"] for s in r["sites"]]
    if b != sorted(b, reverse=True):
        out.append(f"sites not sorted by bytes: {b}")
    g = [s["growth_bytes_per_epoch"] for s in r["trend"]["growing_sites"]]
    if g != sorted(g, reverse=True):
        out.append(f"growing_sites not sorted: {g}")
    return out
