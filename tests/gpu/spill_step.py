#!/usr/bin/env python3
"""The GPU check's spill case (issue 20): a real training step (24 linear layers of 4096, Adam, on
CUDA) run in tensor mode under memshim, the way the check runs it: `memshim run -- python
tests/gpu/spill_step.py OUT.json`. Prints and writes the per-step losses, step seconds, PyTorch's
peak allocated bytes and memshim's spill figures (memshim.stats), so that the check can compare an
unlimited run with one at MEMSHIM_LIMIT below the peak and MEMSHIM_SPILL=host (and one with the
same limit and spill off, which must fail with torch.OutOfMemoryError)."""
import json
import sys
import time

import torch


def main(out):
    res = {"ok": False}
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4096, 4096) for _ in range(24)]
        model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(1024, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        losses, times = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        res.update(ok=True, losses=losses, step_s=times, peak_allocated=torch.cuda.max_memory_allocated())
    except torch.OutOfMemoryError as e:
        res.update(oom=True, message=str(e)[:2000])
    try:
        import memshim
        res["memshim_stats"] = memshim.stats(0)
    except Exception as e:  # noqa: BLE001 - the figures are optional, the step's result is not
        res["memshim_stats_error"] = repr(e)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "message"}))
    return 0 if res["ok"] or res.get("oom") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
