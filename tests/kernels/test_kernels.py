"""Paged attention and KV append against their torch references, on small shapes.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import (AttentionTiling, PagedAttention, kv_append, kv_append_reference,  # noqa: E402
                               paged_attention_reference)
from layerflow.kernels.pointwise import gated_layer_norm, gated_layer_norm_reference  # noqa: E402
from layerflow.model.mask import MaskRule  # noqa: E402
from tests.kernels.paged_batch import make_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA, MAX_SEQ_LEN = 0.125, 300
SMALL = AttentionTiling(block_m=16, block_n=16, num_warps=4, num_stages=1)

# Ragged: a 0-history user with candidates only, a user whose appended tokens span a page boundary, a 1-token user,
# a user with appended tokens only and a history that is not a multiple of the page size, an empty user.
RAGGED = dict(history_lens=[0, 37, 1, 20, 0], appended_lens=[0, 3, 1, 20, 0], candidate_lens=[3, 2, 0, 0, 0])


def attention_vs_reference(lengths: dict, *, num_heads: int, head_dim: int, page_size: int, tiling: AttentionTiling,
                           dtype: torch.dtype = torch.float32, max_batch: int | None = None,
                           max_tokens: int | None = None, mask: MaskRule = MaskRule(),
                           inv_n: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    batch = make_paged_batch(**lengths, num_heads=num_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                             device=DEVICE, max_batch=max_batch, max_tokens=max_tokens)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    attn = PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], num_heads,
                          head_dim, page_size, dtype, DEVICE, ALPHA, MAX_SEQ_LEN, tiling=tiling, mask=mask)
    out = torch.full_like(batch.q, 7.0)
    attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, out, inv_n)
    scale = dict(max_seq_len=MAX_SEQ_LEN) if inv_n is None else dict(inv_n=inv_n)
    expected = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                         torch.full_like(batch.q, 7.0), alpha=ALPHA, mask=mask, **scale)
    return out, expected, batch.total_tokens


@pytest.mark.parametrize("num_splits,preload", [(1, False), (3, False), (1, True), (3, True)])
def test_ragged_batch_matches_reference(num_splits, preload):
    tiling = AttentionTiling(16, 16, 4, 1, preload_pages=preload, num_splits=num_splits)
    out, expected, total = attention_vs_reference(RAGGED, num_heads=2, head_dim=64, page_size=16, tiling=tiling,
                                                  max_batch=6, max_tokens=40)
    assert torch.isfinite(out[:total]).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)
    assert (out[total:] == 7.0).all()     # rows past the batch are not written


def test_many_candidates_span_query_blocks():
    lengths = dict(history_lens=[45, 9], appended_lens=[20, 9], candidate_lens=[30, 21])
    out, expected, _ = attention_vs_reference(lengths, num_heads=1, head_dim=64, page_size=16,
                                              tiling=AttentionTiling(16, 16, 4, 1, num_splits=2))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("page_size,head_dim,preload", [(16, 128, True), (32, 64, False), (64, 256, True),
                                                        (128, 64, False)])
def test_page_sizes_and_head_dims(page_size, head_dim, preload):
    lengths = dict(history_lens=[2 * page_size + 5, 3], appended_lens=[4, 3], candidate_lens=[2, 1])
    tiling = AttentionTiling(16, 16, 4, 1, preload_pages=preload, num_splits=2)
    out, expected, _ = attention_vs_reference(lengths, num_heads=1, head_dim=head_dim, page_size=page_size,
                                              tiling=tiling)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


def test_default_tiling_and_split_choice():
    out, expected, _ = attention_vs_reference(RAGGED, num_heads=2, head_dim=64, page_size=32, tiling=None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


def test_splits_fill_whole_waves():
    def splits(max_tokens: int, heads: int, programs_per_sm: int = 1) -> int:
        tiling = AttentionTiling(64, 64, 4, 2, programs_per_sm=programs_per_sm)
        return PagedAttention(1, max_tokens, 512, heads, 64, 32, torch.bfloat16, "cpu", ALPHA, MAX_SEQ_LEN,
                              tiling=tiling).num_splits
    # Without CUDA the device counts as 4 SMs. One 64-token block x 4 heads fills them with 1 split.
    assert splits(64, 4) == 1 and splits(64, 4, programs_per_sm=2) == 2
    assert splits(64, 1) == 4
    assert splits(2 * 64, 3) == 2        # 6 programs leave a wave half idle; 12 fill 3 waves


def test_half_precision_close_to_fp32_reference():
    lengths = dict(history_lens=[40], appended_lens=[8], candidate_lens=[4])
    batch = make_paged_batch(**lengths, num_heads=2, head_dim=64, page_size=16, dtype=torch.float16, device=DEVICE)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    attn = PagedAttention(1, batch.q.shape[0], batch.page_table.shape[1], 2, 64, 16, torch.float16, DEVICE, ALPHA,
                          MAX_SEQ_LEN, tiling=AttentionTiling(16, 16, 4, 1, num_splits=2))
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(batch.q))
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    expected = paged_attention_reference(*f32, *batch.lengths, torch.empty_like(f32[0]), alpha=ALPHA,
                                         max_seq_len=MAX_SEQ_LEN)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-5)


def test_kv_append_writes_exactly_the_appended_slots():
    lengths = dict(history_lens=[0, 37, 1, 20, 50], appended_lens=[0, 3, 1, 20, 0], candidate_lens=[3, 2, 0, 0, 4])
    batch = make_paged_batch(**lengths, num_heads=2, head_dim=64, page_size=16, dtype=torch.float32, device=DEVICE,
                             max_batch=6, max_tokens=40, poison=-1234.0)
    before = batch.kv_cache.clone()
    expected = batch.kv_cache.clone()
    kv_append_reference(batch.k, batch.v, expected, *batch.lengths)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    assert torch.equal(batch.kv_cache, expected)
    changed = (batch.kv_cache != before).any(dim=(1, 3, 4)).sum().item()
    assert changed == 3 + 1 + 20                  # slots (page, position) of appended tokens, no candidates


def as_projection_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of [T, H, D] tensors as column slices of one wider [T, (n + 1) H D] tensor, as the input projection
    splits them (row stride > H * D)."""
    t, h, d = tensors[0].shape
    wide = torch.full((t, (len(tensors) + 1) * h * d), float("nan"), dtype=tensors[0].dtype, device=DEVICE)
    views = []
    for i, x in enumerate(tensors):
        view = wide[:, (i + 1) * h * d:(i + 2) * h * d].view(t, h, d)
        view.copy_(x)
        views.append(view)
    return views


