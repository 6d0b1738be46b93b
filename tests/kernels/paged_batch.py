"""Random paged batches in the kernels' layout, for the kernel tests and microbenchmarks.

Pages are handed out in a shuffled order so page tables are never contiguous, and every pool slot that holds no
cached token is poisoned (NaN) so a kernel that reads outside a user's history shows it in its output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from layerflow.kernels.fp8 import page_views, quantise
from layerflow.tier.layout import fp8_scale_rows


@dataclass
class PagedBatch:
    """Device tensors of one batch: capacity-sized where the kernels' contract says so."""

    q: torch.Tensor              # [max_tokens, H, D]
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor       # [num_pages, 2, page_size, H, D]
    page_table: torch.Tensor     # int32 [max_batch, max_pages_per_user]
    q_offsets: torch.Tensor      # int32 [max_batch + 1]
    history_lens: torch.Tensor   # int32 [max_batch], appended tokens included
    appended_lens: torch.Tensor  # int32 [max_batch]

    @property
    def lengths(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.page_table, self.q_offsets, self.history_lens, self.appended_lens

    @property
    def total_tokens(self) -> int:
        return int(self.q_offsets[-1])


def make_paged_batch(history_lens: list[int], appended_lens: list[int], candidate_lens: list[int], *,
                     num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
                     max_batch: int | None = None, max_tokens: int | None = None,
                     max_pages_per_user: int | None = None, spare_pages: int = 3, poison: float = float("nan"),
                     seed: int = 0) -> PagedBatch:
    """A batch whose cached history (history_len - appended tokens per user) is already in the pool.

    The appended tokens' K/V are only in the k/v rows: run kv_append before the attention, as the runtime does.
    """
    if not len(history_lens) == len(appended_lens) == len(candidate_lens):
        raise ValueError(f"{len(history_lens)}/{len(appended_lens)}/{len(candidate_lens)} users in the length lists")
    for h, a, c in zip(history_lens, appended_lens, candidate_lens):
        if not 0 <= a <= h or c < 0:
            raise ValueError(f"history {h}, appended {a}, candidates {c}: "
                             "need 0 <= appended <= history and candidates >= 0")
    gen = torch.Generator().manual_seed(seed)
    batch = len(history_lens)
    max_batch = max_batch or batch
    lens = [a + c for a, c in zip(appended_lens, candidate_lens)]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    offsets += [offsets[-1]] * (max_batch - batch)
    max_tokens = max_tokens or max(offsets[-1], 1)
    pages_per_user = [-(-h // page_size) for h in history_lens]
    max_pages_per_user = max_pages_per_user or max(max(pages_per_user, default=1), 1)
    num_pages = sum(pages_per_user) + spare_pages
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.zeros(max_batch, max_pages_per_user, dtype=torch.int32)
    cached_slot = torch.zeros(num_pages * page_size, dtype=torch.bool)
    used = 0
    for b, (h, a) in enumerate(zip(history_lens, appended_lens)):
        pages = order[used:used + pages_per_user[b]]
        used += pages_per_user[b]
        page_table[b, :len(pages)] = pages
        position = torch.arange(h - a)
        cached_slot[pages[position // page_size].long() * page_size + position % page_size] = True
    device_gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(num_pages, 2, page_size, num_heads, head_dim, generator=device_gen, device=device)
    poisoned = ~cached_slot.to(device).view(num_pages, 1, page_size, 1, 1)
    cache = cache.masked_fill_(poisoned, poison).to(dtype)
    q, k, v = (torch.randn(max_tokens, num_heads, head_dim, generator=device_gen, device=device).to(dtype)
               for _ in range(3))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PagedBatch(
        q=q, k=k, v=v, kv_cache=cache,
        page_table=page_table.to(device), q_offsets=ints(offsets),
        history_lens=ints(history_lens + [0] * (max_batch - batch)),
        appended_lens=ints(appended_lens + [0] * (max_batch - batch)),
    )



POISON_CODE, POISON_SCALE = 0x7F, 0xFF    # an fp8 NaN (e4m3 and e5m2) and a scale byte of 2^128 (inf)


def quantised_batch(batch: PagedBatch, kv_dtype: torch.dtype, page_size: int) -> PagedBatch:
    """`batch` (made with the default NaN poison) with its cache as an fp8 cache of codes and scale rows
    (layerflow.tier.layout): every cached slot quantised by layerflow.kernels.fp8, every other slot poisoned."""
    cache = batch.kv_cache
    num_pages, _, _, heads, dim = cache.shape
    rows = page_size + fp8_scale_rows(page_size, dim)
    fp8 = torch.full((num_pages, 2, rows, heads, dim), POISON_CODE, dtype=torch.uint8, device=cache.device)
    codes, scales = page_views(fp8, page_size)
    cached = ~torch.isnan(cache.float()).flatten(3).any(dim=-1)           # [pages, 2, page_size]
    values, exponents = quantise(torch.nan_to_num(cache.float()), kv_dtype)
    codes.copy_(torch.where(cached[..., None, None], values, POISON_CODE))
    scales.copy_(torch.where(cached[..., None], exponents, POISON_SCALE).permute(0, 1, 3, 2))
    return replace(batch, kv_cache=fp8)
