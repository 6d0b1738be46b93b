"""Do an H2D and a D2H bulk copy (pinned host, separate streams) run concurrently on the H200's copy engines?"""
import json
import sys
import torch

n = 256 << 20
host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()


def timed(which):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for s in (h2d, d2h):
        s.wait_event(start)
    ev = []
    if "h2d" in which:
        with torch.cuda.stream(h2d):
            dev_a.copy_(host_in, non_blocking=True)
        e = torch.cuda.Event(enable_timing=True); e.record(h2d); ev.append(e)
    if "d2h" in which:
        with torch.cuda.stream(d2h):
            host_out.copy_(dev_b, non_blocking=True)
        e = torch.cuda.Event(enable_timing=True); e.record(d2h); ev.append(e)
    torch.cuda.synchronize()
    return [start.elapsed_time(e) for e in ev]


out = {}
for which in (("h2d",), ("d2h",), ("h2d", "d2h")) * 2:
    ms = timed(which)
    out["+".join(which)] = [round(n / (m / 1e3) / 1e9, 1) for m in ms]
print("copy probe GB/s (256 MiB each):", json.dumps(out))
json.dump(out, open(sys.argv[1], "w"))
