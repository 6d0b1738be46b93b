"""Write the appended history tokens' K/V into their users' pages (candidates are never cached).

One program per token row of the capacity-sized k/v buffers; each finds its user from the device offsets and exits
unless it is an appended token, so the launch is graph capturable and independent of the batch's lengths.
The mask options change nothing here: every history token is cached at its position (the contextual prefix and the
tokens a window will stop reading included); K and V share one head dim (dqk == dv), like the paged cache.
An fp8 cache's tokens are quantised here, each (token, head) row with its own scale (layerflow.kernels.fp8), so the
tokens a page already holds are never touched by a later append into it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerflow.kernels.fp8 import encode, kernel_code, power_of_two, scale_exponent
from layerflow.tier.layout import fp8_page_size


@triton.jit
def _append_quantised(src, dst, scale_dst, H: tl.constexpr, D: tl.constexpr, H_P2: tl.constexpr,
                      D_P2: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr):
    """One token's K (or V) row: per head, the scale byte to `scale_dst + h * PAGE` and the codes to `dst`."""
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)
    ok = (h[:, None] < H) & (d[None, :] < D)
    e = h[:, None] * D + d[None, :]
    x = tl.load(src + e, mask=ok, other=0.0).to(tl.float32)
    k = scale_exponent(tl.max(tl.abs(x), axis=1), FP8)
    tl.store(dst + e, encode(x * power_of_two(-k)[:, None], FP8), mask=ok)
    tl.store(scale_dst + h * PAGE, (k + 127).to(tl.uint8), mask=h < H)


@triton.jit
def _kv_append_kernel(k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr,
                      k_stride, v_stride, page_table_stride, max_batch,
                      HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                      ROWS: tl.constexpr, H: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr,
                      FP8: tl.constexpr):
    token = tl.program_id(0)
    users = tl.arange(0, BATCH_P2)
    valid = users < max_batch
    ends = tl.load(q_offsets_ptr + users + 1, mask=valid, other=0)
    user = tl.sum((valid & (ends <= token)).to(tl.int32), axis=0)
    if user >= max_batch:
        return
    j = token - tl.load(q_offsets_ptr + user)
    appended = tl.load(appended_lens_ptr + user)
    if j >= appended:
        return
    position = tl.load(history_lens_ptr + user) - appended + j
    page = tl.load(page_table_ptr + user * page_table_stride + position // PAGE).to(tl.int64)
    page_base = cache_ptr + page * (2 * ROWS * HD)
    dst = page_base + (position % PAGE) * HD
    row = token.to(tl.int64)
    if FP8 == 0:
        e = tl.arange(0, HD_P2)
        ok = e < HD
        tl.store(dst + e, tl.load(k_ptr + row * k_stride + e, mask=ok), mask=ok)
        tl.store(dst + PAGE * HD + e, tl.load(v_ptr + row * v_stride + e, mask=ok), mask=ok)
    else:
        scale_dst = page_base + PAGE * HD + position % PAGE     # scale bytes [H, PAGE] after the token rows
        _append_quantised(k_ptr + row * k_stride, dst, scale_dst, H, HD // H, H_P2, D_P2, PAGE, FP8)
        _append_quantised(v_ptr + row * v_stride, dst + ROWS * HD, scale_dst + ROWS * HD, H, HD // H, H_P2, D_P2,
                          PAGE, FP8)


def kv_append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
              q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor,
              kv_dtype: torch.dtype | None = None) -> None:
    """Write appended token j of user b (row q_offsets[b] + j of k/v) to history position history_len - appended + j.

    The grid is k.shape[0] (the token capacity) and the batch is page_table.shape[0] users (q_offsets has one more
    entry); history_lens already include the appended tokens. `kv_dtype` None: the cache holds k's dtype; an fp8
    dtype: the cache is uint8 pages of codes and scale rows, written by the rule of layerflow.kernels.fp8.
    """
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)}: expected equal [T, H, D]")
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} strides {t.stride()}: expected dense heads in each row (any row stride)")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]) \
            or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)}: expected contiguous [pages, 2, page_size, "
                         f"{k.shape[1]}, {k.shape[2]}]")
    stored = k.dtype if kv_dtype is None else torch.uint8
    if kv_cache.dtype != stored or v.dtype != k.dtype:
        raise ValueError(f"dtypes k {k.dtype}, v {v.dtype}, kv_cache {kv_cache.dtype}: must match (an fp8 kv_dtype: "
                         f"a uint8 kv_cache)")
    max_batch = page_table.shape[0]
    for name, t, n in (("q_offsets", q_offsets, max_batch + 1), ("history_lens", history_lens, max_batch),
                       ("appended_lens", appended_lens, max_batch)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} {t.dtype} shape {tuple(t.shape)}: expected int32 [{n}]")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError(f"page_table {page_table.dtype} shape {tuple(page_table.shape)}: expected int32 2D rows")
    rows, heads, dim = kv_cache.shape[2:]
    page_size = rows if kv_dtype is None else fp8_page_size(rows, dim)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: must be a power of two")
    hd = heads * dim
    if k.shape[0] == 0:
        return
    _kv_append_kernel[(k.shape[0],)](
        k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, k.stride(0), v.stride(0),
        page_table.stride(0), max_batch,
        HD=hd, HD_P2=triton.next_power_of_2(hd), PAGE=page_size,
        BATCH_P2=max(2, triton.next_power_of_2(max_batch)),
        ROWS=rows, H=heads, H_P2=triton.next_power_of_2(heads), D_P2=triton.next_power_of_2(dim),
        FP8=kernel_code(kv_dtype),
        num_warps=4,
    )
