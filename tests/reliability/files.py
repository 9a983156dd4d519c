#!/usr/bin/env python3
"""Files and privileges end to end (issue 5). Runs the demo workload (memshim-train-demo) under
LD_PRELOAD=libreli-openspy.so:libmemshim.so, which records every open/mkdir/rename under the
test directory with its flags and mode, and checks:

  - report, trace and log files are opened with O_CLOEXEC and O_NOFOLLOW; report temp files
    with O_CREAT|O_EXCL and a 64-bit random suffix; a new trace with O_EXCL; modes 0644 for
    reports and the log, 0600 for the trace, 0755 for directories memshim creates (run under
    umask 000 so the modes are memshim's own), and the files on disk have those modes;
  - a symlink planted at a report's final name is replaced, never written through; a symlink
    at the trace or log name is refused with one warning; the file it points to is unchanged;
  - an existing trace of this user is reused (truncated, made 0600); one with a second hard
    link, one of another user, a FIFO and /dev/full are refused with one warning, and a FIFO at
    the log name does not hang the job;
  - a read-only report directory (a read-only tmpfs) and a full disk (a tiny tmpfs) give one
    warning, reports stop, no temp file is left, the job completes; a trace on a full disk ends
    with a whole line and still loads; MEMSHIM_LOG_FILE=/dev/full falls back to stderr with one
    warning.
The mount cases need root (CAP_SYS_ADMIN) and are skipped with a message otherwise.
Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
SPY = os.path.join(BUILD, "reliability", "libreli-openspy.so")
res = {"passed": 0, "failed": 0, "skipped": 0}
O_CLOEXEC, O_NOFOLLOW, O_EXCL, O_CREAT, O_APPEND = os.O_CLOEXEC, os.O_NOFOLLOW, os.O_EXCL, os.O_CREAT, os.O_APPEND
HOST = socket.gethostname().split(".")[0].replace("/", "_")


def case(name, ok, detail=""):
    res["passed" if ok else "failed"] += 1
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)


def skip(name, why):
    res["skipped"] += 1
    print(f"skip {name} ({why})")


def demo(tmp, env_extra, plant=None, steps=2, epochs=1, umask=None, timeout=60):
    """Run the demo; `plant(pid)` runs in the child before exec, so it can use the pid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "2G",
                "LD_PRELOAD": SPY + ":" + os.path.join(BUILD, "libmemshim.so"),
                "OPENSPY_LOG": os.path.join(tmp, "spy.log"), "OPENSPY_PREFIX": tmp})
    env.update(env_extra)

    def pre():
        if umask is not None:
            os.umask(umask)
        if plant:
            plant(os.getpid())
    try:
        p = subprocess.run([os.path.join(BUILD, "memshim-train-demo"), "--epochs", str(epochs), "--steps",
                            str(steps), "--scale", "0.05"], env=env, cwd=tmp, capture_output=True, text=True,
                           timeout=timeout, preexec_fn=pre)
    except subprocess.TimeoutExpired:
        return None
    return p


def warnings(p):
    return [l for l in p.stderr.splitlines() if re.match(r"^memshim\[\d+\]: warning: ", l)]


def completed(p):
    return p is not None and p.returncode == 0 and "finished" in p.stdout


def spy_lines(tmp):
    out = []
    path = os.path.join(tmp, "spy.log")
    if os.path.exists(path):
        for l in open(path):
            what, flags, mode, rc, rest = l.rstrip("\n").split(" ", 4)
            out.append((what, None if flags == "-" else int(flags, 8), None if mode == "-" else int(mode, 8),
                        int(rc), rest))
    return out


def report_name(d, pid, what):
    return os.path.join(d, f"memshim-{HOST}-pid{pid}-dev0-{what}.json")


