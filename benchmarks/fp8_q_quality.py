"""Would fp8 Q K^T keep the fp8 cache's quality gate? The quality run of benchmarks/fp8_quality.py (the fp8 engine
against the engine of the model's dtype, layerflow.bench.quality) with the fp8 engine's CPU attention replaced by an
emulation of an fp8 Q K^T: each query row's head quantised to e4m3 by its amax (scale amax / 448) before its dot
with the cached history's keys (the fp8 codes an fp8 wgmma would read); the block's own keys (appended items,
candidates) still meet the query in the model's dtype. HSTU's attention has no softmax, so the two parts sum.
Exit code 1 when the gate fails.

    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --preset hstu-bench --history-lens 256,512,1024 \\
        --users-per-length 8
"""

from __future__ import annotations

import argparse
import sys

import torch

import layerflow.runtime.pipeline as pipeline
from layerflow.bench.quality import QualitySettings, compare, markdown
from layerflow.bench.settings import parse_lengths
from layerflow.kernels.reference import gather_history
from layerflow.model.config import PRESETS
from layerflow.model.mask import MaskRule, attention_mask
from layerflow.model.reference import hstu_attention

E4M3_MAX = 448.0


def e4m3_rows(q: torch.Tensor) -> torch.Tensor:
    """q [rows, H, D] through e4m3 and back (fp32), one amax scale per (row, head)."""
    scale = q.float().abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
    return (q.float() / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_qk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
                     appended_lens: torch.Tensor, out: torch.Tensor, *, alpha: float, max_seq_len: int | None = None,
                     inv_n: torch.Tensor | None = None, mask: MaskRule = MaskRule(),
                     kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """paged_attention_reference's contract, the cached history met by e4m3 queries when `kv_dtype` is fp8."""
    bounds = q_offsets.tolist()
    ns = [float(max_seq_len)] if inv_n is None else (1.0 / inv_n).tolist()
    users = zip(bounds, bounds[1:], history_lens.tolist(), appended_lens.tolist())
    for b, (start, end, history, new) in enumerate(users):
        own = end - start - new                                  # the user's candidates
        if start == end:
            continue
        first = mask.cached_read_start(history - new, new, own)
        visible = attention_mask(history, new, own, mask)[:, first:].to(q.device)
        cached_k, cached_v = gather_history(kv_cache, page_table[b], history, first, kv_dtype, k.dtype)
        split, n = cached_k.shape[0], ns[b if len(ns) > 1 else 0]
        rows = q[start:end].float()
        history_q = rows if kv_dtype is None else e4m3_rows(rows)
        parts = ((history_q, cached_k, cached_v, visible[:, :split]),
                 (rows, k[start + new:end], v[start + new:end], visible[:, split:]))
        acc = sum(hstu_attention(queries, keys.float(), values.float(), seen, alpha, n)
                  for queries, keys, values, seen in parts)
        out[start:end] = acc.to(out.dtype)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="hstu-bench")
    parser.add_argument("--history-lens", type=parse_lengths, default=(256, 512, 1024))
    parser.add_argument("--users-per-length", type=int, default=8)
    parser.add_argument("--append-len", type=int, default=16)
    parser.add_argument("--num-candidates", type=int, default=100)
    args = parser.parse_args()
    pipeline.paged_attention_reference = fp8_qk_attention
    settings = QualitySettings(preset=args.preset, history_lens=args.history_lens,
                               users_per_length=args.users_per_length, append_len=args.append_len,
                               num_candidates=args.num_candidates)
    results = compare(settings, torch.device("cpu"))
    print(markdown(results, "cpu, Q K^T of the cached history on e4m3 queries"))
    return 0 if results.passes else 1


if __name__ == "__main__":
    sys.exit(main())
