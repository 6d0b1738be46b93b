"""Paged HSTU attention for the cached path, split over the history (split-K) and CUDA-graph capturable.

HSTU has no softmax, so the output over the history is a plain sum of per-chunk partial sums: each program takes one
chunk of one user's history for one block of its queries and one head, writes an fp32 partial, and a second kernel
adds the partials in split order (deterministic). Splitting is what fills a 132-SM GPU at batch size 1.

Every length, offset and page index is read from device tensors and the grid is sized from the capacity given at
construction; programs past the batch exit at once. One compiled kernel and one captured graph therefore serve any
lengths up to the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLITS = 128


@triton.jit
def _user_block(q_offsets_ptr, slot, max_batch, BATCH_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a program slot to (user, query block of that user); user == max_batch when the slot is past the batch.

    Users' query blocks are numbered consecutively (a prefix sum of ceil(len / BLOCK_M)); empty users own none.
    """
    users = tl.arange(0, BATCH_P2)
    valid = users < max_batch
    starts = tl.load(q_offsets_ptr + users, mask=valid, other=0)
    ends = tl.load(q_offsets_ptr + users + 1, mask=valid, other=0)
    blocks = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    inclusive = tl.cumsum(blocks, axis=0)
    user = tl.sum((valid & (inclusive <= slot)).to(tl.int32), axis=0)
    first = tl.sum(tl.where(users == user, inclusive - blocks, 0), axis=0)
    return user, slot - first


