"""fp8 KV cache quality: an fp8 engine against the engine of the model's dtype on the same weights and a fixed
synthetic workload of many users (layerflow.bench.quality): max and mean relative score error, top-10 and top-50
overlap of the candidates and Kendall's tau, per history length and overall, and the issue's gate (mean top-10
overlap >= 0.98, mean Kendall tau >= 0.98). Exit code 1 when the gate fails.

    PYTHONPATH=. python3 benchmarks/fp8_quality.py --out benchmarks/results/fp8-quality-cpu.json       # CPU: tiny
    PYTHONPATH=. python3 benchmarks/fp8_quality.py --preset dlrmv3 --out fp8-quality-dlrmv3-h200.json  # H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from layerflow.bench.environment import device_name, results_header
from layerflow.bench.quality import FP8_NAMES, QualitySettings, compare, markdown, to_dict
from layerflow.bench.settings import parse_lengths
from layerflow.model.config import PRESETS

GPU_DEFAULTS = dict(preset="hstu-bench", history_lens=(2048, 4096, 8192, 16384), users_per_length=16, append_len=64,
                    num_candidates=256)
CPU_DEFAULTS = dict(preset="tiny", history_lens=(256, 512, 1024, 1536), users_per_length=16, append_len=16,
                    num_candidates=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model (GPU: hstu-bench, CPU: tiny)")
    parser.add_argument("--history-lens", type=parse_lengths, help="cached history lengths, e.g. 2K,4K,8K,16K")
    parser.add_argument("--users-per-length", type=int, help="users at each history length (default 16)")
    parser.add_argument("--append-len", type=int, help="items appended on the return visit (GPU: 64)")
    parser.add_argument("--num-candidates", type=int, help="candidates scored on the return visit (GPU: 256)")
    parser.add_argument("--kv-cache-dtype", choices=FP8_NAMES, default="fp8_e4m3", help="the fp8 cache compared")
    parser.add_argument("--batch-size", type=int, default=8, help="return visits per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    picked = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in defaults.items()}
    settings = QualitySettings(**picked, kv_cache_dtype=args.kv_cache_dtype, batch_size=args.batch_size,
                               seed=args.seed)
    results = compare(settings, device)
    table = markdown(results, device_name(device))
    print(table)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**results_header(device), **to_dict(results), "table": table}, indent=1) + "\n")
    return 0 if results.passes else 1


if __name__ == "__main__":
    sys.exit(main())
