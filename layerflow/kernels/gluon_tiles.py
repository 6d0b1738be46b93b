"""The per-tile pieces of the Gluon attention kernel (layerflow.kernels.gluon_attention), shared by its schedules:
the program's (user, query block), a tile's page ids, the async copies of a tile into a ring slot, the masked SiLU
of a tile's scores and the store of the block's partial."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _query_blocks(q_offsets_ptr, max_batch, BATCH_P2: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """(users, valid, blocks): each user's query blocks, ceil(len / BLOCK_M), over BATCH_P2 lanes (0 past the batch)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    users = gl.arange(0, BATCH_P2, layout=layout)
    valid = users < max_batch
    starts = gl.load(q_offsets_ptr + users, mask=valid, other=0)
    ends = gl.load(q_offsets_ptr + users + 1, mask=valid, other=0)
    return users, valid, gl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)


@gluon.jit
def _user_block(q_offsets_ptr, slot, max_batch, BATCH_P2: gl.constexpr, BLOCK_M: gl.constexpr,
                num_warps: gl.constexpr):
    """(user, query block of that user) of a program slot, as the `tl` kernel numbers them; user == max_batch past
    the batch."""
    users, valid, blocks = _query_blocks(q_offsets_ptr, max_batch, BATCH_P2, BLOCK_M, num_warps)
    inclusive = gl.associative_scan(blocks, 0, _add)
    user = gl.sum((valid & (inclusive <= slot)).to(gl.int32), axis=0)
    first = gl.sum(gl.where(users == user, inclusive - blocks, 0), axis=0)
    return user, slot - first


