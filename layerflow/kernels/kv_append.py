"""Write the appended history tokens' K/V into their users' pages (candidates are never cached).

One program per token row of the capacity-sized k/v buffers; each finds its user from the device offsets and exits
unless it is an appended token, so the launch is graph capturable and independent of the batch's lengths.
The mask options change nothing here: every history token is cached at its position (the contextual prefix and the
tokens a window will stop reading included); K and V share one head dim (dqk == dv), like the paged cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_append_kernel(k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr,
                      k_stride, v_stride, page_table_stride, max_batch,
                      HD: tl.constexpr, HD_P2: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr):
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
    dst = cache_ptr + page * (2 * PAGE * HD) + (position % PAGE) * HD
    e = tl.arange(0, HD_P2)
    ok = e < HD
    row = token.to(tl.int64)
    tl.store(dst + e, tl.load(k_ptr + row * k_stride + e, mask=ok), mask=ok)
    tl.store(dst + PAGE * HD + e, tl.load(v_ptr + row * v_stride + e, mask=ok), mask=ok)


def kv_append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
              q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor) -> None:
    """Write appended token j of user b (row q_offsets[b] + j of k/v) to history position history_len - appended + j.

    The grid is k.shape[0] (the token capacity) and the batch is page_table.shape[0] users (q_offsets has one more
    entry); history_lens already include the appended tokens.
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
    if kv_cache.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"dtypes k {k.dtype}, v {v.dtype}, kv_cache {kv_cache.dtype}: must match")
    max_batch = page_table.shape[0]
    for name, t, n in (("q_offsets", q_offsets, max_batch + 1), ("history_lens", history_lens, max_batch),
                       ("appended_lens", appended_lens, max_batch)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} {t.dtype} shape {tuple(t.shape)}: expected int32 [{n}]")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError(f"page_table {page_table.dtype} shape {tuple(page_table.shape)}: expected int32 2D rows")
    page_size = kv_cache.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: must be a power of two")
    hd = k.shape[1] * k.shape[2]
    if k.shape[0] == 0:
        return
    _kv_append_kernel[(k.shape[0],)](
        k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, k.stride(0), v.stride(0),
        page_table.stride(0), max_batch,
        HD=hd, HD_P2=triton.next_power_of_2(hd), PAGE=page_size,
        BATCH_P2=max(2, triton.next_power_of_2(max_batch)),
        num_warps=4,
    )
