"""The one batch-size search of the GPU check (issue 31 item 5): the GPU benchmark's frontier
(tests/gpu/bench_workloads.py) and the OOM step's hand-written finder (tests/gpu/oom_check.py)
both call search(), so a fix or a bug in the bisection shows in both, and tests/gpu/test_bench_plan.py
tests it once.

search(fits, start, resolution, grow_limit) brackets the largest n with fits(n) true, assuming
fits is monotone (true up to some n, false above it): from `start`, doubled while it fits (at most
to grow_limit x start; None: no bound) or halved until it fits, then bisected until the bracket is
within 1/resolution of its lower end. The answer is the bracket itself: `largest` (the largest n
seen to fit, 0 when none did) and `first_failure` (the smallest n seen to fail above it; None when
none failed up to the bound). fits may raise to stop the search; the Bracket it was given keeps
the bracket found so far (pass one in to read it after the exception). Imports nothing but the
standard library: the driver side of the checks and their tests run without PyTorch."""


class Bracket:
    """largest fits, first_failure fails (None: not found), trials [(n, fits)] in order."""

    def __init__(self):
        self.largest, self.first_failure, self.trials = 0, None, []

    def note(self, n, ok):
        self.trials.append((n, ok))
        if ok:
            self.largest = max(self.largest, n)
        elif self.first_failure is None or n < self.first_failure:
            self.first_failure = n
        return ok

    def resolved(self, resolution):
        lo, hi = self.largest, self.first_failure
        return hi is None or hi - lo <= max(1, lo // resolution)


def search(fits, start, resolution=16, grow_limit=64, into=None):
    """Bracket the largest n >= 1 that fits (see the module's docstring). Returns the Bracket."""
    b = into if into is not None else Bracket()
    n = max(1, int(start))

    def probe(k):
        return b.note(k, bool(fits(k)))
    if probe(n):
        while b.first_failure is None and (grow_limit is None or n < grow_limit * start):
            n *= 2
            probe(n)
    else:
        while b.largest == 0 and n > 1:
            n //= 2
            probe(n)
    while b.first_failure is not None and not b.resolved(resolution):
        probe((b.largest + b.first_failure) // 2)
    return b