def flags_and_modes():
    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        rd, tr, lg = os.path.join(tmp, "r", "a", "b"), os.path.join(tmp, "t.trace"), os.path.join(tmp, "m.log")
        p = demo(tmp, {"MEMSHIM_REPORT_DIR": rd, "MEMSHIM_TRACE_FILE": tr, "MEMSHIM_LOG_FILE": lg,
                       "MEMSHIM_LOG": "info"}, epochs=2, umask=0)
        case("flags: the demo completes with reports, trace and log file on (umask 000)", completed(p),
             p and p.stderr[-300:])
        spy = spy_lines(tmp)
        opens = [s for s in spy if s[0] == "open" and not s[4].endswith("spy.log")]
        bad = [s for s in opens if not (s[1] & O_CLOEXEC and s[1] & O_NOFOLLOW)]
        case(f"flags: every open of a report, trace or log file ({len(opens)}) has O_CLOEXEC and O_NOFOLLOW",
             opens and not bad, bad[:3])
        tmps = [s for s in opens if ".json.tmp" in s[4]]
        suffixes = [re.search(r"\.tmp([0-9a-f]+)$", s[4]).group(1) if re.search(r"\.tmp([0-9a-f]+)$", s[4]) else ""
                    for s in tmps]
        case(f"flags: report temp files ({len(tmps)}) are O_CREAT|O_EXCL, mode 0644, 64-bit random distinct names",
             tmps and all(s[1] & O_CREAT and s[1] & O_EXCL and s[2] == 0o644 for s in tmps)
             and all(len(x) == 16 for x in suffixes) and len(set(suffixes)) == len(suffixes), tmps[:2])
        tro = [s for s in opens if s[4] == tr]
        case("flags: a new trace is created O_CREAT|O_EXCL with mode 0600",
             len(tro) == 1 and tro[0][1] & O_EXCL and tro[0][2] == 0o600, tro)
        lgo = [s for s in opens if s[4] == lg]
        case("flags: the log is opened O_APPEND with mode 0644", lgo and all(s[1] & O_APPEND and s[2] == 0o644
                                                                              for s in lgo), lgo)
        mk = [s for s in spy if s[0] == "mkdir"]
        case(f"flags: directories are created with mode 0755 ({len(mk)} mkdir calls)",
             mk and all(s[2] == 0o755 for s in mk), mk)
        modes = {}
        for f in glob.glob(os.path.join(rd, "*")):
            modes[os.path.basename(f)] = stat.S_IMODE(os.stat(f).st_mode)
        dirs = [os.path.join(tmp, "r"), os.path.join(tmp, "r", "a"), rd]
        ok = (modes and all(m == 0o644 for m in modes.values()) and os.path.exists(tr)
              and stat.S_IMODE(os.stat(tr).st_mode) == 0o600 and stat.S_IMODE(os.stat(lg).st_mode) == 0o644
              and all(stat.S_IMODE(os.stat(d).st_mode) == 0o755 for d in dirs))
        case("modes on disk: reports 0644, trace 0600, log 0644, created directories 0755", ok,
             {**modes, "trace": oct(stat.S_IMODE(os.stat(tr).st_mode)) if os.path.exists(tr) else None})


def symlinks():
    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        rd = os.path.join(tmp, "r")
        os.makedirs(rd)
        victims = {k: os.path.join(tmp, f"victim-{k}") for k in ("epoch", "summary", "trace", "log")}
        for v in victims.values():
            with open(v, "w") as f:
                f.write("precious\n")
        tr, lg = os.path.join(tmp, "t.trace"), os.path.join(tmp, "m.log")

        def plant(pid):
            os.symlink(victims["epoch"], report_name(rd, pid, "epoch0000"))
            os.symlink(victims["summary"], report_name(rd, pid, "summary"))
            os.symlink(victims["trace"], tr)
            os.symlink(victims["log"], lg)
        p = demo(tmp, {"MEMSHIM_REPORT_DIR": rd, "MEMSHIM_TRACE_FILE": tr, "MEMSHIM_LOG_FILE": lg}, plant=plant)
        w = warnings(p) if p else []
        case("symlinks: the job completes", completed(p), p and p.stderr[-300:])
        case("symlinks: no planted target was written through",
             all(open(v).read() == "precious\n" for v in victims.values()))
        finals = glob.glob(os.path.join(rd, "memshim-*.json"))
        okr = len(finals) == 2 and all(not os.path.islink(f) and json.load(open(f)) for f in finals)
        case("symlinks: a link at a report's final name is replaced by the complete report", okr, finals)
        case("symlinks: a link at the trace and at the log name: refused, one warning each",
             len(w) == 2 and any("MEMSHIM_TRACE_FILE" in x and "symbolic link" in x for x in w)
             and any("MEMSHIM_LOG_FILE" in x and "symbolic link" in x for x in w), w)

    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        tr = os.path.join(tmp, "t.trace")
        target = os.path.join(tmp, "not-yet-there")
        os.symlink(target, tr)  # dangling: following it would create the attacker's file
        p = demo(tmp, {"MEMSHIM_TRACE_FILE": tr})
        case("symlinks: a dangling link at the trace name creates nothing, one warning",
             completed(p) and not os.path.exists(target) and len(warnings(p)) == 1, p and warnings(p))


def existing_traces():
    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        tr = os.path.join(tmp, "t.trace")
        with open(tr, "w") as f:
            f.write("old content of a previous run\n" * 100)
        os.chmod(tr, 0o644)
        p = demo(tmp, {"MEMSHIM_TRACE_FILE": tr})
        data = open(tr).read()
        case("existing trace of this user: reused, truncated, made 0600, no warning",
             completed(p) and not warnings(p) and data.startswith("# memshim-trace 1\n") and "old content" not in data
             and stat.S_IMODE(os.stat(tr).st_mode) == 0o600, (p and warnings(p), data[:40]))

    def refused(label, setup, var="MEMSHIM_TRACE_FILE", needle="refusing"):
        with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
            path, check = setup(tmp)
            p = demo(tmp, {var: path}, timeout=30)
            w = warnings(p) if p else []
            case(f"{label}: refused with one warning, the job completes",
                 p is not None and completed(p) and len(w) == 1 and var in w[0] and needle in w[0] and check(),
                 "hung" if p is None else w)

    def hardlink(tmp):
        v = os.path.join(tmp, "victim")
        open(v, "w").write("precious\n")
        os.link(v, os.path.join(tmp, "t.trace"))
        return os.path.join(tmp, "t.trace"), lambda: open(v).read() == "precious\n"
    refused("existing trace with a second hard link", hardlink)

    def other_user(tmp):
        t = os.path.join(tmp, "t.trace")
        open(t, "w").write("theirs\n")
        try:
            os.chown(t, 65534, 65534)
        except PermissionError:
            pass
        return t, lambda: open(t).read() == "theirs\n"
    if os.geteuid() == 0:
        refused("existing trace owned by another user", other_user)
    else:
        skip("existing trace owned by another user", "needs root to chown")

    def fifo(tmp):
        t = os.path.join(tmp, "t.trace")
        os.mkfifo(t)
        return t, lambda: True
    refused("a FIFO at the trace name (no reader)", fifo, needle="")
    refused("/dev/full as the trace", lambda tmp: ("/dev/full", lambda: True))
    refused("a FIFO at the log name (no reader)", fifo, var="MEMSHIM_LOG_FILE", needle="")


