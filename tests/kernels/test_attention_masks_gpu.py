"""The paged attention's mask options and device 1/N on a GPU: bf16, fp16 and fp32 against the fp32 reference at
DLRMv3's head shape, and one CUDA graph replayed with a different N (and window user) per batch."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, kv_append, paged_attention_reference
from layerflow.model.mask import MaskRule
from tests.kernels.cuda_graph import captured
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = pytest.mark.gpu

H, D, PAGE = 4, 128, 32
ALPHA, MAX_SEQ_LEN = D ** -0.5, 16384 + 2048
MASKS = [MaskRule(), MaskRule(contextual_len=3), MaskRule(max_attn_len=512),
         MaskRule(contextual_len=3, max_attn_len=512)]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def reference_fp32(batch: PagedBatch, mask: MaskRule, inv_n: torch.Tensor) -> torch.Tensor:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    return paged_attention_reference(*f32, *batch.lengths, torch.zeros_like(f32[0]), alpha=ALPHA, inv_n=inv_n,
                                     mask=mask)


def assert_close(out: torch.Tensor, expected: torch.Tensor, total: int, dtype: torch.dtype) -> None:
    out, expected = out[:total].float(), expected[:total]
    assert torch.isfinite(out).all()
    relative = (out - expected).norm() / expected.norm()
    assert relative < TOLERANCE[dtype], f"{dtype}: relative error {relative:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mask", MASKS, ids=["plain", "ctx3", "window512", "ctx3-window512"])
def test_mask_options_match_fp32_reference(dtype, mask):
    history = [4096 + 64, 300, 2, 1500 + 64]
    batch = make_paged_batch(history, [64, 17, 2, 64], [256, 3, 4, 0], num_heads=H, head_dim=D, page_size=PAGE,
                             dtype=dtype, device="cuda")
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    inv_n = torch.tensor([1.0 / (max(history) + 256)], device="cuda")
    attn = PagedAttention(4, batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE, dtype, "cuda", ALPHA,
                          MAX_SEQ_LEN, mask=mask)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(batch.q), inv_n)
    assert_close(out, reference_fp32(batch, mask, inv_n), batch.total_tokens, dtype)


@pytest.mark.parametrize("preload", [False, True])
def test_one_graph_serves_a_new_n_per_batch(preload):
    mask = MaskRule(contextual_len=3, max_attn_len=1024)
    max_batch, max_tokens, max_pages, num_pages = 2, 2 * 320, 8192 // PAGE + 4, 2 * (8192 // PAGE) + 64
    cases = [([8192 + 64, 100], [64, 4], [256, 16]), ([3000, 64], [1, 64], [256, 0])]

    def batch_of(case, seed: int) -> PagedBatch:
        pages = sum(-(-h // PAGE) for h in case[0])
        return make_paged_batch(*case, num_heads=H, head_dim=D, page_size=PAGE, dtype=torch.bfloat16, device="cuda",
                                max_batch=max_batch, max_tokens=max_tokens, max_pages_per_user=max_pages,
                                spare_pages=num_pages - pages, seed=seed)

    tiling = replace(default_tiling(D, torch.bfloat16, max_tokens // max_batch), preload_pages=preload)
    attn = PagedAttention(max_batch, max_tokens, max_pages, H, D, PAGE, torch.bfloat16, "cuda", ALPHA, MAX_SEQ_LEN,
                          tiling=tiling, mask=mask)
    static, inv_n = batch_of(cases[0], 0), torch.ones(max_batch, device="cuda")
    static_out = torch.zeros_like(static.q)

    def step() -> None:
        kv_append(static.k, static.v, static.kv_cache, *static.lengths)
        attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out, inv_n)

    graph = captured(step)

    for seed, case in enumerate(cases):
        n = [max(case[0]) + max(a + c for a, c in zip(case[1], case[2]))] * max_batch
        fresh = batch_of(case, seed + 1)
        for name in ("q", "k", "v", "kv_cache", "page_table", "q_offsets", "history_lens", "appended_lens"):
            getattr(static, name).copy_(getattr(fresh, name))
        inv_n.copy_(torch.tensor([1.0 / x for x in n]))
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        eager = batch_of(case, seed + 1)
        kv_append(eager.k, eager.v, eager.kv_cache, *eager.lengths)
        expected = attn.run(eager.q, eager.k, eager.v, eager.kv_cache, *eager.lengths, torch.zeros_like(eager.q),
                            inv_n.clone())
        assert torch.equal(static_out, expected), f"graph replay differs from eager for {case}"
        assert_close(expected, reference_fp32(eager, mask, inv_n), eager.total_tokens, torch.bfloat16)