@gluon.jit
def _row_splits(q_offsets_ptr, max_batch, split_table_ptr, active_splits_ptr, BATCH_P2: gl.constexpr,
                BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """The launch's split count under the "rows" rule (layerflow.kernels.splits): the table's entry for the batch's
    real query blocks; program (0, 0, 0) also stores it where the split sum reads it."""
    _, _, blocks = _query_blocks(q_offsets_ptr, max_batch, BATCH_P2, BLOCK_M, num_warps)
    splits = gl.load(split_table_ptr + gl.sum(blocks, axis=0))
    if (gl.program_id(0) == 0) & (gl.program_id(1) == 0) & (gl.program_id(2) == 0):
        gl.store(active_splits_ptr, splits)
    return splits


@gluon.jit
def _block_rows(q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, BLOCK_M: gl.constexpr):
    """The block's rows and its user's lengths: (q_start, q_len, row0, hist, appended, last, kv_end); `last` is the
    block's last row, kv_end the end of the history keys any of its rows sees (the default mask)."""
    q_start = gl.load(q_offsets_ptr + user)
    q_len = gl.load(q_offsets_ptr + user + 1) - q_start
    hist = gl.load(history_lens_ptr + user)
    appended = gl.load(appended_lens_ptr + user)
    row0 = block * BLOCK_M
    last = gl.minimum(row0 + BLOCK_M, q_len) - 1
    kv_end = gl.minimum(hist, hist - appended + last + 1)
    return q_start, q_len, row0, hist, appended, last, kv_end


@gluon.jit
def _split_range(q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The program's rows and keys: (q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles). History keys
    [lo, hi) are the `tl` kernel's split of [0, hist) for the default mask (chunks of whole tiles, the block's last row
    bounding what any of its rows sees); the candidates' own keys are BLOCK_M // BLOCK_N more tiles, run by split 0."""
    q_start, q_len, row0, hist, appended, last, kv_end = _block_rows(q_offsets_ptr, history_lens_ptr,
                                                                     appended_lens_ptr, user, block, BLOCK_M)
    chunk = gl.cdiv(gl.cdiv(hist, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, kv_end)
    num_hist = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    num_tiles = num_hist + gl.where((split == 0) & (last >= appended), BLOCK_M // BLOCK_N, 0)
    return q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles


@gluon.jit
def _balanced_range(q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """_split_range's values with the candidates' self tiles counted in the split: the block's history tiles and its
    BLOCK_M // BLOCK_N self tiles (a block with candidates) are dealt evenly, chunks of whole tiles from key 0, and
    the last split runs the self tiles after what history it has left, so no program runs more than
    ceil(tiles / splits) of them where split 0 ran its chunk and the self tiles (2K history, 11 splits: 5 tiles
    where the others ran 3)."""
    q_start, q_len, row0, hist, appended, last, kv_end = _block_rows(q_offsets_ptr, history_lens_ptr,
                                                                     appended_lens_ptr, user, block, BLOCK_M)
    self_tiles = gl.where(last >= appended, BLOCK_M // BLOCK_N, 0)
    chunk = gl.cdiv(gl.cdiv(kv_end, BLOCK_N) + self_tiles, num_splits) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, kv_end)
    num_hist = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    num_tiles = num_hist + gl.where(split == num_splits - 1, self_tiles, 0)
    return q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles


@gluon.jit
def _program_range(q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SELF_LAST: gl.constexpr):
    """_balanced_range's values with SELF_LAST (the last split runs the self tiles), else _split_range's (split 0
    does)."""
    if SELF_LAST:
        q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles = _balanced_range(
            q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits, BLOCK_M, BLOCK_N)
    else:
        q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles = _split_range(
            q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits, BLOCK_M, BLOCK_N)
    return q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles


@gluon.jit
def _query_rows(q_ptr, q_stride, q_start, row0, q_len, head, D: gl.constexpr, ROWS_M: gl.constexpr,
                layout: gl.constexpr):
    """The block's query rows row0 .. row0 + ROWS_M of head `head` ([ROWS_M, D], zero past q_len)."""
    rows = gl.arange(0, ROWS_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    token = (q_start + row0 + rows).to(gl.int64)
    return gl.load(q_ptr + token[:, None] * q_stride + head * D + cols[None, :], mask=(row0 + rows < q_len)[:, None],
                   other=0.0)


@gluon.jit
def _row_bounds(first_row, ROWS_M: gl.constexpr, row0, q_len, appended, hist, hi, layout: gl.constexpr):
    """Which keys rows first_row .. first_row + ROWS_M of the block (r, numbered within the block) see: history
    key n < hist_end (causal for appended rows, all history for candidates, below the split's hi), and in a self
    tile the key numbered r, candidates only (self keys r .. self_end)."""
    r = first_row + gl.arange(0, ROWS_M, layout=gl.SliceLayout(1, layout))
    j = row0 + r
    history_row = j < appended
    hist_end = gl.minimum(gl.where(history_row, hist - appended + j + 1, hist), hi)
    self_end = gl.where(~history_row & (j < q_len), r + 1, r)
    return r, self_end, hist_end


@gluon.jit
def _tile_pages(page_row, tile, lo, hi, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Page ids of history tile `tile`'s rows (0 for rows past hi, so any tile number is safe to ask for)."""
    n = lo + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    return gl.load(page_row + n // PAGE, mask=n < hi, other=0)


@gluon.jit
def _tile_page_pair(page_row, n0, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """(page_a, page_b): the pages of the history tile from key n0, page_b the second one where a tile spans two
    pages (PAGE < BLOCK_N), else page_a again."""
    page_a = gl.load(page_row + n0 // PAGE)
    if PAGE < BLOCK_N:
        page_b = gl.load(page_row + n0 // PAGE + 1)
    else:
        page_b = page_a
    return page_a, page_b


@gluon.jit
def _issue_tile(k_buf, v_buf, tile, page, num_hist, num_tiles, lo, hi, cache_h, k_ptr, v_ptr, k_stride,
                v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Start copying tile `tile`'s K and V rows into (k_buf, v_buf) and commit one async-copy group (empty past the
    last tile, so the group count stays one per tile). Tiles below num_hist are history keys lo + tile * BLOCK_N ..
    on pages `page` (_tile_pages); the rest are the block's own (candidate) K/V rows. Rows out of range are zeroed."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    if tile < num_hist:
        n = lo + tile * BLOCK_N + rows
        key_ok = n < hi
        row_at = page.to(gl.int64) * (2 * ROWS * H * D) + ((n % PAGE) * (H * D)).to(gl.int64)
        ptrs = cache_h + row_at[:, None] + cols[None, :]
        async_copy.async_copy_global_to_shared(k_buf, ptrs, mask=key_ok[:, None])
        async_copy.async_copy_global_to_shared(v_buf, ptrs + ROWS * H * D, mask=key_ok[:, None])
    elif tile < num_tiles:
        j = row0 + (tile - num_hist) * BLOCK_N + rows
        token = (q_start + j).to(gl.int64)
        row_ok = j < q_len
        head_cols = head * D + cols[None, :]
        async_copy.async_copy_global_to_shared(k_buf, k_ptr + token[:, None] * k_stride + head_cols,
                                               mask=row_ok[:, None])
        async_copy.async_copy_global_to_shared(v_buf, v_ptr + token[:, None] * v_stride + head_cols,
                                               mask=row_ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _seen(tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr):
    """Which of tile `tile`'s keys each row sees: history tiles hold keys lo + tile * BLOCK_N .. (row sees key <
    hist_end); in a self tile local key c + tile offset == the row's own index (candidates only)."""
    is_self = tile >= num_hist
    key = gl.where(is_self, (tile - num_hist) * BLOCK_N, lo + tile * BLOCK_N) + key_cols
    key_lo = gl.where(is_self, r, 0)
    key_hi = gl.where(is_self, self_end, hist_end)
    return (key[None, :] >= key_lo[:, None]) & (key[None, :] < key_hi[:, None])


@gluon.jit
def _silu_of_seen(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr):
    """SiLU(s) where a row sees the tile's key (_seen), else 0."""
    seen = _seen(tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N)
    return gl.where(seen, s / (1.0 + gl.exp2(-LOG2E * s)), 0.0)


@gluon.jit
def _tanh_silu_of_seen(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr):
    """SiLU(s) = s/2 (1 + tanh(s/2)) where a row sees the tile's key, else 0: one tanh.approx.f32 on the SFU per
    score instead of an exp2 and a reciprocal (relative error ~2^-11, below the 16-bit rounding of P)."""
    half = 0.5 * s
    tanh = _tanh(half)
    seen = _seen(tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N)
    return gl.where(seen, half + half * tanh, 0.0)


@gluon.jit
def _tanh(x):
    """tanh.approx.f32 of each element."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _whole_tiles(hist_end, lo, num_hist, BLOCK_N: gl.constexpr):
    """How many of the split's history tiles, from its first, every row of the block sees whole (hist_end: each
    row's end of history, _row_bounds), so their SiLU needs no mask."""
    return gl.minimum(gl.maximum(gl.min(hist_end, axis=0) - lo, 0) // BLOCK_N, num_hist)


@gluon.jit
def _tile_silu(raw, alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr,
               TANH: gl.constexpr):
    """_masked_silu of alpha * raw (raw = Q K^T), without the mask on the first `whole` tiles (_whole_tiles); there
    the tanh SiLU takes alpha / 2 in one product (the same values: halving is exact)."""
    if tile < whole:
        if TANH:
            half = raw * (0.5 * alpha)
            p = half + half * _tanh(half)
        else:
            s = raw * alpha
            p = s / (1.0 + gl.exp2(-LOG2E * s))
    else:
        p = _masked_silu(raw * alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
    return p


@gluon.jit
def _masked_silu(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr, TANH: gl.constexpr):
    """_tanh_silu_of_seen with TANH, else _silu_of_seen."""
    if TANH:
        p = _tanh_silu_of_seen(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N)
    else:
        p = _silu_of_seen(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N)
    return p


@gluon.jit
def _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H: gl.constexpr,
                   D: gl.constexpr, BLOCK_M: gl.constexpr, o_layout: gl.constexpr):
    """The block's rows of split `split`'s partial (or of the output when there is one split), times 1/N."""
    o_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_token = (q_start + row0 + o_rows).to(gl.int64)
    dst = dst_ptr + split.to(gl.int64) * split_stride + o_token[:, None] * (H * D) + head * D + o_cols[None, :]
    gl.store(dst, (acc * inv_n).to(dst_ptr.dtype.element_ty), mask=(row0 + o_rows < q_len)[:, None])
