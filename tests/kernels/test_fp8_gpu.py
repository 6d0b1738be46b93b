"""The fp8 kernels at real sizes on a GPU: the append bit for bit against the torch rule, the attention over fp8
pages against its reference and close to the exact cache, and one CUDA graph replaying like eager."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, kv_append, kv_append_reference
from layerflow.kernels import paged_attention_reference
from layerflow.tier.layout import FP8_DTYPES
from tests.kernels.cuda_graph import captured, replay_on
from tests.kernels.paged_batch import PagedBatch, make_paged_batch, quantised_batch
from tests.kernels.test_kernels_gpu import ALPHA, D, H, MAX_SEQ_LEN, PAGE, assert_bf16_close

pytestmark = pytest.mark.gpu


def fp8_batch(history_lens, candidates, kv_dtype, **kw) -> tuple[PagedBatch, PagedBatch]:
    """(the fp8 batch, the same batch with the exact bf16 cache), both after their appends."""
    n = len(history_lens)
    exact = make_paged_batch([h + 64 for h in history_lens], [64] * n, [candidates] * n, num_heads=H, head_dim=D,
                             page_size=PAGE, dtype=torch.bfloat16, device="cuda", **kw)
    batch = quantised_batch(exact, kv_dtype, PAGE)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    kv_append(exact.k, exact.v, exact.kv_cache, *exact.lengths)
    return batch, exact


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_append_at_real_sizes_is_the_reference_bit_for_bit(kv_dtype):
    exact = make_paged_batch([4096 + 64, 300], [64, 300], [256, 8], num_heads=H, head_dim=D, page_size=PAGE,
                             dtype=torch.bfloat16, device="cuda")
    batch = quantised_batch(exact, kv_dtype, PAGE)
    expected = batch.kv_cache.clone()
    kv_append_reference(batch.k, batch.v, expected, *batch.lengths, kv_dtype=kv_dtype)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    assert torch.equal(batch.kv_cache, expected)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("history_lens", [[16384], [2048, 16384, 4096, 8192]], ids=["bs1-16k", "bs4-2k-16k"])
@pytest.mark.parametrize("preload", [False, True])
def test_attention_over_fp8_pages_matches_its_reference(kv_dtype, history_lens, preload):
    batch, exact = fp8_batch(history_lens, 256, kv_dtype)
    n = len(history_lens)
    tiling = replace(default_tiling(D, torch.bfloat16, 64 + 256), preload_pages=preload)
    attn = PagedAttention(n, batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE, torch.bfloat16, "cuda", ALPHA,
                          MAX_SEQ_LEN, tiling=tiling, kv_dtype=kv_dtype)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(batch.q))
    f32 = [t.float() for t in (batch.q, batch.k, batch.v)]
    expected = paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]), alpha=ALPHA,
                                         max_seq_len=MAX_SEQ_LEN, kv_dtype=kv_dtype)
    assert_bf16_close(out, expected, batch.total_tokens)
    f32 = [t.float() for t in (exact.q, exact.k, exact.v, exact.kv_cache)]
    unquantised = paged_attention_reference(*f32, *exact.lengths, torch.zeros_like(f32[0]), alpha=ALPHA,
                                            max_seq_len=MAX_SEQ_LEN)
    total = batch.total_tokens
    error = (out[:total].float() - unquantised[:total]).norm() / unquantised[:total].norm()
    assert error < (0.05 if kv_dtype == torch.float8_e4m3fn else 0.1), f"relative error {error:.3g} vs exact"


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("mma", ["fp16", "fp16v"])
def test_fp16_mmas_at_real_sizes_match_the_reference_even_past_fp16_range(mma, kv_dtype, candidates):
    """q.k (and with fp16v the V dot) on fp16 MMAs for bf16 queries scaled far past fp16's range (alpha scaled
    back)."""
    batch, _ = fp8_batch([16384], candidates, kv_dtype)
    q, alpha = batch.q * 2.0 ** 20, ALPHA * 2.0 ** -20
    attn = PagedAttention(1, batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE, torch.bfloat16, "cuda", alpha,
                          MAX_SEQ_LEN, tiling=default_tiling(D, torch.bfloat16, 64 + candidates), kv_dtype=kv_dtype,
                          fp8_mma=mma)
    assert attn.fp16_scores and (attn.value_unit > 1) == (mma == "fp16v")
    out = attn.run(q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(q))
    f32 = [t.float() for t in (q, batch.k, batch.v)]
    expected = paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]), alpha=alpha,
                                         max_seq_len=MAX_SEQ_LEN, kv_dtype=kv_dtype)
    assert_bf16_close(out, expected, batch.total_tokens)


def test_one_graph_replays_fp8_pages_like_eager():
    kv_dtype = torch.float8_e4m3fn
    max_batch, max_tokens, max_pages = 4, 4 * 320, 16384 // PAGE + 4
    num_pages = 2 * (16384 // PAGE) + 64
    cases = [([16384], 256), ([2048, 5000, 64, 8192], 100)]

    def batch_of(case) -> PagedBatch:
        """The case before its append: cached history in fp8 pages, the appended tokens in k/v."""
        hist, cands = case
        lens = [h + 64 for h in hist]
        spare = num_pages - sum(-(-h // PAGE) for h in lens)
        exact = make_paged_batch(lens, [64] * len(hist), [cands] * len(hist), num_heads=H, head_dim=D,
                                 page_size=PAGE, dtype=torch.bfloat16, device="cuda", max_batch=max_batch,
                                 max_tokens=max_tokens, max_pages_per_user=max_pages, spare_pages=spare,
                                 seed=len(hist))
        return quantised_batch(exact, kv_dtype, PAGE)

    attn = PagedAttention(max_batch, max_tokens, max_pages, H, D, PAGE, torch.bfloat16, "cuda", ALPHA, MAX_SEQ_LEN,
                          tiling=default_tiling(D, torch.bfloat16, max_tokens // max_batch), kv_dtype=kv_dtype)
    static = batch_of(cases[0])
    static_out = torch.zeros_like(static.q)

    def step() -> None:
        kv_append(static.k, static.v, static.kv_cache, *static.lengths, kv_dtype=kv_dtype)
        attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out)

    graph = captured(step)
    for case in cases:
        batch = batch_of(case)
        kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
        eager = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
        replay_on(graph, static, batch_of(case), static_out)
        assert torch.equal(static_out, eager), f"graph replay differs from eager for {case}"
        assert torch.equal(static.kv_cache, batch.kv_cache)
