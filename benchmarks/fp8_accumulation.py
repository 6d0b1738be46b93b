"""How precise is an fp8 MMA's accumulation over a long reduction? The question behind the V dot on e4m3 MMAs
(docs/fp8.md): accumulating P V straight onto O over a whole history sums every product at the tensor cores' fp8
accumulation precision, one fresh accumulator per 64-key tile does so over 64 only. Measured with torch._scaled_mm
(cuBLAS) on e4m3 operands shaped like the V dot (128 query rows, D=256 columns, K keys; weights >= 0 in units of a
power of two, signed codes), `use_fast_accum=True` (the MMA's own accumulation, never promoted) against False
(promoted to fp32) and an fp64 dot of the same codes: max error over max |exact| of each output, per K.

    PYTHONPATH=. python3 benchmarks/fp8_accumulation.py --keys 64,1024,16384
"""

from __future__ import annotations

import argparse
import sys

import torch

from layerflow.bench.settings import parse_lengths

E4M3 = torch.float8_e4m3fn


def operands(keys: int, rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [rows, keys] (SiLU-like: mostly small and positive, in e4m3's range) and values [keys, dim] as e4m3,
    the values column-major (K-major, as _scaled_mm's second operand must be)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.nn.functional.silu(torch.randn(rows, keys, generator=gen) * 2) * 100
    values = torch.randn(dim, keys, generator=gen) * 100
    return weights.to(E4M3), values.to(E4M3).t()


def errors(keys: int, device: torch.device, rows: int = 128, dim: int = 256, seed: int = 0) -> dict[str, float]:
    """Relative max error of the fast and the promoted accumulation against the exact dot of the same codes."""
    weights, values = operands(keys, rows, dim, seed)
    exact = weights.double() @ values.double()
    one = torch.ones((), device=device)
    out = {}
    for name, fast in (("fast", True), ("promoted", False)):
        got = torch._scaled_mm(weights.to(device), values.to(device), scale_a=one, scale_b=one,
                               out_dtype=torch.float32, use_fast_accum=fast)
        out[name] = float((got.double().cpu() - exact).abs().amax() / exact.abs().amax())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=parse_lengths, default=(64, 1024, 16384))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print("| keys | fast accumulation | promoted (fp32) |\n|---|---|---|")
    for keys in args.keys:
        e = errors(keys, torch.device(args.device))
        print(f"| {keys} | {e['fast']:.2e} | {e['promoted']:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
