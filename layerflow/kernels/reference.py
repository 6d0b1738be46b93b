"""Torch references for the paged kernels: gather each user's pages into dense K/V and apply the model's math.

They read lengths back to the host and loop over users, so they are slow and not graph capturable: they exist to
define what the Triton kernels must compute (tests) and to run on machines without a GPU.
"""

from __future__ import annotations

import torch

from layerflow.model.reference import attention_mask, hstu_attention


def gather_history(kv_cache: torch.Tensor, page_row: torch.Tensor,
                   history_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V [history_len, H, D] of one user from its row of the page table."""
    page_size = kv_cache.shape[2]
    num_pages = -(-history_len // page_size)
    pages = kv_cache[page_row[:num_pages].long()]                 # [n, 2, page_size, H, D]
    k = pages[:, 0].reshape(-1, *kv_cache.shape[3:])[:history_len]
    v = pages[:, 1].reshape(-1, *kv_cache.shape[3:])[:history_len]
    return k, v


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
                              appended_lens: torch.Tensor, out: torch.Tensor, *, alpha: float,
                              max_seq_len: int) -> torch.Tensor:
    """Same contract as `PagedAttention.run`; rows of `out` outside the batch are left untouched."""
    offsets, hist, appended = q_offsets.tolist(), history_lens.tolist(), appended_lens.tolist()
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if end == start:
            continue
        k_hist, v_hist = gather_history(kv_cache, page_table[b], hist[b])
        num_candidates = end - start - appended[b]
        cand = slice(start + appended[b], end)
        keys = torch.cat([k_hist, k[cand]])
        values = torch.cat([v_hist, v[cand]])
        mask = attention_mask(hist[b], appended[b], num_candidates).to(q.device)
        out[start:end] = hstu_attention(q[start:end], keys, values, mask, alpha, max_seq_len).to(out.dtype)
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
