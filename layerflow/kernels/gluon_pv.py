"""The "pv" schedule of the Gluon attention kernel (GluonTiling variant "pv"): warp-specialised, a loader warpgroup
copies every tile into its ring slot as soon as the slot is free while the block's warps (the consumer) run the dots,
the previous tile's O += P V on the tensor cores while they compute this tile's SiLU, so the SFU/ALU work of a tile
hides behind a dot instead of following both.

Per tile t the consumer issues S(t) = Q K(t)^T and then P(t-1) V(t-1) as asynchronous wgmma, waits for S(t) only,
hands K(t)'s slot back, computes P(t) = SiLU(S(t)) while P(t-1) V(t-1) runs, then waits for that dot and hands
V(t-1)'s slot back. K and V therefore have their own slots and barriers (k_ready / v_ready: the tile's keys or values
landed; k_empty / v_empty: the consumer is done with them), so the loader refills a K slot as soon as its S is done
while the V of the tile before is still being read: two stages are enough (a shared pair of slots would need three,
which at D=256 does not fit beside a 128-row query block).

Under "pv2" a 128-row block has two such consumers of 64 rows each (FIRST_ROW 0 and 64), partitions of their own
that read the same slots (each slot's empty barriers count both), so neither waits at the block's barrier for the
other's SiLU (the H200 ran 16K/256 in 46.2 us against 50.2 for one consumer of 128 rows); the upper one, where the
block's rows end in the lower half (a request's last block of 320 = 256 + 64 rows), runs no dot and only hands each
slot back once it is filled."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from layerflow.kernels.gluon_tiles import (_masked_silu, _query_rows, _row_bounds, _store_partial, _tile_page_pair,
                                          _tile_pages, _tile_silu, _whole_tiles)


@gluon.jit
def _pv_consumer(q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, num_tiles, num_hist, lo, hi, alpha,
                 appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr, q_stride, q_start, row0, q_len, head,
                 H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, TANH: gl.constexpr, WHOLE: gl.constexpr, FIRST_ROW: gl.constexpr,
                 q_layout: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """The block's warps under "pv" (one consumer of the block's rows from row0) or one half's under "pv2" (BLOCK_M
    rows from row0 + FIRST_ROW): its query rows into q_smem (q_ptr / q_stride the rows, loaded in q_layout) while
    the loader's first copies are in flight, tile 0's S and P, then per tile t >= 1 S(t) and P(t-1) V(t-1) issued
    together with P(t) computed between the two waits, then the last tile's P V and its rows' partial. TANH picks
    the SiLU, WHOLE skips the mask on the tiles every row sees whole (_tile_silu)."""
    dtype: gl.constexpr = q_smem.dtype
    q_smem.store(_query_rows(q_ptr, q_stride, q_start, row0 + FIRST_ROW, q_len, head, D, BLOCK_M, q_layout))
    fence_async_shared()
    gl.thread_barrier()
    r, self_end, hist_end = _row_bounds(FIRST_ROW, BLOCK_M, row0, q_len, appended, hist, hi, s_layout)
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    whole = _whole_tiles(hist_end, lo, num_hist, BLOCK_N)
    if num_tiles > 0:               # a split past the block's last key has no tile to wait for
        mbarrier.wait(k_ready.index(0), 0)
        fence_async_shared()
        raw = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(0), count=1)
        p = _tile_p(raw, alpha, 0, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH, WHOLE,
                    dtype, p_layout)
        for tile in range(1, num_tiles):
            slot = tile % STAGES
            prev = (tile - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (tile // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((tile - 1) // STAGES) & 1)
            fence_async_shared()
            raw = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_ring.index(prev), acc, is_async=True)
            raw = warpgroup_mma_wait(1, deps=[raw])
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(slot), count=1)
            p_next = _tile_p(raw, alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH,
                             WHOLE, dtype, p_layout)
            acc, p = warpgroup_mma_wait(0, deps=[acc, p])
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = p_next
        last = (num_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
        fence_async_shared()
        acc = warpgroup_mma(p, v_ring.index(last), acc)
    _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0 + FIRST_ROW, q_len, head, H, D, BLOCK_M,
                   o_layout)


@gluon.jit
def _pv_upper_consumer(q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, num_tiles, num_hist, lo, hi,
                       alpha, appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr, q_stride, q_start, row0,
                       q_len, head, H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, TANH: gl.constexpr, WHOLE: gl.constexpr, FIRST_ROW: gl.constexpr,
                       q_layout: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       p_layout: gl.constexpr):
    """The upper half's consumer under "pv2": _pv_consumer over its rows, or, where the block has none there, each
    tile's K and V slots handed back once they are filled (a slot's empty barrier counts both halves, and waiting
    for the fill keeps an early hand-back from completing the lower half's phase)."""
    if row0 + FIRST_ROW < q_len:
        _pv_consumer(q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, num_tiles, num_hist, lo, hi, alpha,
                     appended, hist, inv_n, dst_ptr, split, split_stride, q_ptr, q_stride, q_start, row0, q_len, head,
                     H, D, BLOCK_M, BLOCK_N, STAGES, TANH, WHOLE, FIRST_ROW, q_layout, s_layout, o_layout, p_layout)
    else:
        for tile in range(num_tiles):
            slot = tile % STAGES
            phase = (tile // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            mbarrier.arrive(k_empty.index(slot), count=1)
            mbarrier.wait(v_ready.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot), count=1)


