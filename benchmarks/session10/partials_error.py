"""Scores of the same workload with the attention's split partials stored in fp32 (the default) and in 16 bits
(LAYERFLOW_ATTENTION_PARTIALS), on the same weights: layerflow.bench.quality's workload and agreement measures.

    python3 benchmarks/session10/partials_error.py --history-lens 2048 16384 --users 8 --partials fp16 bf16
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from layerflow.bench.agreement import Agreement
from layerflow.bench.quality import QualitySettings, run_engine, workload
from layerflow.kernels.attention import PARTIALS_ENV
from layerflow.model import HSTUWeights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="hstu-bench")
    parser.add_argument("--history-lens", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--partials", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = QualitySettings(args.preset, tuple(args.history_lens), args.users, 64, 256)
    weights, visits, device = HSTUWeights.init(settings.model, seed=0), workload(settings), torch.device(args.device)
    os.environ[PARTIALS_ENV] = "fp32"
    reference = run_engine(weights, settings, "auto", visits, device)
    rows = {}
    for name in args.partials:
        os.environ[PARTIALS_ENV] = name
        scores = run_engine(weights, settings, "auto", visits, device)
        rows[name] = Agreement.of(scores, reference).to_dict()
        print(name, json.dumps(rows[name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python3 benchmarks/session10/partials_error.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if v is not None and k != "out"),
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
