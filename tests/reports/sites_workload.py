"""sites_workload.py: the Python workload of tests/reports/test_report_truth.py. Run under
LD_PRELOAD=libmemshim.so on the driver double, it allocates through memshim_malloc (ctypes.PyDLL:
the GIL stays held, as in PyTorch's allocator call) from a few call sites, each marked
`# SITE <name>` on the line that calls memshim_malloc, and writes the site name of every
allocation, in order, to the file named by argv[1]: with memshim's own trace (same order), the
test knows which site owns every live block at any moment. Four epochs: activations and a
workspace build one peak per epoch, then go; a small block and a 1 MiB block are kept every epoch
(the leak a growing site must show). Never imports anything but the standard library."""
import ctypes
import sys

lib = ctypes.PyDLL(None)
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
log = open(sys.argv[1], "w")
MiB = 1 << 20


def activation(n):
    p = lib.memshim_malloc(n, 0, None)  # SITE activation
    log.write("activation\n")
    return p


def workspace(n):
    p = lib.memshim_malloc(n, 0, None)  # SITE workspace
    log.write("workspace\n")
    return p


def bookkeeping(n):
    p = lib.memshim_malloc(n, 0, None)  # SITE bookkeeping
    log.write("bookkeeping\n")
    return p


kept = []
for epoch in range(4):
    acts = [(activation((i % 5 + 1) * MiB + 512 * i), (i % 5 + 1) * MiB + 512 * i) for i in range(12)]
    small = [(bookkeeping(4096 + 64 * i), 4096 + 64 * i) for i in range(6)]
    kept.append(lib.memshim_malloc(MiB, 0, None))  # SITE kept
    log.write("kept\n")
    ws = workspace(7 * MiB)  # the epoch's peak: everything above is live
    lib.memshim_free(ws, 7 * MiB, 0, None)
    for p, n in reversed(acts):
        lib.memshim_free(p, n, 0, None)
    for p, n in small[1:]:
        lib.memshim_free(p, n, 0, None)
    lib.memshim_epoch()
log.close()
print("sites workload: finished")
