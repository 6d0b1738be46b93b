"""Torch references for the paged kernels: gather each user's pages into dense K/V and apply the model's math.

They read lengths back to the host and loop over users, so they are slow and not graph capturable: they exist to
define what the Triton kernels must compute (tests) and to run on machines without a GPU.
"""

from __future__ import annotations

import torch

from layerflow.model.mask import MaskRule, attention_mask
from layerflow.model.reference import hstu_attention


def gather_history(kv_cache: torch.Tensor, page_row: torch.Tensor, history_len: int,
                   start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V [history_len - start, H, D] of one user's history positions start .. history_len - 1, from its row
    of the page table (pages before `start`'s are not read)."""
    page_size = kv_cache.shape[2]
    first, num_pages = start // page_size, -(-history_len // page_size)
    pages = kv_cache[page_row[first:num_pages].long()]            # [n, 2, page_size, H, D]
    skip, count = start - first * page_size, history_len - start
    k = pages[:, 0].reshape(-1, *kv_cache.shape[3:])[skip:skip + count]
    v = pages[:, 1].reshape(-1, *kv_cache.shape[3:])[skip:skip + count]
    return k, v


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
                              appended_lens: torch.Tensor, out: torch.Tensor, *, alpha: float,
                              max_seq_len: int | None = None, inv_n: torch.Tensor | None = None,
                              mask: MaskRule = MaskRule()) -> torch.Tensor:
    """Same contract as `PagedAttention.run` (1/N from `inv_n`, [1] or per user, else 1/max_seq_len); rows of `out`
    outside the batch are left untouched. Like the kernel it reads only the history the mask lets the batch see."""
    if (max_seq_len is None) == (inv_n is None):
        raise ValueError("pass exactly one of max_seq_len and inv_n")
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    scales = [1.0 / max_seq_len] if inv_n is None else inv_n.tolist()
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if end == start:
            continue
        num_candidates = end - start - appended[b]
        first = mask.cached_read_start(hist[b] - appended[b], appended[b], num_candidates)
        k_hist, v_hist = gather_history(kv_cache, page_table[b], hist[b], first)
        cand = slice(start + appended[b], end)
        keys = torch.cat([k_hist, k[cand]])
        values = torch.cat([v_hist, v[cand]])
        seen = attention_mask(hist[b], appended[b], num_candidates, mask)[:, first:].to(q.device)
        scale = scales[b if len(scales) > 1 else 0]
        out[start:end] = hstu_attention(q[start:end], keys, values, seen, alpha, 1.0 / scale).to(out.dtype)
    return out


def kv_append_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                        q_offsets: torch.Tensor, history_lens: torch.Tensor, appended_lens: torch.Tensor) -> None:
    """Same contract as `kv_append`: appended token j of user b goes to history position history_len - appended + j."""
    page_size = kv_cache.shape[2]
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    for b in range(len(offsets) - 1):
        for j in range(appended[b]):
            position = hist[b] - appended[b] + j
            page = int(page_table[b, position // page_size])
            kv_cache[page, 0, position % page_size] = k[offsets[b] + j]
            kv_cache[page, 1, position % page_size] = v[offsets[b] + j]