def test_kernels_read_row_strided_projection_views():
    batch = make_paged_batch(**RAGGED, num_heads=2, head_dim=64, page_size=16, dtype=torch.float32, device=DEVICE,
                             max_batch=6, max_tokens=40, poison=-1234.0)
    q, k, v = as_projection_views(batch.q, batch.k, batch.v)
    assert not q.is_contiguous() and q.stride(0) == 4 * 2 * 64
    strided_cache = batch.kv_cache.clone()
    kv_append(k, v, strided_cache, *batch.lengths)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    assert torch.equal(strided_cache, batch.kv_cache)
    attn = PagedAttention(6, 40, batch.page_table.shape[1], 2, 64, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN,
                          tiling=AttentionTiling(16, 16, 4, 1, num_splits=2))
    strided_out, dense_out = torch.zeros_like(batch.q), torch.zeros_like(batch.q)
    attn.run(q, k, v, batch.kv_cache, *batch.lengths, strided_out)
    attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, dense_out)
    assert torch.equal(strided_out, dense_out)
    with pytest.raises(ValueError, match="out strides"):
        attn.run(q, k, v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q).transpose(1, 2)
                 .contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="k strides"):
        kv_append(batch.k.transpose(1, 2).contiguous().transpose(1, 2), batch.v, batch.kv_cache, *batch.lengths)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="page_size=24"):
        PagedAttention(1, 8, 2, 1, 64, 24, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="head_dim=96"):
        PagedAttention(1, 8, 2, 1, 96, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN)
    attn = PagedAttention(1, 8, 2, 1, 64, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, tiling=SMALL)
    batch = make_paged_batch([4], [4], [0], num_heads=1, head_dim=64, page_size=16, dtype=torch.float32,
                             device=DEVICE)
    with pytest.raises(ValueError, match="q dtype"):
        attn.run(batch.q.double(), batch.k, batch.v, batch.kv_cache, *batch.lengths, batch.q)
    with pytest.raises(ValueError, match="q_offsets dtype"):
        attn.run(batch.q, batch.k, batch.v, batch.kv_cache, batch.page_table, batch.q_offsets.long(),
                 batch.history_lens, batch.appended_lens, batch.q)


def test_gated_layer_norm_matches_reference():
    gen = torch.Generator().manual_seed(0)
    u, a = (torch.randn(5, 48, generator=gen).to(DEVICE) for _ in range(2))
    weight, bias = torch.randn(48, generator=gen).to(DEVICE), torch.randn(48, generator=gen).to(DEVICE)
    torch.testing.assert_close(gated_layer_norm(u, a, weight, bias, 1e-6),
                               gated_layer_norm_reference(u, a, weight, bias, 1e-6), rtol=1e-5, atol=1e-6)


def test_gated_layer_norm_reads_u_as_a_column_slice():
    """The pipeline passes u as the first columns of the fused uvqk projection (row stride > width)."""
    gen = torch.Generator().manual_seed(1)
    uvqk = torch.randn(6, 4 * 48, generator=gen).to(DEVICE)
    u, a = uvqk[:, :48], torch.randn(6, 48, generator=gen).to(DEVICE)
    weight, bias = torch.randn(48, generator=gen).to(DEVICE), torch.randn(48, generator=gen).to(DEVICE)
    assert not u.is_contiguous()
    torch.testing.assert_close(gated_layer_norm(u, a, weight, bias, 1e-6),
                               gated_layer_norm_reference(u, a, weight, bias, 1e-6), rtol=1e-5, atol=1e-6)
