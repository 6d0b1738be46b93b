"""Do q.k and the V dot on fp8 MMAs keep the fp8 cache's quality gate? The quality run of benchmarks/fp8_quality.py
(layerflow.bench.quality: an fp8 engine against the engine of the model's dtype, same weights and workload) for each
pair of a `qk` choice (bf16 queries: the fp8 cache alone; one e4m3 term, "fp8"; two, "fp8x2") and a `pv` choice (the
weights in bf16 over decoded V; one e4m3 term per row and tile over V codes, "fp8"; two, "fp8x2"; "-run": the
scale of each tile the row's running maximum). On the CPU the fp8 engine's attention is the torch reference of the
pair (paged_attention_reference's `q_terms` and `p_terms`). On a GPU the engine runs the kernel under
$LAYERFLOW_FP8_QK (pv bf16 only: no kernel runs the V dot on fp8 MMAs yet), or with --emulate the reference as its
attention, eagerly (the reference cannot be captured): how a pair no kernel runs yet is judged at the GPU's
workload sizes. One engine of the model's dtype (its kernels) serves all pairs. Prints a table per pair; exit code 1
when the pair named by --gate fails the gate.

    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --preset hstu-bench --history-lens 256,512,1024 \\
        --users-per-length 8
    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --device cuda --history-lens 2K,16K --users-per-length 4 \\
        --append-len 64 --num-candidates 256
    PYTHONPATH=. python3 benchmarks/fp8_q_quality.py --device cuda --emulate --qk fp8x2 --pv bf16 fp8 --gate fp8x2 fp8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch

import layerflow.kernels.reference as reference
import layerflow.runtime.pipeline as pipeline
from layerflow.bench.quality import QualityResults, QualitySettings, markdown, results_of, run_engine, workload
from layerflow.bench.settings import parse_lengths
from layerflow.kernels.gluon_fp8_tiling import QK_ENV
from layerflow.kernels.reference import paged_attention_reference
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.model.mask import attention_mask

Q_TERMS = {"bf16": 0, "fp8": 1, "fp8x2": 2}
P_TERMS = {"bf16": (0, False), "fp8": (1, False), "fp8x2": (2, False), "fp8-run": (1, True), "fp8x2-run": (2, True)}
KERNEL_ATTEND = pipeline.TritonKernels.attend
SHARED_MASKS = functools.lru_cache(maxsize=8)(attention_mask)   # users of one length share theirs (16K: 4 s a build)


@contextlib.contextmanager
def fp8_choice(qk: str, pv: str, kernel: bool):
    """While the body runs: with `kernel`, $LAYERFLOW_FP8_QK set to `qk` (read when a GPU engine builds its
    attention; `pv` must be bf16); else the reference of the pair as the engine's attention, on a GPU too."""
    if kernel and pv != "bf16":
        raise ValueError(f"pv={pv!r}: no kernel runs it yet (pass --emulate)")
    saved = os.environ.get(QK_ENV)
    if kernel:
        os.environ[QK_ENV] = qk
    else:
        p_terms, running = P_TERMS[pv]
        pipeline.paged_attention_reference = functools.partial(paged_attention_reference, q_terms=Q_TERMS[qk],
                                                               p_terms=p_terms, p_running=running)
        pipeline.TritonKernels.attend = pipeline.ReferenceKernels.attend
        reference.attention_mask = SHARED_MASKS
    try:
        yield
    finally:
        pipeline.paged_attention_reference = paged_attention_reference
        pipeline.TritonKernels.attend = KERNEL_ATTEND
        reference.attention_mask = attention_mask
        os.environ.pop(QK_ENV, None)
        if saved is not None:
            os.environ[QK_ENV] = saved


def compared(settings: QualitySettings, choices: list[tuple[str, str]], device: torch.device,
             emulate: bool) -> Iterator[tuple[tuple[str, str], QualityResults]]:
    """Each (qk, pv) pair's fp8 engine against one engine of the model's dtype, as each is done."""
    weights = HSTUWeights.init(settings.model, seed=settings.seed)
    visits = workload(settings)
    reference = run_engine(weights, settings, "auto", visits, device)
    kernel = device.type == "cuda" and not emulate
    for choice in choices:
        with fp8_choice(*choice, kernel):
            fp8 = run_engine(weights, settings, settings.kv_cache_dtype, visits, device, use_cuda_graph=kernel)
        yield choice, results_of(settings, device, visits, fp8, reference)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="hstu-bench")
    parser.add_argument("--history-lens", type=parse_lengths, default=(256, 512, 1024))
    parser.add_argument("--users-per-length", type=int, default=8)
    parser.add_argument("--append-len", type=int, default=16)
    parser.add_argument("--num-candidates", type=int, default=100)
    parser.add_argument("--qk", nargs="+", choices=sorted(Q_TERMS), default=["bf16", "fp8", "fp8x2"])
    parser.add_argument("--pv", nargs="+", choices=sorted(P_TERMS), default=["bf16"])
    parser.add_argument("--gate", nargs=2, metavar=("QK", "PV"), default=["fp8x2", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--emulate", action="store_true", help="on a GPU: the reference of each pair, not the kernel")
    args = parser.parse_args()
    device = torch.device(args.device)
    settings = QualitySettings(preset=args.preset, history_lens=args.history_lens,
                               users_per_length=args.users_per_length, append_len=args.append_len,
                               num_candidates=args.num_candidates)
    emulated = device.type == "cpu" or args.emulate
    where = "reference emulation" if emulated else "the kernel"
    gate = tuple(args.gate)
    if gate[0] not in Q_TERMS or gate[1] not in P_TERMS:
        raise ValueError(f"--gate {' '.join(gate)}: expected a qk of {sorted(Q_TERMS)} and a pv of {sorted(P_TERMS)}")
    pairs = list(dict.fromkeys([(qk, pv) for qk in args.qk for pv in args.pv] + [gate]))
    passes = {}
    for (qk, pv), result in compared(settings, pairs, device, args.emulate):
        print(markdown(result, f"{device.type}, fp8 Gluon kernel's qk={qk} pv={pv} ({where})"), flush=True)
        passes[qk, pv] = result.passes
    return 0 if passes[gate] else 1


if __name__ == "__main__":
    sys.exit(main())