@gluon.jit
def _tile_p(raw, alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N: gl.constexpr,
            TANH: gl.constexpr, WHOLE: gl.constexpr, dtype: gl.constexpr, p_layout: gl.constexpr):
    """Tile `tile`'s P in `dtype` and wgmma's register-operand layout from its raw scores Q K^T: _tile_silu with
    WHOLE, else _masked_silu."""
    if WHOLE:
        p = _tile_silu(raw, alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
    else:
        p = _masked_silu(raw * alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _tma_rows(cache_desc, buf, bar, page_a, page_b, n0, half, head, D: gl.constexpr, PAGE: gl.constexpr,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Bulk copies of the keys (half 0) or values (half 1) of the whole history tile n0 .. n0 + BLOCK_N (pages page_a,
    then page_b when a tile spans two) into `buf`, completing `bar` when its bytes landed. cache_desc views the pool
    as [pages * 2 * ROWS, H * D] rows with [min(PAGE, BLOCK_N), D] boxes."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    mbarrier.expect(bar, BLOCK_N * D * 2)          # 16-bit values
    tma.async_copy_global_to_shared(cache_desc, [page_a * (2 * ROWS) + half * ROWS + n0 % PAGE, head * D], bar,
                                    buf.slice(0, BOX))
    if BOX < BLOCK_N:
        tma.async_copy_global_to_shared(cache_desc, [page_b * (2 * ROWS) + half * ROWS, head * D], bar,
                                        buf.slice(BOX, BOX))


@gluon.jit
def _copy_rows(buf, ready, tile, page_row, num_hist, num_tiles, lo, hi, cache_h, src_ptr, src_stride, q_start,
               q_len, head, row0, half, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr,
               BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Tile `tile`'s keys (half 0, src_ptr the block's K rows) or values (half 1, its V rows) by every loader
    thread's cp.async into `buf`, `ready` completing when this partition's thread 0 has arrived and every thread's
    copies landed. History tiles (below num_hist) are keys lo + tile * BLOCK_N .. (pages from the user's page_row);
    the rest are the block's own (candidate) rows; rows out of range are zeroed."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    if tile < num_hist:
        page = _tile_pages(page_row, tile, lo, hi, PAGE, BLOCK_N, layout)
        n = lo + tile * BLOCK_N + rows
        row_at = page.to(gl.int64) * (2 * ROWS * H * D) + ((n % PAGE) * (H * D) + half * (ROWS * H * D)).to(gl.int64)
        async_copy.async_copy_global_to_shared(buf, cache_h + row_at[:, None] + cols[None, :], mask=(n < hi)[:, None])
    elif tile < num_tiles:
        j = row0 + (tile - num_hist) * BLOCK_N + rows
        token = (q_start + j).to(gl.int64)
        async_copy.async_copy_global_to_shared(buf, src_ptr + token[:, None] * src_stride + head * D + cols[None, :],
                                               mask=(j < q_len)[:, None])
    async_copy.mbarrier_arrive(ready)
    gl.thread_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _pv_producer(k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, num_tiles, num_hist, lo, hi, page_row, cache_h,
                 pool, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr,
                 PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 TMA: gl.constexpr):
    """The loader partition under "pv": tile t + 1's keys, then tile t's values, each once its slot is free, so the
    keys (needed a dot earlier, their slots freed a dot earlier) run a tile ahead of the values. With TMA, `pool`
    is the page pool's descriptor and whole history tiles go by TMA; every other tile, all of them without TMA, by
    cp.async (_load_half)."""
    cols_per_warp: gl.constexpr = 32 if D // 8 >= 32 else D // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_per_warp, cols_per_warp], [gl.num_warps(), 1],
                                            [1, 0])
    whole = gl.maximum(hi - lo, 0) // BLOCK_N
    for step in range(num_tiles + 1):
        if step < num_tiles:
            _load_half(k_ring, k_ready, k_empty, step, 0, whole, num_hist, num_tiles, lo, hi, page_row, cache_h, pool,
                       k_ptr, k_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N, STAGES, TMA, layout)
        if step > 0:
            _load_half(v_ring, v_ready, v_empty, step - 1, 1, whole, num_hist, num_tiles, lo, hi, page_row, cache_h,
                       pool, v_ptr, v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N, STAGES, TMA,
                       layout)


@gluon.jit
def _load_half(ring, ready, empty, tile, half, whole, num_hist, num_tiles, lo, hi, page_row, cache_h, pool, src_ptr,
               src_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
               ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TMA: gl.constexpr,
               layout: gl.constexpr):
    """Tile `tile`'s keys (half 0) or values (half 1) into its slot of `ring` once the slot is free: by TMA for the
    split's first `whole` tiles under TMA (_tma_rows), else by cp.async (_copy_rows)."""
    slot = tile % STAGES
    mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
    if TMA:
        if tile < whole:
            n0 = lo + tile * BLOCK_N
            page_a, page_b = _tile_page_pair(page_row, n0, PAGE, BLOCK_N)
            _tma_rows(pool, ring.index(slot), ready.index(slot), page_a, page_b, n0, half, head, D, PAGE, ROWS,
                      BLOCK_N)
        else:
            _copy_rows(ring.index(slot), ready.index(slot), tile, page_row, num_hist, num_tiles, lo, hi, cache_h,
                       src_ptr, src_stride, q_start, q_len, head, row0, half, H, D, PAGE, ROWS, BLOCK_N, layout)
    else:
        _copy_rows(ring.index(slot), ready.index(slot), tile, page_row, num_hist, num_tiles, lo, hi, cache_h, src_ptr,
                   src_stride, q_start, q_len, head, row0, half, H, D, PAGE, ROWS, BLOCK_N, layout)
