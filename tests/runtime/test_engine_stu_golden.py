"""The STU golden cases (generative-recommenders' own outputs) through the ENGINE with embeddings in: a prefill batch
of every user's history, then a cached batch of every user's delta (new tokens, then candidates), the KV paged on the
GPU pool in between (on a CPU machine the pool is host memory and the kernels are the torch references; on a GPU the
Triton kernels and CUDA graphs). GR's batch 1/N rule reproduces GR; the constant rule gives a full recompute.

Tolerances, relative to the case's largest output: float32 on the CPU path 3e-6 (as the reference tests); on the GPU
float32 through Triton (tf32-free, ieee dots) 2e-5 and bfloat16 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from layerflow.config import Config
from layerflow.model.checkpoint import import_state_dict
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import EmbeddingRequest
from tests.model.golden import CASES, GoldenCase, load_case
from tests.model.test_stu_golden import RELATIVE_TOLERANCE, assert_matches, full_delta, options

ENGINE_CASES = [c for c in CASES if c != "dlrmv3-small-1layer-f64"]   # the paged kernels take bf16/fp16/fp32


def through_engine(weights, case: GoldenCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill outputs, cached-step outputs) of the case's users, in the fixture's row order."""
    cached, appended, candidates = case.lengths()
    history, delta = case.tensors["inputs.history_x"], case.tensors["inputs.delta_x"]
    offsets = case.tensors["inputs.history_offsets"].tolist()
    d = case.meta["delta_size"]
    dtype = weights.config.dtype
    config = Config(page_size=16, gpu_cache_gb=0.05, cpu_cache_gb=0.05)
    with Engine(weights, config, device=device) as engine:
        first = engine.score([EmbeddingRequest(b, history[lo:hi].to(dtype), history[:0].to(dtype))
                              for b, (lo, hi) in enumerate(zip(offsets, offsets[1:]))])
        step = engine.score([EmbeddingRequest(b, delta[b * d:b * d + a].to(dtype), delta[b * d + a:(b + 1) * d].to(dtype))
                             for b, a in enumerate(appended)])
    prefill_out = torch.cat([r.new for r in first]).float()
    cached_out = torch.cat([torch.cat([r.new, r.candidates]) for r in step]).float()
    return prefill_out, cached_out


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_the_engine_reproduces_gr_with_the_batch_rule(name):
    case = load_case(name)
    weights = import_state_dict("gr-stu", case.state_dict, options(case, "batch"))
    prefill_out, cached_out = through_engine(weights, case, "cpu")
    assert_matches(prefill_out, case.tensors["outputs.prefill"], case, "engine prefill")
    assert_matches(cached_out, case.tensors["outputs.cached"], case, "engine cached step")


@pytest.mark.parametrize("name", ["dlrmv3-small", "dlrmv3-small-maxattn8", "dlrmv3-small-groupnorm"])
def test_the_engine_with_the_constant_rule_equals_a_full_recompute(name):
    case = load_case(name)
    weights = import_state_dict("gr-stu", case.state_dict, options(case, "constant"))
    _, cached_out = through_engine(weights, case, "cpu")
    full = full_delta(weights, case)
    assert (cached_out - full).abs().max().item() <= RELATIVE_TOLERANCE[torch.float32] * full.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["dlrmv3-shape"])
def test_the_engine_reproduces_gr_on_the_gpu(name, dtype, tolerance):
    case = load_case(name)
    weights = import_state_dict("gr-stu", case.state_dict, options(case, "batch"), dtype=dtype)
    if weights.config.dqk not in (64, 128, 256):
        pytest.skip(f"the Triton kernels take head dims 64/128/256, this case has {weights.config.dqk}")
    prefill_out, cached_out = through_engine(weights, case, "cuda")
    scale = case.tensors["outputs.full_delta"].abs().max().item()
    for got, want in ((prefill_out.cpu(), case.tensors["outputs.prefill"]), (cached_out.cpu(),
                                                                             case.tensors["outputs.cached"])):
        error = (got - want.float()).abs().max().item()
        assert error <= tolerance * scale, f"{name} {dtype}: max abs error {error:.3g} > {tolerance * scale:.3g}"
