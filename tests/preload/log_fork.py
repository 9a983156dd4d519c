"""log_fork.py: a CPython process under LD_PRELOAD=libmemshim.so with MEMSHIM_LOG_FILE=DIR/log-%p.txt
forks a child that starts memshim (its first CUDA call) before the parent does (a launcher that
forks one worker per GPU). memshim reads its configuration, and opens the parent's log, in its
constructor; the child's start opens log-<child pid>, which replaces the parent's file in the
child: the child's lines go to its own file, and the child does not keep the parent's log open
(an open descriptor pins the file, and a FIFO log's reader would wait for every child).
Run by run_preload.sh (LOGDIR: the log directory). Ends with "N passed, N failed, N skipped"."""
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import case, finish  # noqa: E402

logdir = os.environ["LOGDIR"]
mine = os.path.join(logdir, f"log-{os.getpid()}.txt")
case("the parent's log is open from the start (memshim's constructor read the configuration)",
     os.path.exists(mine), os.listdir(logdir))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    ctypes.CDLL("libcudart.so")  # the driver double's runtime, on LD_LIBRARY_PATH
    rt = ctypes.CDLL(None)  # cudaMalloc as a program finds it: memshim's, preloaded
    p = ctypes.c_void_p()
    rc = rt.cudaMalloc(ctypes.byref(p), 1 << 20)
    rt.cudaFree(p)
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    os.write(w, json.dumps({"rc": rc, "fds": fds}).encode())
    os._exit(0)
os.close(w)
data = b""
while True:
    chunk = os.read(r, 65536)
    if not chunk:
        break
    data += chunk
_, status = os.waitpid(pid, 0)
child = json.loads(data or b"{}")
theirs = os.path.join(logdir, f"log-{pid}.txt")
text = open(theirs).read() if os.path.exists(theirs) else ""
case("the child starts memshim (cudaMalloc through the double) and exits 0",
     status == 0 and child.get("rc") == 0, (status, child.get("rc")))
case("the child's lines go to log-<child pid>, not to the parent's log",
     f"memshim[{pid}]: info:" in text and "active" in text and f"memshim[{pid}]" not in open(mine).read(),
     (text[-300:], os.listdir(logdir)))
held = [f for f, t in child.get("fds", {}).items() if t == mine]
case("the child does not keep the parent's log file open", child.get("fds") and not held,
     child.get("fds"))
finish()
