"""Write the appended history tokens' K/V into their users' pages (candidates are never cached).

One program per token row of the capacity-sized k/v buffers; each finds its user from the device offsets and exits
unless it is an appended token, so the launch is graph capturable and independent of the batch's lengths.
The mask options change nothing here: every history token is cached at its position (the contextual prefix and the
tokens a window will stop reading included); K and V share one head dim (dqk == dv), like the paged cache.
An fp8 cache's tokens are quantised here, each (token, head) row with its own scale (layerflow.kernels.fp8), so the
tokens a page already holds are never touched by a later append into it.
`activated_kv_append` also applies the layer's SiLU in place to the batch's rows of the fused projection it is given,
so the activation costs no kernel of its own: each row is read once, its K and V written to the pages already
activated, and the rows past the batch (a bucket's padding, which nothing reads) are left as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from layerflow.kernels.fp8 import encode, kernel_code, power_of_two, scale_exponent
from layerflow.tier.layout import fp8_page_size


@triton.jit
def _silu(x, LIBDEVICE: tl.constexpr):
    """torch's x / (1 + exp(-x)) in fp32 with an IEEE exp and division (libdevice's expf on the GPU, as torch's kernel
    calls it; numpy's in the interpreter), rounded to x's dtype: what torch.nn.functional.silu stores."""
    f = x.to(tl.float32)
    if LIBDEVICE:
        expm = libdevice.exp(-f)
    else:
        expm = tl.exp(-f)
    return tl.math.div_rn(f, 1.0 + expm).to(x.dtype)


@triton.jit
def _user_of(q_offsets_ptr, token, max_batch, BATCH_P2: tl.constexpr):
    """The user whose query rows hold `token` (max_batch for a row past the batch)."""
    users = tl.arange(0, BATCH_P2)
    valid = users < max_batch
    ends = tl.load(q_offsets_ptr + users + 1, mask=valid, other=0)
    return tl.sum((valid & (ends <= token)).to(tl.int32), axis=0)


@triton.jit
def _append_quantised(x, dst, scale_dst, h, ok, e, H: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr):
    """One token's K (or V) row x [H_P2, D_P2]: per head, the scale byte to `scale_dst + h * PAGE` and the codes to
    `dst + e`."""
    f = x.to(tl.float32)
    k = scale_exponent(tl.max(tl.abs(f), axis=1), FP8)
    tl.store(dst + e, encode(f * power_of_two(-k)[:, None], FP8), mask=ok)
    tl.store(scale_dst + h * PAGE, (k + 127).to(tl.uint8), mask=h < H)


@triton.jit
def _write_token(k, v, cache_ptr, page, slot, h, ok, e, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 PAGE: tl.constexpr, FP8: tl.constexpr):
    """One token's K and V rows into `slot` of `page`, as codes and scales when the pages are fp8."""
    page_base = cache_ptr + page * (2 * ROWS * H * D)
    dst = page_base + slot * (H * D)
    if FP8 == 0:
        tl.store(dst + e, k, mask=ok)
        tl.store(dst + PAGE * H * D + e, v, mask=ok)
    else:
        scale_dst = page_base + PAGE * H * D + slot     # scale bytes [H, PAGE] after the token rows
        _append_quantised(k, dst, scale_dst, h, ok, e, H, PAGE, FP8)
        _append_quantised(v, dst + ROWS * H * D, scale_dst + ROWS * H * D, h, ok, e, H, PAGE, FP8)


