"""Does q.k on fp8 MMAs keep the fp8 cache's quality gate? The quality run of benchmarks/fp8_quality.py
(layerflow.bench.quality: an fp8 engine against the engine of the model's dtype, same weights and workload) for each
of the fp8 Gluon kernel's `qk` choices: bf16 queries (the fp8 cache alone), one e4m3 term ("fp8"), two ("fp8x2").
On the CPU the fp8 engine's attention is the torch reference of the choice (paged_attention_reference's `q_terms`:
queries as e4m3 terms, the candidates' own keys quantised); on a GPU the engine is built under $LAYERFLOW_FP8_QK
(the kernel itself). One engine of the model's dtype serves all choices. Prints a table per choice; exit code 1 when
the choice named by --gate fails the gate.

    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --preset hstu-bench --history-lens 256,512,1024 \\
        --users-per-length 8
    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --device cuda --history-lens 2K,16K --users-per-length 4 \\
        --append-len 64 --num-candidates 256
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch

import layerflow.runtime.pipeline as pipeline
from layerflow.bench.quality import QualityResults, QualitySettings, markdown, results_of, run_engine, workload
from layerflow.bench.settings import parse_lengths
from layerflow.kernels.gluon_fp8_tiling import QK_ENV
from layerflow.kernels.reference import paged_attention_reference
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS

Q_TERMS = {"bf16": 0, "fp8": 1, "fp8x2": 2}


@contextlib.contextmanager
def qk_choice(choice: str, device: torch.device):
    """While the body runs: on the CPU the reference of `choice` as the engine's attention, on a GPU $LAYERFLOW_FP8_QK
    set to it (read when the engine builds its attention)."""
    saved = os.environ.get(QK_ENV)
    if device.type == "cuda":
        os.environ[QK_ENV] = choice
    else:
        pipeline.paged_attention_reference = functools.partial(paged_attention_reference, q_terms=Q_TERMS[choice])
    try:
        yield
    finally:
        pipeline.paged_attention_reference = paged_attention_reference
        os.environ.pop(QK_ENV, None)
        if saved is not None:
            os.environ[QK_ENV] = saved


def compared(settings: QualitySettings, choices: list[str],
             device: torch.device) -> Iterator[tuple[str, QualityResults]]:
    """Each `qk` choice's fp8 engine against one engine of the model's dtype, as each is done."""
    weights = HSTUWeights.init(settings.model, seed=settings.seed)
    visits = workload(settings)
    reference = run_engine(weights, settings, "auto", visits, device)
    for choice in choices:
        with qk_choice(choice, device):
            fp8 = run_engine(weights, settings, settings.kv_cache_dtype, visits, device)
        yield choice, results_of(settings, device, visits, fp8, reference)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="hstu-bench")
    parser.add_argument("--history-lens", type=parse_lengths, default=(256, 512, 1024))
    parser.add_argument("--users-per-length", type=int, default=8)
    parser.add_argument("--append-len", type=int, default=16)
    parser.add_argument("--num-candidates", type=int, default=100)
    parser.add_argument("--qk", nargs="+", choices=sorted(Q_TERMS), default=["bf16", "fp8", "fp8x2"])
    parser.add_argument("--gate", choices=sorted(Q_TERMS), default="fp8x2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    settings = QualitySettings(preset=args.preset, history_lens=args.history_lens,
                               users_per_length=args.users_per_length, append_len=args.append_len,
                               num_candidates=args.num_candidates)
    where = "reference emulation" if device.type == "cpu" else "the kernel"
    passes = {}
    for choice, result in compared(settings, list(dict.fromkeys(args.qk + [args.gate])), device):
        print(markdown(result, f"{device.type}, fp8 Gluon kernel's qk={choice} ({where})"), flush=True)
        passes[choice] = result.passes
    return 0 if passes[args.gate] else 1


if __name__ == "__main__":
    sys.exit(main())
