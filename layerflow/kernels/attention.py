"""Paged HSTU attention for the cached path, split over the history (split-K) and CUDA-graph capturable.

HSTU has no softmax, so the output over the history is a plain sum of per-chunk partial sums: each program takes one
chunk of one user's history for one block of its queries and one head and writes an fp32 partial; the partials are
added in split order (deterministic) by a second kernel, or by their consumer (`run(reduce=False)`). Splitting fills
a 132-SM GPU at batch size 1; the split count fills whole waves for the capacity or for each launch's real query
blocks (layerflow.kernels.splits). Lengths, offsets and page indices are read from device tensors and programs past the
batch exit at once: one compiled kernel and one captured graph serve any lengths up to the capacity. The mask is the
model's (layerflow.model.mask; window and contextual rows compile-time options); a program reads only the history
keys its rows may see, so with a window only the pages `MaskRule.cached_read_start` names. 1/N is read from a device
tensor ([1] or per user), so one graph serves the batch rule's changing N. K and V share one head dim (dqk == dv).
An fp8 cache (layerflow.kernels.fp8) is dequantised inside the tile loop, on load: there is no pass over the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerflow.kernels.fp8 import decode, fp16_queries, fp16_scores, kernel_code, tile_scales, value_unit
from layerflow.kernels.gluon_attention import GluonTiling, select_kernel
from layerflow.kernels.splits import SplitPartials, _query_blocks, _row_splits, rows_table, split_rule, sum_splits, \
    wave_splits
from layerflow.kernels.tiling import AttentionTiling, default_tiling, sm_count
from layerflow.kernels.workspace import SplitWorkspace
from layerflow.model.config import HSTUConfig
from layerflow.model.mask import MaskRule
from layerflow.tier.layout import FP8_DTYPES, fp8_scale_rows

__all__ = ["AttentionTiling", "PagedAttention", "SplitPartials", "default_tiling"]

PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLITS = 128


@triton.jit
def _user_block(q_offsets_ptr, slot, max_batch, BATCH_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a program slot to (user, query block of that user); user == max_batch when the slot is past the batch.
    Users' query blocks are numbered consecutively (a prefix sum of ceil(len / BLOCK_M)); empty users own none."""
    users, valid, blocks = _query_blocks(q_offsets_ptr, max_batch, BATCH_P2, BLOCK_M)
    inclusive = tl.cumsum(blocks, axis=0)
    user = tl.sum((valid & (inclusive <= slot)).to(tl.int32), axis=0)
    first = tl.sum(tl.where(users == user, inclusive - blocks, 0), axis=0)
    return user, slot - first


@triton.jit
def _token_ids(pos, m, SHIFT: tl.constexpr):
    """id(p) = min(max(p - SHIFT, 0), m): the contextual prefix shares id 0, targets share m."""
    return tl.minimum(tl.maximum(pos - SHIFT, 0), m)