@triton.jit
def _kv_append_kernel(k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr,
                      k_stride, v_stride, page_table_stride, max_batch, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                      ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr,
                      FP8: tl.constexpr):
    token = tl.program_id(0)
    row = token.to(tl.int64)
    h = tl.arange(0, H_P2)
    ok = (h[:, None] < H) & (tl.arange(0, D_P2)[None, :] < D)
    e = h[:, None] * D + tl.arange(0, D_P2)[None, :]
    user = _user_of(q_offsets_ptr, token, max_batch, BATCH_P2)
    if user >= max_batch:
        return
    j = token - tl.load(q_offsets_ptr + user)
    appended = tl.load(appended_lens_ptr + user)
    if j >= appended:
        return
    k = tl.load(k_ptr + row * k_stride + e, mask=ok)
    v = tl.load(v_ptr + row * v_stride + e, mask=ok)
    position = tl.load(history_lens_ptr + user) - appended + j
    page = tl.load(page_table_ptr + user * page_table_stride + position // PAGE).to(tl.int64)
    _write_token(k, v, cache_ptr, page, position % PAGE, h, ok, e, ROWS, H, D, PAGE, FP8)


@triton.jit
def _activated_kv_append_kernel(k_ptr, v_ptr, u_ptr, q_ptr, cache_ptr, page_table_ptr, q_offsets_ptr,
                                history_lens_ptr, appended_lens_ptr, k_stride, v_stride, u_stride, q_stride,
                                page_table_stride, max_batch, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                                ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, H_P2: tl.constexpr,
                                D_P2: tl.constexpr, FP8: tl.constexpr, ALL: tl.constexpr, LIBDEVICE: tl.constexpr):
    # Every load comes before the first store (a load after a store through a pointer that may alias cannot be
    # issued ahead of it): the row's four slices and the batch's offsets are in flight together, then the user's
    # lengths and its page, and the SiLU runs while the page entry is read.
    token = tl.program_id(0)
    row = token.to(tl.int64)
    h = tl.arange(0, H_P2)
    ok = (h[:, None] < H) & (tl.arange(0, D_P2)[None, :] < D)
    e = h[:, None] * D + tl.arange(0, D_P2)[None, :]
    u = tl.load(u_ptr + row * u_stride + e, mask=ok, other=0.0)
    k = tl.load(k_ptr + row * k_stride + e, mask=ok, other=0.0)
    v = tl.load(v_ptr + row * v_stride + e, mask=ok, other=0.0)
    if ALL:
        q = tl.load(q_ptr + row * q_stride + e, mask=ok, other=0.0)
    user = _user_of(q_offsets_ptr, token, max_batch, BATCH_P2)
    if user >= max_batch:
        return
    j = token - tl.load(q_offsets_ptr + user)
    appended = tl.load(appended_lens_ptr + user)
    position = tl.load(history_lens_ptr + user) - appended + j
    cached = j < appended
    page = tl.load(page_table_ptr + user * page_table_stride + position // PAGE, mask=cached, other=0).to(tl.int64)
    u = _silu(u, LIBDEVICE)
    tl.store(u_ptr + row * u_stride + e, u, mask=ok)
    if ALL:
        q = _silu(q, LIBDEVICE)
        k = _silu(k, LIBDEVICE)
        v = _silu(v, LIBDEVICE)
        tl.store(q_ptr + row * q_stride + e, q, mask=ok)
        tl.store(k_ptr + row * k_stride + e, k, mask=ok)
        tl.store(v_ptr + row * v_stride + e, v, mask=ok)
    if cached:
        _write_token(k, v, cache_ptr, page, position % PAGE, h, ok, e, ROWS, H, D, PAGE, FP8)


def kv_append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
              q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor,
              kv_dtype: torch.dtype | None = None) -> None:
    """Write appended token j of user b (row q_offsets[b] + j of k/v) to history position history_len - appended + j.

    The grid is k.shape[0] (the token capacity) and the batch is page_table.shape[0] users (q_offsets has one more
    entry); history_lens already include the appended tokens. `kv_dtype` None: the cache holds k's dtype; an fp8
    dtype: the cache is uint8 pages of codes and scale rows, written by the rule of layerflow.kernels.fp8.
    """
    _launch(k, v, None, None, kv_cache, page_table, q_offsets, history_lens, appended_lens, kv_dtype)


def activated_kv_append(u: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, kv_cache: torch.Tensor,
                        page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
                        appended_lens: torch.Tensor, kv_dtype: torch.dtype | None = None, *,
                        activate_qkv: bool = True) -> None:
    """SiLU in place on the batch's rows of u [T, H*D] (and of v, q, k [T, H, D] with `activate_qkv`), then
    `kv_append` of k and v as they are after it: the layer's activation and its KV append as one kernel that reads
    each row once. Rows from q_offsets[-1] on are the bucket's padding: left as they are.
    u, v, q, k are the fused projection's column slices (any row stride); the pages get the activated K/V exactly
    as `kv_append` after torch.nn.functional.silu would write them."""
    if u.dim() != 2 or u.shape[0] != k.shape[0] or u.shape[1] != k[0].numel() or u.stride(1) != 1 \
            or u.dtype != k.dtype:
        raise ValueError(f"u {u.dtype} shape {tuple(u.shape)}: expected {k.dtype} [{k.shape[0]}, {k[0].numel()}] "
                         f"rows with unit column stride")
    if q.shape != k.shape or q.dtype != k.dtype or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError(f"q {q.dtype} shape {tuple(q.shape)} strides {q.stride()}: expected k's {k.dtype} "
                         f"{tuple(k.shape)} with dense heads in each row")
    _launch(k, v, u, q if activate_qkv else None, kv_cache, page_table, q_offsets, history_lens, appended_lens,
            kv_dtype)


def _launch(k: torch.Tensor, v: torch.Tensor, u: torch.Tensor | None, q: torch.Tensor | None,
            kv_cache: torch.Tensor, page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
            appended_lens: torch.Tensor, kv_dtype: torch.dtype | None) -> None:
    """The append alone (u None), or with the SiLU of u (q None) or of u, v, q and k."""
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
    if k.shape[0] == 0:
        return
    lengths = (kv_cache, page_table, q_offsets, history_lens, appended_lens)
    shape = dict(PAGE=page_size, BATCH_P2=max(2, triton.next_power_of_2(max_batch)), ROWS=rows, H=heads, D=dim,
                 H_P2=triton.next_power_of_2(heads), D_P2=triton.next_power_of_2(dim), FP8=kernel_code(kv_dtype),
                 num_warps=4)
    if u is None:
        _kv_append_kernel[(k.shape[0],)](k, v, *lengths, k.stride(0), v.stride(0), page_table.stride(0), max_batch,
                                         **shape)
        return
    _activated_kv_append_kernel[(k.shape[0],)](
        k, v, u, q if q is not None else u, *lengths, k.stride(0), v.stride(0), u.stride(0),
        0 if q is None else q.stride(0), page_table.stride(0), max_batch, **shape, ALL=q is not None,
        LIBDEVICE=k.is_cuda)
