"""What the scenario jobs share: "device memory" the way a GPU job holds it. Under
LD_PRELOAD=libmemshim.so on the CUDA driver double each alloc is a memshim_malloc through
ctypes.CDLL, which releases the GIL as a PyTorch operator does (PyTorch's own CUDA runtime cannot
run over the double, so real CUDA tensors are out of reach here); the first one starts memshim, as
a GPU job's first tensor would. Without memshim in the process the same calls do nothing, so a job
runs, and prints, the same with and without it."""
import ctypes


class Device:
    def __init__(self):
        self._m = getattr(ctypes.CDLL(None), "memshim_malloc", None)
        if self._m is not None:
            self._m.restype = ctypes.c_void_p
            self._m.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            self._f = ctypes.CDLL(None).memshim_free
            self._f.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    def alloc(self, n):
        return (self._m(n, 0, None), n) if self._m is not None else (None, n)

    def free(self, block):
        if self._m is not None and block[0]:
            self._f(block[0], block[1], 0, None)


def mark(path, text):
    """Tell the test something (a line appended to a file: stdout stays the job's own)."""
    with open(path, "a") as f:
        f.write(text + "\n")