@triton.jit
def _page_bases(page_row, chunk_pages, first_page, n, key_ok, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                ROWS: tl.constexpr, CHUNK_PAGES: tl.constexpr, MASKED: tl.constexpr):
    """Offsets (int64, elements) of the pages of history keys `n`; with CHUNK_PAGES > 0 from `chunk_pages`, the
    program's page-table slice in registers, so K/V addresses need no load and the loads pipeline like dense ones."""
    if CHUNK_PAGES > 0:
        slot = tl.minimum(n // PAGE - first_page, CHUNK_PAGES - 1)
        page = tl.gather(chunk_pages, slot, axis=0)
    elif MASKED:
        page = tl.load(page_row + n // PAGE, mask=key_ok, other=0)
    else:
        page = tl.load(page_row + n // PAGE)
    return page.to(tl.int64) * (2 * ROWS * H * D)


@triton.jit
def _history_tile(acc, k_scale, v_scale, q, qpos, qid, history_row, m, cache_h, scales_h, page_row, chunk_pages,
                  first_page, n0, hi, alpha, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr, SHIFT: tl.constexpr, WINDOW: tl.constexpr, CONTEXTUAL: tl.constexpr,
                  FP8: tl.constexpr, V_DTYPE: tl.constexpr, V_UNIT: tl.constexpr):
    """(acc + SiLU(alpha * q K^T) V over history keys n0 .. n0 + BLOCK_N, the next tile's scales). Masked tiles apply
    the model's mask to each pair. fp8 codes (FP8 > 0) decode on load, K into q's dtype, V into V_DTYPE; the
    per-key power-of-two scales, loaded a tile ahead (a byte per thread is too narrow for the pipeliner's async
    copies), multiply q.k after the dot and the weights before the V dot: the dots over the dequantised K and V."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    key_ok = n < hi
    page_base = _page_bases(page_row, chunk_pages, first_page, n, key_ok, H, D, PAGE, ROWS, CHUNK_PAGES, MASKED)
    k_ptrs = cache_h + (page_base + (n % PAGE) * (H * D))[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(k_ptrs + ROWS * H * D, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + ROWS * H * D)
    if FP8 == 0:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        next_k_scale, next_v_scale = k_scale, v_scale
    else:
        ahead = n + BLOCK_N
        next_k_scale, next_v_scale = tile_scales(scales_h, _page_bases(page_row, chunk_pages, first_page, ahead,
                                                                       ahead < hi, H, D, PAGE, ROWS, CHUNK_PAGES,
                                                                       True), ahead, hi, PAGE, ROWS * H * D)
        k = decode(k, FP8, q.dtype)
        v = decode(v, FP8, V_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scale * alpha)[None, :]
    p = s * tl.sigmoid(s)
    if MASKED:
        if WINDOW > 0 or CONTEXTUAL > 0:
            kid = _token_ids(n, m, SHIFT)[None, :]
            seen = (history_row[:, None] & (n[None, :] == qpos[:, None])) | (qid[:, None] > kid)
            if WINDOW > 0:
                seen = seen & (qid[:, None] - kid <= WINDOW)
            if CONTEXTUAL > 0:
                seen = seen | ((qid[:, None] == 0) & (kid < m))
        else:
            seen = n[None, :] <= qpos[:, None]     # causal; a candidate (at hist) sees every history key
        p = tl.where(key_ok[None, :] & seen, p, 0.0)
    if FP8 != 0:
        p = p * (v_scale * V_UNIT)[None, :]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION), next_k_scale, next_v_scale


@triton.jit
def _window_start(qid, WINDOW: tl.constexpr, SHIFT: tl.constexpr):
    """First history position a query of id `qid` sees: its id minus W, or 0 once that reaches the id-0 tokens."""
    return tl.where((WINDOW == 0) | (qid <= WINDOW), 0, qid - WINDOW + SHIFT)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr, inv_n_ptr,
    dst_ptr, q_stride, k_stride, v_stride, page_table_stride, split_stride, max_batch, alpha,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, PRECISION: tl.constexpr,
    INV_N_PER_USER: tl.constexpr, SHIFT: tl.constexpr, WINDOW: tl.constexpr, CONTEXTUAL: tl.constexpr,
    ROWS: tl.constexpr, FP8: tl.constexpr, F16_QK: tl.constexpr, V_UNIT: tl.constexpr,
    split_table_ptr, active_splits_ptr,
):
    split = tl.program_id(0)
    head = tl.program_id(2)
    num_splits = NUM_SPLITS
    if split_table_ptr is not None:     # the "rows" rule: this launch's count, programs past it exit
        num_splits = _row_splits(q_offsets_ptr, max_batch, split_table_ptr, active_splits_ptr, BATCH_P2, BLOCK_M)
        if split >= num_splits:
            return
    user, block = _user_block(q_offsets_ptr, tl.program_id(1), max_batch, BATCH_P2, BLOCK_M)
    if user >= max_batch:
        return
    q_start = tl.load(q_offsets_ptr + user)
    q_len = tl.load(q_offsets_ptr + user + 1) - q_start
    hist = tl.load(history_lens_ptr + user)
    appended = tl.load(appended_lens_ptr + user)
    # Query j < appended is history position hist - appended + j; candidates sit at hist (their id clamps to m).
    # Each row sees the history keys [row_lo, row_hi) (for m <= 0 only a subset: no tile is fully seen). Ids grow
    # with j, and so do row_lo and, but for the contextual rows, row_hi: the block's bounds are its end rows' (else
    # a reduction over the rows).
    j = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < q_len
    history_row = j < appended
    m = hist - SHIFT
    qpos = tl.where(history_row, hist - appended + j, hist)
    qid = _token_ids(qpos, m, SHIFT)
    first, last = block * BLOCK_M, tl.minimum(block * BLOCK_M + BLOCK_M, q_len) - 1
    block_lo = _window_start(_token_ids(tl.where(first < appended, hist - appended + first, hist), m, SHIFT),
                             WINDOW, SHIFT)
    full_lo = _window_start(_token_ids(tl.where(last < appended, hist - appended + last, hist), m, SHIFT),
                            WINDOW, SHIFT)
    if CONTEXTUAL > 0:
        row_hi = tl.where(history_row & (qid > 0), qpos + 1, hist)
        kv_end = tl.max(tl.where(row_ok, row_hi, 0), axis=0)
        full_end = tl.where(m > 0, tl.min(tl.where(row_ok, row_hi, hist), axis=0), 0)
    else:
        kv_end = tl.minimum(hist, hist - appended + last + 1)
        full_end = tl.minimum(hist, hist - appended + first + 1)
    # The user's keys [user_lo, hist) are split evenly; user_lo is where its first query's window starts.
    user_lo = _window_start(_token_ids(hist - appended, m, SHIFT), WINDOW, SHIFT)
    chunk = tl.cdiv(tl.cdiv(hist - user_lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = user_lo + split * chunk
    lo = tl.maximum(split_lo, block_lo)
    hi = tl.minimum(split_lo + chunk, kv_end)
    # Tiles from lo: masked ones below the first tile in [full_lo, full_end), unmasked ones inside it, masked after.
    unmasked_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
    masked_end = tl.minimum(unmasked_lo, hi)
    unmasked_hi = unmasked_lo + tl.maximum(tl.minimum(hi, full_end) - unmasked_lo, 0) // BLOCK_N * BLOCK_N

    d = tl.arange(0, D)
    token = (q_start + j).to(tl.int64)
    head_cols = head * D + d[None, :]
    q = tl.load(q_ptr + token[:, None] * q_stride + head_cols, mask=row_ok[:, None], other=0.0)
    if F16_QK:
        q, alpha = fp16_queries(q, alpha)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    cache_h = cache_ptr + head * D
    scales_h = cache_ptr + PAGE * H * D + head * PAGE     # an fp8 page half's scale bytes [H, PAGE]
    page_row = page_table_ptr + user * page_table_stride
    first_page = lo // PAGE
    if CHUNK_PAGES > 0:
        slots = tl.arange(0, CHUNK_PAGES)
        chunk_pages = tl.load(page_row + first_page + slots, mask=first_page + slots < tl.cdiv(hi, PAGE), other=0)
    else:
        chunk_pages = first_page
    # The loops take the tiles lo, lo + BLOCK_N, ... < hi in order, each handing the next tile's fp8 scales on.
    k_scale, v_scale = tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32)
    if FP8 != 0:
        n = lo + tl.arange(0, BLOCK_N)
        k_scale, v_scale = tile_scales(scales_h, _page_bases(page_row, chunk_pages, first_page, n, n < hi, H, D, PAGE,
                                                             ROWS, CHUNK_PAGES, True), n, hi, PAGE, ROWS * H * D)
    v_dtype = tl.float16 if V_UNIT != 1.0 else q_ptr.dtype.element_ty
    if WINDOW > 0:
        for n0 in range(lo, masked_end, BLOCK_N):
            acc, k_scale, v_scale = _history_tile(
                acc, k_scale, v_scale, q, qpos, qid, history_row, m, cache_h, scales_h, page_row, chunk_pages,
                first_page, n0, hi, alpha, H, D, PAGE, ROWS, BLOCK_N, CHUNK_PAGES, True, PRECISION, SHIFT, WINDOW,
                CONTEXTUAL, FP8, v_dtype, V_UNIT)
    for n0 in range(unmasked_lo, unmasked_hi, BLOCK_N):
        acc, k_scale, v_scale = _history_tile(
            acc, k_scale, v_scale, q, qpos, qid, history_row, m, cache_h, scales_h, page_row, chunk_pages, first_page,
            n0, hi, alpha, H, D, PAGE, ROWS, BLOCK_N, CHUNK_PAGES, False, PRECISION, SHIFT, WINDOW, CONTEXTUAL,
            FP8, v_dtype, V_UNIT)
    for n0 in range(tl.maximum(unmasked_hi, masked_end), hi, BLOCK_N):
        acc, k_scale, v_scale = _history_tile(
            acc, k_scale, v_scale, q, qpos, qid, history_row, m, cache_h, scales_h, page_row, chunk_pages, first_page,
            n0, hi, alpha, H, D, PAGE, ROWS, BLOCK_N, CHUNK_PAGES, True, PRECISION, SHIFT, WINDOW, CONTEXTUAL,
            FP8, v_dtype, V_UNIT)
    if V_UNIT != 1.0:
        acc = acc * (1.0 / V_UNIT)
    if split == 0:
        # A candidate's own key: the only non-history key it sees.
        candidate = row_ok & (j >= appended)
        k_self = tl.load(k_ptr + token[:, None] * k_stride + head_cols, mask=candidate[:, None],
                         other=0.0).to(tl.float32)
        v_self = tl.load(v_ptr + token[:, None] * v_stride + head_cols, mask=candidate[:, None],
                         other=0.0).to(tl.float32)
        s = tl.sum(q.to(tl.float32) * k_self, axis=1) * alpha
        acc += (s * tl.sigmoid(s))[:, None] * v_self

    if INV_N_PER_USER:
        inv_n = tl.load(inv_n_ptr + user)
    else:
        inv_n = tl.load(inv_n_ptr)
    dst = dst_ptr + split.to(tl.int64) * split_stride + token[:, None] * (H * D) + head_cols
    tl.store(dst, (acc * inv_n).to(dst_ptr.dtype.element_ty), mask=row_ok[:, None])


class PagedAttention:
    """HSTU attention of one batch's queries over their users' paged history, with workspaces sized at construction:
    `run` allocates nothing and reads every length from device tensors, so one captured graph replays any batch within
    the capacity. `mask`: the model's mask options (target-aware candidates only). `max_seq_len`: the constant rule's
    N when `run` gets no 1/N tensor. `kv_dtype` None: the cache holds `dtype`, else uint8 pages of fp8 codes and scale
    rows (layerflow.tier.layout); `fp8_mma`: the tl kernel's MMA dtypes over them. `kernel`: select_kernel's choice of
    a Gluon kernel over the `tl` one, `gluon_tiling` its tiling (None: the default; its block_m sets the query block).
    `workspace`: where the split partials live when attentions that never run at once share them (None: its own).
    `splits` (splits.SPLIT_RULES): the split count of each launch's real query blocks (never more than the
    capacity's), or of the capacity; under a Gluon launcher that reads no table (the fp8 one unless its tiling's
    `row_splits`) the rule is "bucket" (`split_rule` says which one holds).
    """

    def __init__(self, max_batch: int, max_tokens: int, max_pages_per_user: int, num_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, device: torch.device | str, alpha: float, max_seq_len: int,
                 *, tiling: AttentionTiling | None = None, mask: MaskRule = MaskRule(),
                 kv_dtype: torch.dtype | None = None, kernel: str | None = None, fp8_mma: str | None = None,
                 gluon_tiling: GluonTiling | None = None, workspace: SplitWorkspace | None = None,
                 splits: str = "rows") -> None:
        for name, value in dict(max_batch=max_batch, max_tokens=max_tokens, max_pages_per_user=max_pages_per_user,
                                num_heads=num_heads, max_seq_len=max_seq_len).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        for name, value, allowed in (("head_dim", head_dim, HEAD_DIMS), ("page_size", page_size, PAGE_SIZES),
                                     ("dtype", dtype, DTYPES)):
            if value not in allowed:
                raise ValueError(f"{name}={value}: expected one of {allowed}")
        if not mask.target_aware:
            raise ValueError("mask.target_aware=False: the paged kernel serves target-aware candidates only")
        if kv_dtype is not None and kv_dtype not in FP8_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype}: expected None (the cache holds {dtype}) or one of {FP8_DTYPES}")
        self.kv_dtype, self.mask = kv_dtype, mask
        self.fp16_scores, self.value_unit = fp16_scores(fp8_mma, dtype, kv_dtype), value_unit(fp8_mma, dtype, kv_dtype)
        self.rows = page_size + (fp8_scale_rows(page_size, head_dim) if kv_dtype is not None else 0)
        self.max_batch, self.max_tokens, self.max_pages_per_user = max_batch, max_tokens, max_pages_per_user
        self.num_heads, self.head_dim, self.page_size, self.dtype = num_heads, head_dim, page_size, dtype
        self.device, self.alpha, self.max_seq_len = torch.device(device), float(alpha), max_seq_len
        self.constant_inv_n = torch.full((1,), 1.0 / max_seq_len, dtype=torch.float32, device=self.device)
        tiling = tiling or default_tiling(head_dim, dtype, triton.cdiv(max_tokens, max_batch))
        self.gluon = select_kernel(kernel, self.device, dtype, kv_dtype, head_dim, tiling.block_m, mask.max_attn_len,
                                   mask.contextual_len, gluon_tiling, page_size=page_size)
        self.block_m = self.gluon.tiling.query_block(tiling.block_m) if self.gluon else tiling.block_m
        rule = split_rule(splits)
        slots = sm_count(self.device) * tiling.programs_per_sm
        self.tiling, self.num_splits = tiling, tiling.num_splits or self._pick_splits(tiling, slots)
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits={self.num_splits}: expected 1..{MAX_SPLITS}")
        # Each user's last query block may be partial: at most (tokens + users * (block_m - 1)) // block_m blocks.
        self.query_slots = (max_tokens + max_batch * (self.block_m - 1)) // self.block_m
        self.split_rule = rule if self.gluon is None or self.gluon.row_splits else "bucket"
        # "rows": entry n is the split count of a launch with n real query blocks (n = 0: one), filling the share
        # of a wave the Gluon launcher asks for at this query block (bandwidth-bound blocks fill less).
        fill = self.gluon.wave_fill(self.block_m) if self.gluon is not None else 1.0
        table = rows_table(self.query_slots, num_heads, slots, self.num_splits, fill)
        rows = self.split_rule == "rows"
        self.split_table = torch.tensor(table, dtype=torch.int32, device=self.device) if rows else None
        self.active_splits = torch.full((1,), self.num_splits, dtype=torch.int32, device=self.device) if rows \
            else None
        # Entry 0 (no real block: every program exits) bounds no chunk.
        self.chunk_pages = self._chunk_pages(min(table[1:]) if rows else self.num_splits) if tiling.preload_pages \
            else 0
        shape = (self.num_splits, max_tokens, num_heads, head_dim)
        self.partials = None if self.num_splits == 1 else torch.empty(shape, dtype=torch.float32, device=self.device) \
            if workspace is None else workspace.view(shape)

    @classmethod
    def for_model(cls, config: HSTUConfig, max_batch: int, max_tokens: int, max_pages_per_user: int, page_size: int,
                  device: torch.device | str, *, tiling: AttentionTiling | None = None,
                  kv_dtype: torch.dtype | None = None, workspace: SplitWorkspace | None = None) -> "PagedAttention":
        """The attention of `config`'s layers (heads, alpha, mask, constant N; dqk == dv) over `kv_dtype` pages."""
        if config.dqk != config.dv:
            raise ValueError(f"dqk={config.dqk} != dv={config.dv}: the paged cache holds K and V at one head dim")
        return cls(max_batch, max_tokens, max_pages_per_user, config.num_heads, config.dqk, page_size, config.dtype,
                   device, config.alpha, config.max_seq_len, tiling=tiling, mask=config.mask_rule, kv_dtype=kv_dtype,
                   workspace=workspace)

    def _pick_splits(self, tiling: AttentionTiling, slots: int) -> int:
        """The splits whose grid, at full capacity split evenly over users, fills whole waves (wave_splits), at most
        one per tile of the longest history."""
        per_user = triton.cdiv(self.max_tokens, self.max_batch)
        programs = self.max_batch * triton.cdiv(per_user, self.block_m) * self.num_heads
        tiles = triton.cdiv(self.max_pages_per_user * self.page_size, tiling.block_n)
        return wave_splits(programs, slots, min(tiles, MAX_SPLITS))

    def _chunk_pages(self, fewest_splits: int) -> int:
        """Page-table entries one program's chunk can touch at `fewest_splits` (power of two for the register
        slice)."""
        longest, block_n = self.max_pages_per_user * self.page_size, self.tiling.block_n
        chunk = triton.cdiv(triton.cdiv(longest, fewest_splits), block_n) * block_n
        return triton.next_power_of_2(triton.cdiv(chunk, self.page_size) + 1)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
               appended_lens: torch.Tensor, out: torch.Tensor, inv_n: torch.Tensor) -> None:
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
        cache_rows = (2, self.rows, self.num_heads, self.head_dim)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != cache_rows or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)}: expected contiguous [pages, *{cache_rows}]")
        stored = self.dtype if self.kv_dtype is None else torch.uint8
        if kv_cache.dtype != stored:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype}: expected {stored}")
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
        if inv_n.dtype != torch.float32 or inv_n.dim() != 1 or inv_n.shape[0] not in (1, self.max_batch) or \
                not inv_n.is_contiguous():
            raise ValueError(f"inv_n {inv_n.dtype} shape {tuple(inv_n.shape)}: expected contiguous float32 [1] or "
                             f"[{self.max_batch}]")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            page_table: torch.Tensor, q_offsets: torch.Tensor, history_lens: torch.Tensor,
            appended_lens: torch.Tensor, out: torch.Tensor, inv_n: torch.Tensor | None = None,
            reduce: bool = True) -> torch.Tensor | SplitPartials:
        """out[t] = sum_j SiLU(alpha q_t . k_j) / N v_j over the keys token t sees; `inv_n`: 1/N on the device ([1] or
        [max_batch]; None: 1/max_seq_len). `reduce=False` returns a split kernel's partials unsummed (SplitPartials),
        for a consumer that sums them as it reads them (the output gate); one split: `out`."""
        inv_n = self.constant_inv_n if inv_n is None else inv_n
        self._check(q, k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, out, inv_n)
        t = self.tiling
        dst = out if self.partials is None else self.partials
        split_stride = self.max_tokens * self.num_heads * self.head_dim
        precision = "ieee" if self.dtype == torch.float32 else None
        grid = (self.num_splits, self.query_slots, self.num_heads)
        (self.gluon or _paged_attention_kernel)[grid](
            q, k, v, kv_cache, page_table, q_offsets, history_lens, appended_lens, inv_n, dst,
            q.stride(0), k.stride(0), v.stride(0), page_table.stride(0), split_stride, self.max_batch, self.alpha,
            H=self.num_heads, D=self.head_dim, PAGE=self.page_size,
            BATCH_P2=max(2, triton.next_power_of_2(self.max_batch)),
            NUM_SPLITS=self.num_splits, BLOCK_M=self.block_m, BLOCK_N=t.block_n, CHUNK_PAGES=self.chunk_pages,
            PRECISION=precision, INV_N_PER_USER=inv_n.shape[0] > 1, SHIFT=self.mask.id_shift,
            WINDOW=self.mask.max_attn_len, CONTEXTUAL=self.mask.contextual_len,
            ROWS=self.rows, FP8=kernel_code(self.kv_dtype), F16_QK=self.fp16_scores, V_UNIT=self.value_unit,
            split_table_ptr=self.split_table, active_splits_ptr=self.active_splits,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
        if self.partials is not None and not reduce:
            return SplitPartials(self.partials, self.active_splits)
        if self.partials is not None:
            sum_splits(SplitPartials(self.partials, self.active_splits), out, q_offsets, self.max_batch)
        return out
