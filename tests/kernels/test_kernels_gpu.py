"""The Triton kernels at real sizes on a GPU: bf16 against the fp32 reference, and one CUDA graph across lengths."""

import pytest
import torch

from dataclasses import replace

from layerflow.kernels import PagedAttention, default_tiling, kv_append, paged_attention_reference
from tests.kernels.cuda_graph import captured, replay_on
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = pytest.mark.gpu

H, D, PAGE = 4, 256, 32
ALPHA, MAX_SEQ_LEN = D ** -0.5, 16384 + 512


def reference_fp32(batch: PagedBatch) -> torch.Tensor:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    return paged_attention_reference(*f32, *batch.lengths, torch.zeros_like(f32[0]), alpha=ALPHA,
                                     max_seq_len=MAX_SEQ_LEN)


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor, total: int) -> None:
    out, expected = out[:total].float(), expected[:total]
    assert torch.isfinite(out).all()
    relative = (out - expected).norm() / expected.norm()
    assert relative < 1e-2, f"relative error {relative:.3g}"
    assert (out - expected).abs().max() < 3e-2 * expected.abs().max()


@pytest.mark.parametrize("history_lens", [[16384], [2048, 16384, 4096, 8192, 3000, 12000, 6000, 10000]],
                         ids=["bs1-16k", "bs8-2k-16k"])
@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("preload", [False, True])
def test_real_sizes_bf16_match_fp32_reference(history_lens, candidates, preload):
    n = len(history_lens)
    batch = make_paged_batch([h + 64 for h in history_lens], [64] * n, [candidates] * n, num_heads=H, head_dim=D,
                             page_size=PAGE, dtype=torch.bfloat16, device="cuda")
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    tiling = replace(default_tiling(D, torch.bfloat16, 64 + candidates), preload_pages=preload)
    attn = PagedAttention(n, batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE, torch.bfloat16, "cuda",
                          ALPHA, MAX_SEQ_LEN, tiling=tiling)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(batch.q))
    assert_bf16_close(out, reference_fp32(batch), batch.total_tokens)


@pytest.mark.parametrize("preload", [False, True])
def test_one_graph_replays_any_lengths_like_eager(preload):
    max_batch, max_tokens, max_pages, num_pages = 4, 4 * 320, 16384 // PAGE + 4, 2 * (16384 // PAGE) + 64
    cases = [
        ([16384 + 64], [64], [256]),
        ([2048, 5000, 64, 8192], [64, 64, 64, 1], [256, 0, 100, 256]),
        ([0, 300], [0, 17], [256, 3]),
    ]

    def batch_of(case) -> PagedBatch:
        pages = sum(-(-h // PAGE) for h in case[0])
        return make_paged_batch(*case, num_heads=H, head_dim=D, page_size=PAGE, dtype=torch.bfloat16,
                                device="cuda", max_batch=max_batch, max_tokens=max_tokens,
                                max_pages_per_user=max_pages, spare_pages=num_pages - pages, seed=len(case[0]))

    tiling = replace(default_tiling(D, torch.bfloat16, max_tokens // max_batch), preload_pages=preload)
    attn = PagedAttention(max_batch, max_tokens, max_pages, H, D, PAGE, torch.bfloat16, "cuda", ALPHA, MAX_SEQ_LEN,
                          tiling=tiling)
    static = batch_of(cases[0])
    static_out = torch.zeros_like(static.q)

    def step() -> None:
        kv_append(static.k, static.v, static.kv_cache, *static.lengths)
        attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out)

    graph = captured(step)

    for case in cases:
        batch = batch_of(case)
        kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
        eager = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
        replay_on(graph, static, batch_of(case), static_out)
        assert torch.equal(static_out, eager), f"graph replay differs from eager for {case}"
        assert_bf16_close(eager, reference_fp32(batch), batch.total_tokens)