@triton.jit
def _history_tile(acc, q, qpos, cache_h, page_row, chunk_pages, first_page, n0, hi, alpha,
                  H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  CHUNK_PAGES: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """acc += SiLU(alpha * q K^T) V over history keys n0 .. n0 + BLOCK_N read through the page table.

    With CHUNK_PAGES > 0 the page ids come from `chunk_pages`, the program's page-table slice held in registers, so
    the K/V addresses of a tile need no load and the loop's loads can be prefetched like dense ones.
    """
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    key_ok = n < hi
    if CHUNK_PAGES > 0:
        slot = tl.minimum(n // PAGE - first_page, CHUNK_PAGES - 1)
        page = tl.gather(chunk_pages, slot, axis=0)
    elif MASKED:
        page = tl.load(page_row + n // PAGE, mask=key_ok, other=0)
    else:
        page = tl.load(page_row + n // PAGE)
    rows = page.to(tl.int64) * (2 * PAGE * H * D) + (n % PAGE) * (H * D)
    k_ptrs = cache_h + rows[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(k_ptrs + PAGE * H * D, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + PAGE * H * D)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
    p = s * tl.sigmoid(s)
    if MASKED:
        p = tl.where(key_ok[None, :] & (n[None, :] <= qpos[:, None]), p, 0.0)
    return tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr, dst_ptr,
    q_stride, k_stride, v_stride, page_table_stride, split_stride, max_batch, alpha, inv_n,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    head = tl.program_id(2)
    user, block = _user_block(q_offsets_ptr, tl.program_id(1), max_batch, BATCH_P2, BLOCK_M)
    if user >= max_batch:
        return
    q_start = tl.load(q_offsets_ptr + user)
    q_len = tl.load(q_offsets_ptr + user + 1) - q_start
    hist = tl.load(history_lens_ptr + user)
    appended = tl.load(appended_lens_ptr + user)

    # Query j < appended is history position hist - appended + j (causal); a candidate sees the whole history.
    j = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < q_len
    qpos = tl.where(j < appended, hist - appended + j, hist - 1)
    last = tl.minimum(block * BLOCK_M + BLOCK_M, q_len) - 1
    kv_end = tl.minimum(hist, hist - appended + last + 1)
    full_end = tl.minimum(hist, hist - appended + block * BLOCK_M + 1)   # keys every row of the block sees

    chunk = tl.cdiv(tl.cdiv(hist, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    full_hi = lo + tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK_N * BLOCK_N

    d = tl.arange(0, D)
    token = (q_start + j).to(tl.int64)
    head_cols = head * D + d[None, :]
    q = tl.load(q_ptr + token[:, None] * q_stride + head_cols, mask=row_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    cache_h = cache_ptr + head * D
    page_row = page_table_ptr + user * page_table_stride
    first_page = lo // PAGE
    if CHUNK_PAGES > 0:
        slots = tl.arange(0, CHUNK_PAGES)
        chunk_pages = tl.load(page_row + first_page + slots, mask=first_page + slots < tl.cdiv(hi, PAGE), other=0)
    else:
        chunk_pages = first_page
    for n0 in range(lo, full_hi, BLOCK_N):
        acc = _history_tile(acc, q, qpos, cache_h, page_row, chunk_pages, first_page, n0, hi, alpha,
                            H, D, PAGE, BLOCK_N, CHUNK_PAGES, False, PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc = _history_tile(acc, q, qpos, cache_h, page_row, chunk_pages, first_page, n0, hi, alpha,
                            H, D, PAGE, BLOCK_N, CHUNK_PAGES, True, PRECISION)

    if split == 0:
        # A candidate's own key: the only non-history key it sees.
        candidate = row_ok & (j >= appended)
        k_self = tl.load(k_ptr + token[:, None] * k_stride + head_cols, mask=candidate[:, None],
                         other=0.0).to(tl.float32)
        v_self = tl.load(v_ptr + token[:, None] * v_stride + head_cols, mask=candidate[:, None],
                         other=0.0).to(tl.float32)
        s = tl.sum(q.to(tl.float32) * k_self, axis=1) * alpha
        acc += (s * tl.sigmoid(s))[:, None] * v_self

    dst = dst_ptr + split.to(tl.int64) * split_stride + token[:, None] * (H * D) + head_cols
    tl.store(dst, (acc * inv_n).to(dst_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, q_offsets_ptr, split_stride, max_batch,
                       HD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the split partials over the batch's tokens only.

    All partials of a block are loaded at once (a loop would wait on one L2 round trip per split) and reduced by a
    tree whose shape is fixed at compile time, so the result is the same bits on every run.
    """
    total = tl.load(q_offsets_ptr + max_batch).to(tl.int64) * HD
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start >= total:
        return
    offsets = start + tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS_P2)
    ok = offsets < total
    ptrs = partial_ptr + splits[:, None].to(tl.int64) * split_stride + offsets[None, :]
    parts = tl.load(ptrs, mask=(splits[:, None] < NUM_SPLITS) & ok[None, :], other=0.0)
    tl.store(out_ptr + offsets, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class AttentionTiling:
    """Launch shape of the attention kernel.

    `programs_per_sm` is how many programs of this shape one SM runs at once (shared memory and registers decide it);
    the split count is chosen so the grid fills whole waves of SMs * programs_per_sm. `num_splits` overrides that.
    `preload_pages` keeps each program's page-table slice in registers instead of loading page ids per tile.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 1
    preload_pages: bool = False
    num_splits: int | None = None


def default_tiling(head_dim: int, dtype: torch.dtype, tokens_per_user: int = 64) -> AttentionTiling:
    """The fastest tiling of the H200 sweep in benchmarks/results/kernels-h200.json (fp32, the test dtype: small).

    Users with many queries (candidates) make the kernel compute-bound: a taller query block reads each K/V tile for
    more queries. Three stages with page ids in registers let the K/V loads run two tiles ahead (1.6 -> 2.0 TB/s at
    BS=1, 16K, D=256).
    """
    if dtype == torch.float32:
        return AttentionTiling(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if tokens_per_user >= 128:
        block_n = 32 if head_dim == 256 else 64
        return AttentionTiling(block_m=128, block_n=block_n, num_warps=8, num_stages=3, preload_pages=True)
    if head_dim == 256:
        return AttentionTiling(block_m=64, block_n=64, num_warps=8, num_stages=3, preload_pages=True)
    return AttentionTiling(block_m=64, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2, preload_pages=True)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class PagedAttention:
    """HSTU attention of one batch's queries over their users' paged history, with workspaces sized at construction.

    `run` allocates nothing and reads every length from device tensors, so it can be captured in a CUDA graph once
    and replayed for any batch within the capacity.
    """

    def __init__(self, max_batch: int, max_tokens: int, max_pages_per_user: int, num_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, device: torch.device | str, alpha: float, max_seq_len: int,
                 *, tiling: AttentionTiling | None = None) -> None:
        for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens),
                            ("max_pages_per_user", max_pages_per_user), ("num_heads", num_heads),
                            ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim}: expected one of {HEAD_DIMS}")
        if page_size not in PAGE_SIZES:
            raise ValueError(f"page_size={page_size}: expected one of {PAGE_SIZES}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: expected one of {DTYPES}")
        self.max_batch, self.max_tokens, self.max_pages_per_user = max_batch, max_tokens, max_pages_per_user
        self.num_heads, self.head_dim, self.page_size, self.dtype = num_heads, head_dim, page_size, dtype
        self.device = torch.device(device)
        self.alpha, self.max_seq_len = float(alpha), max_seq_len
        tiling = tiling or default_tiling(head_dim, dtype, triton.cdiv(max_tokens, max_batch))
        self.num_splits = tiling.num_splits or self._pick_splits(tiling)
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits={self.num_splits}: expected 1..{MAX_SPLITS}")
        self.tiling = tiling
        # Each user's last query block may be partial: at most (tokens + users * (block_m - 1)) // block_m blocks.
        self.query_slots = (max_tokens + max_batch * (tiling.block_m - 1)) // tiling.block_m
        self.chunk_pages = self._chunk_pages() if tiling.preload_pages else 0
        self.partials = (torch.empty(self.num_splits, max_tokens, num_heads, head_dim, dtype=torch.float32,
                                     device=self.device) if self.num_splits > 1 else None)

    def _pick_splits(self, tiling: AttentionTiling) -> int:
        """The fewest splits whose grid, at full capacity split evenly over users, fills whole waves to >= 90%.

        A grid of 208 programs on 132 single-program SMs runs two waves for 1.6 waves of work: the last wave's idle
        SMs cost as much as the split-K gains, so the split count is matched to the wave size.
        """
        per_user = triton.cdiv(self.max_tokens, self.max_batch)
        programs = self.max_batch * triton.cdiv(per_user, tiling.block_m) * self.num_heads
        slots = _sm_count(self.device) * tiling.programs_per_sm
        tiles = triton.cdiv(self.max_pages_per_user * self.page_size, tiling.block_n)
        best, best_fill = 1, 0.0
        for splits in range(1, min(tiles, MAX_SPLITS) + 1):
            total = programs * splits
            fill = total / (triton.cdiv(total, slots) * slots)
            if total >= slots and fill >= 0.9:
                return splits
            if fill > best_fill + 1e-9:
                best, best_fill = splits, fill
        return best

    def _chunk_pages(self) -> int:
        """Page-table entries one program's chunk can touch (power of two for the register slice)."""
        t = self.tiling
        longest = self.max_pages_per_user * self.page_size
        chunk = triton.cdiv(triton.cdiv(longest, self.num_splits), t.block_n) * t.block_n
        return triton.next_power_of_2(triton.cdiv(chunk, self.page_size) + 1)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
               appended_lens: torch.Tensor, out: torch.Tensor) -> None:
        rows = (self.num_heads, self.head_dim)
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.dim() != 3 or tuple(t.shape[1:]) != rows or t.shape[0] > self.max_tokens:
                raise ValueError(f"{name} shape {tuple(t.shape)}: expected [<= {self.max_tokens}, *{rows}]")
            if t.stride(2) != 1 or t.stride(1) != self.head_dim or (t is out and not t.is_contiguous()):
                raise ValueError(f"{name} strides {t.stride()}: expected dense heads in each row"
                                 f"{' and a contiguous tensor' if t is out else ' (any row stride)'}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} dtype {t.dtype}: expected {self.dtype}")
        if q.shape[0] != out.shape[0] or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"q/k/v/out rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]}/{out.shape[0]} differ")
        cache_rows = (2, self.page_size, self.num_heads, self.head_dim)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != cache_rows or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)}: expected contiguous [pages, *{cache_rows}]")
        if kv_cache.dtype != self.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype}: expected {self.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != self.max_batch or page_table.stride(1) != 1 \
                or page_table.shape[1] > self.max_pages_per_user:
            raise ValueError(f"page_table shape {tuple(page_table.shape)}: expected [{self.max_batch}, "
                             f"<= {self.max_pages_per_user}] with unit column stride")
        for name, t, n in (("page_table", page_table, None), ("q_offsets", q_offsets, self.max_batch + 1),
                           ("history_lens", history_lens, self.max_batch),
                           ("appended_lens", appended_lens, self.max_batch)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} dtype {t.dtype}: expected torch.int32")
            if n is not None and (t.dim() != 1 or t.shape[0] != n or not t.is_contiguous()):
                raise ValueError(f"{name} shape {tuple(t.shape)}: expected contiguous [{n}]")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
            appended_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_j SiLU(alpha q_t . k_j) / N v_j over the keys token t sees (see the module docstring)."""
        self._check(q, k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, out)
        t = self.tiling
        dst = out if self.partials is None else self.partials
        split_stride = self.max_tokens * self.num_heads * self.head_dim
        precision = "ieee" if self.dtype == torch.float32 else None
        grid = (self.num_splits, self.query_slots, self.num_heads)
        _paged_attention_kernel[grid](
            q, k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, dst,
            q.stride(0), k.stride(0), v.stride(0), page_table.stride(0), split_stride, self.max_batch, self.alpha,
            1.0 / self.max_seq_len,
            H=self.num_heads, D=self.head_dim, PAGE=self.page_size,
            BATCH_P2=max(2, triton.next_power_of_2(self.max_batch)),
            NUM_SPLITS=self.num_splits, BLOCK_M=t.block_m, BLOCK_N=t.block_n, CHUNK_PAGES=self.chunk_pages,
            PRECISION=precision,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
        if self.partials is not None:
            splits_p2 = triton.next_power_of_2(self.num_splits)
            block = max(16, 8192 // splits_p2)
            _sum_splits_kernel[(triton.cdiv(split_stride, block),)](
                self.partials, out, q_offsets, split_stride, self.max_batch, HD=self.num_heads * self.head_dim,
                NUM_SPLITS=self.num_splits, SPLITS_P2=splits_p2, BLOCK=block, num_warps=4,
            )
        return out
