"""Can the layer's GEMMs take their pointwise neighbours into the epilogue? Times, at the GPU hit's shapes (hstu-bench,
320-token bucket), torch's input GEMM with bias followed by SiLU in place (what the pipeline runs) against a Triton
GEMM with bias and SiLU in its epilogue, for a few tilings; the output GEMM with the residual (torch addmm_) against
the Triton GEMM adding the residual. CUDA graphs of 20 calls, median of 10 replays, L2 not flushed (weights stay
resident between layers in the engine too).

    python3 benchmarks/gemm_epilogue.py --out benchmarks/results/gemm-epilogue-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerflow.bench.clocks import event_times_ms  # noqa: E402
from layerflow.bench.environment import environment  # noqa: E402


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, a_stride, b_stride, c_stride,
                 EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """C = A @ B, then EPILOGUE 1: SiLU(C + bias[col]); 2: C + residual (read from c_ptr itself, in place)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * a_stride + (k0 + ks)[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k0 + ks)[:, None] * b_stride + cols[None, :], mask=cols[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    c_at = c_ptr + rows[:, None] * c_stride + cols[None, :]
    if EPILOGUE == 1:
        y = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y = y.to(c_ptr.dtype.element_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y))
    else:
        y = acc + tl.load(c_at, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_at, y.to(c_ptr.dtype.element_ty), mask=ok)


def triton_gemm(a, b, bias, c, epilogue, tiling):
    bm, bn, bk, warps, stages = tiling
    m, k = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](a, b, bias, c, m, n, k, a.stride(0), b.stride(0), c.stride(0), EPILOGUE=epilogue,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


def time_us(fn, calls: int = 20, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = event_times_ms(graph.replay, replays)
    return sorted(times)[len(times) // 2] * 1e3 / calls


TILINGS = [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4),
           (128, 64, 64, 4, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt, t, e, wide = "cuda", torch.bfloat16, args.tokens, 1024, 4096
    x = torch.randn(t, e, device=dev, dtype=dt)
    w_in, bias = torch.randn(e, wide, device=dev, dtype=dt) / 32, torch.randn(wide, device=dev, dtype=dt)
    w_out, y = torch.randn(e, e, device=dev, dtype=dt) / 32, torch.randn(t, e, device=dev, dtype=dt)
    uvqk, resid = torch.empty(t, wide, device=dev, dtype=dt), torch.randn(t, e, device=dev, dtype=dt)
    rows = []

    def torch_in():
        torch.addmm(bias, x, w_in, out=uvqk)
        torch.nn.functional.silu(uvqk, inplace=True)

    want = torch.nn.functional.silu(torch.addmm(bias, x, w_in))
    rows.append(dict(gemm="input", impl="torch addmm + silu_", us=time_us(torch_in)))
    rows.append(dict(gemm="input", impl="torch addmm alone", us=time_us(lambda: torch.addmm(bias, x, w_in, out=uvqk))))
    for tiling in TILINGS:
        try:
            fn = lambda: triton_gemm(x, w_in, bias, uvqk, 1, tiling)   # noqa: E731
            fn()
            err = float((uvqk.float() - want.float()).abs().max())
            rows.append(dict(gemm="input", impl=f"triton bias+silu {tiling}", us=time_us(fn), max_err=err))
        except Exception as error:   # a tiling that does not fit is a result
            rows.append(dict(gemm="input", impl=f"triton bias+silu {tiling}", error=str(error)[:120]))
    rows.append(dict(gemm="output", impl="torch addmm_ (residual)", us=time_us(lambda: resid.addmm_(y, w_out))))
    for tiling in TILINGS:
        try:
            rows.append(dict(gemm="output", impl=f"triton +residual {tiling}",
                             us=time_us(lambda: triton_gemm(y, w_out, bias, resid, 2, tiling))))
        except Exception as error:
            rows.append(dict(gemm="output", impl=f"triton +residual {tiling}", error=str(error)[:120]))
    print("| GEMM | implementation | us | max err |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['gemm']} | {r['impl']} | {r.get('us', float('nan')):.2f} | {r.get('max_err', r.get('error', ''))} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(command=" ".join(["python3"] + sys.argv),
                                                  environment=environment(torch.device(dev)), rows=rows), indent=1))


if __name__ == "__main__":
    main()
