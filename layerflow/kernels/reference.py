"""Torch references for the paged kernels: gather each user's pages into dense K/V and apply the model's math.

They read lengths back to the host and loop over users, so they are slow and not graph capturable: they exist to
define what the Triton kernels must compute (tests) and to run on machines without a GPU.
"""

from __future__ import annotations

import torch

from layerflow.kernels.fp8 import QUERY_DTYPE, dequantise, page_views, quantise, query_terms
from layerflow.model.mask import MaskRule, attention_mask
from layerflow.model.reference import hstu_attention
from layerflow.tier.layout import fp8_page_size


def page_size_of(kv_cache: torch.Tensor, kv_dtype: torch.dtype | None) -> int:
    """Tokens per page of a cache `[pages, 2, rows, H, D]` holding the model's dtype (None) or `kv_dtype` fp8."""
    rows, dim = kv_cache.shape[2], kv_cache.shape[4]
    return rows if kv_dtype is None else fp8_page_size(rows, dim)


def gather_history(kv_cache: torch.Tensor, page_row: torch.Tensor, history_len: int, start: int = 0,
                   kv_dtype: torch.dtype | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V [history_len - start, H, D] of one user's history positions start .. history_len - 1, from its row
    of the page table (pages before `start`'s are not read). An fp8 cache (`kv_dtype`) is dequantised to `dtype`."""
    page_size = page_size_of(kv_cache, kv_dtype)
    first, num_pages = start // page_size, -(-history_len // page_size)
    pages = kv_cache[page_row[first:num_pages].long()]            # [n, 2, rows, H, D]
    if kv_dtype is not None:
        codes, scales = page_views(pages, page_size)
        pages = dequantise(codes, scales.transpose(2, 3), kv_dtype, dtype)
    skip, count = start - first * page_size, history_len - start
    k = pages[:, 0].reshape(-1, *kv_cache.shape[3:])[skip:skip + count]
    v = pages[:, 1].reshape(-1, *kv_cache.shape[3:])[skip:skip + count]
    return k, v


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
                              appended_lens: torch.Tensor, out: torch.Tensor, *, alpha: float,
                              max_seq_len: int | None = None, inv_n: torch.Tensor | None = None,
                              mask: MaskRule = MaskRule(), kv_dtype: torch.dtype | None = None,
                              q_terms: int = 0) -> torch.Tensor:
    """Same contract as `PagedAttention.run` (1/N from `inv_n`, [1] or per user, else 1/max_seq_len; `kv_dtype`: an
    fp8 cache, dequantised as it is read); rows of `out` outside the batch are left untouched. Like the kernel it
    reads only the history the mask lets the batch see. `q_terms` > 0 (an e4m3 cache): q.k on fp8 MMAs as the fp8
    Gluon kernel's `qk` choice runs it, the queries as the sum of their `q_terms` e4m3 terms (fp8.query_terms) and
    the candidates' own keys quantised like cached ones (the kernel's K tiles are all codes)."""
    if (max_seq_len is None) == (inv_n is None):
        raise ValueError("pass exactly one of max_seq_len and inv_n")
    if q_terms and kv_dtype != QUERY_DTYPE:
        raise ValueError(f"q_terms={q_terms} over kv_dtype={kv_dtype}: fp8 q.k needs an {QUERY_DTYPE} cache")
    if q_terms:
        q = sum(query_terms(q, q_terms))
        k = dequantise(*quantise(k, kv_dtype), kv_dtype, torch.float32)
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    scales = [1.0 / max_seq_len] if inv_n is None else inv_n.tolist()
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if end == start:
            continue
        num_candidates = end - start - appended[b]
        first = mask.cached_read_start(hist[b] - appended[b], appended[b], num_candidates)
        k_hist, v_hist = gather_history(kv_cache, page_table[b], hist[b], first, kv_dtype, k.dtype)
        cand = slice(start + appended[b], end)
        keys = torch.cat([k_hist, k[cand]])
        values = torch.cat([v_hist, v[cand]])
        seen = attention_mask(hist[b], appended[b], num_candidates, mask)[:, first:].to(q.device)
        scale = scales[b if len(scales) > 1 else 0]
        out[start:end] = hstu_attention(q[start:end], keys, values, seen, alpha, 1.0 / scale).to(out.dtype)
    return out


def kv_append_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                        q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor,
                        kv_dtype: torch.dtype | None = None) -> None:
    """Same contract as `kv_append`: appended token j of user b goes to history position history_len - appended + j
    (quantised by layerflow.kernels.fp8 when `kv_dtype` is an fp8 dtype)."""
    if kv_dtype is not None:
        _append_quantised(k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, kv_dtype)
        return
    page_size = kv_cache.shape[2]
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    for b in range(len(offsets) - 1):
        for j in range(appended[b]):
            position = hist[b] - appended[b] + j
            page = int(page_table[b, position // page_size])
            kv_cache[page, 0, position % page_size] = k[offsets[b] + j]
            kv_cache[page, 1, position % page_size] = v[offsets[b] + j]


def _append_quantised(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                      q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor,
                      kv_dtype: torch.dtype) -> None:
    """`kv_append_reference` into an fp8 cache: every appended token quantised at once, then scattered."""
    page_size = page_size_of(kv_cache, kv_dtype)
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    rows, pages, slots = [], [], []
    for b in range(len(offsets) - 1):
        for j in range(appended[b]):
            position = hist[b] - appended[b] + j
            rows.append(offsets[b] + j)
            pages.append(int(page_table[b, position // page_size]))
            slots.append(position % page_size)
    if not rows:
        return
    rows_t, pages_t, slots_t = (torch.tensor(x, dtype=torch.long, device=kv_cache.device)
                                for x in (rows, pages, slots))
    codes, scales = page_views(kv_cache, page_size)
    for half, x in enumerate((k, v)):
        token_codes, token_scales = quantise(x[rows_t], kv_dtype)      # [n, H, D], [n, H]
        codes[pages_t, half, slots_t] = token_codes
        scales[pages_t, half, :, slots_t] = token_scales