def dev_full_log():
    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        p = demo(tmp, {"MEMSHIM_LOG_FILE": "/dev/full", "MEMSHIM_LOG": "info"})
        w = warnings(p) if p else []
        info = [l for l in p.stderr.splitlines() if ": info: " in l] if p else []
        case("MEMSHIM_LOG_FILE=/dev/full: one warning, then the log goes to stderr, the job completes",
             completed(p) and len(w) == 1 and "MEMSHIM_LOG_FILE" in w[0] and "stderr" in w[0] and info,
             (w, len(info)))


def mount_tmpfs(path, opts):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def umount(path):
    subprocess.run(["umount", path], capture_output=True)


def read_only_and_full():
    with tempfile.TemporaryDirectory(prefix="memshim-files-") as tmp:
        ro = os.path.join(tmp, "ro")
        ok, err = mount_tmpfs(ro, "ro,size=1m")
        if not ok:
            skip("read-only report directory", f"cannot mount a tmpfs: {err or 'not root'}")
            skip("full disk", "cannot mount a tmpfs")
            return
        try:
            for sub in ("", "sub"):
                d = os.path.join(ro, sub) if sub else ro
                p = demo(tmp, {"MEMSHIM_REPORT_DIR": d}, epochs=3)
                w = warnings(p) if p else []
                case(f"read-only report directory{' (to be created)' if sub else ''}: one warning, reports stop, "
                     "the job completes", completed(p) and len(w) == 1 and "MEMSHIM_REPORT_DIR" in w[0], w)
        finally:
            umount(ro)

        full = os.path.join(tmp, "full")
        ok, err = mount_tmpfs(full, "size=64k")
        if not ok:
            skip("full disk", err)
            return
        try:
            with open(os.path.join(full, "filler"), "wb") as f:
                try:
                    f.write(b"x" * (60 * 1024))
                except OSError:
                    pass
            rd = os.path.join(full, "r")
            p = demo(tmp, {"MEMSHIM_REPORT_DIR": rd}, epochs=3)
            w = warnings(p) if p else []
            left = glob.glob(os.path.join(rd, "*.tmp*"))
            good = []
            for f in glob.glob(os.path.join(rd, "*.json")):
                try:
                    good.append(json.load(open(f)))
                except ValueError:
                    left.append(f)
            case(f"full disk: one warning, reports stop ({len(good)} complete reports), no temp or partial file, "
                 "the job completes", completed(p) and len(w) == 1 and "MEMSHIM_REPORT_DIR" in w[0] and not left,
                 (w, left))
        finally:
            umount(full)

        ok, err = mount_tmpfs(full, "size=192k")
        if not ok:
            skip("full disk under the trace", err)
            return
        try:
            with open(os.path.join(full, "filler"), "wb") as f:
                f.write(b"x" * (96 * 1024))
            tr = os.path.join(full, "t.trace")
            p = demo(tmp, {"MEMSHIM_TRACE_FILE": tr}, steps=40)
            w = warnings(p) if p else []
            data = open(tr, "rb").read() if os.path.exists(tr) else b""
            rp = subprocess.run([os.path.join(BUILD, "memshim-replay"), "--json", tr], capture_output=True, text=True)
            case(f"full disk under the trace: one warning, the trace ends with a whole line ({len(data)} bytes) "
                 "and loads, the job completes",
                 completed(p) and len(w) == 1 and "MEMSHIM_TRACE_FILE" in w[0] and data.endswith(b"\n")
                 and rp.returncode == 0, (w, len(data), rp.stderr[-200:]))
        finally:
            umount(full)


def main():
    for exe in (SPY, os.path.join(BUILD, "memshim-train-demo"), os.path.join(BUILD, "libmemshim.so")):
        if not os.path.exists(exe):
            print(f"FAIL setup: {exe} not built\n0 passed, 1 failed, 0 skipped")
            return 1
    flags_and_modes()
    symlinks()
    existing_traces()
    dev_full_log()
    read_only_and_full()
    print(f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped")
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
