"""The warp-specialised schedule of the Gluon attention kernel (GluonTiling variant "ws"): a loader warpgroup copies
each tile into the next free ring slot and the block's warps run both dots, handing slots back and forth through two
mbarriers per slot (ready: the tile landed; empty: the consumer is done with it). The loader moves history tiles by
cp.async (every thread, masked rows zeroed) or, with TMA, whole tiles by bulk tensor copies of page boxes (one
thread, mbarrier expect-tx), the ragged last tile and self tiles by cp.async."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from layerflow.kernels.gluon_tiles import (_issue_tile, _masked_silu, _row_bounds, _store_partial, _tile_page_pair,
                                          _tile_pages, _tile_silu, _whole_tiles)


@gluon.jit
def _ws_consumer(q_smem, k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, hi, alpha, appended, hist, inv_n,
                 dst_ptr, split, split_stride, q_start, row0, q_len, head, H: gl.constexpr, D: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                 TANH: gl.constexpr, WHOLE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                 p_layout: gl.constexpr):
    """The block's warps: both dots of each tile once the producer says it has landed, the slot back to the
    producer, then the block's partial. With OVERLAP the next tile's S = Q K^T runs on the tensor cores while this
    tile's SiLU runs (_overlapped_tiles); TANH picks the SiLU (_masked_silu); WHOLE skips the mask on the tiles
    every row sees whole (_tile_silu)."""
    r, self_end, hist_end = _row_bounds(0, BLOCK_M, row0, q_len, appended, hist, hi, s_layout)
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if OVERLAP:
        if num_tiles > 0:           # a split past the block's last key has no tile to wait for
            acc = _overlapped_tiles(q_smem, k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, alpha, r, self_end,
                                    hist_end, key_cols, s_zero, acc, BLOCK_N, STAGES, TANH, p_layout)
    else:
        whole = _whole_tiles(hist_end, lo, num_hist, BLOCK_N)
        for tile in range(num_tiles):
            slot = tile % STAGES
            mbarrier.wait(ready.index(slot), (tile // STAGES) & 1)
            fence_async_shared()
            raw = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False)
            if WHOLE:
                p = _tile_silu(raw, alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
            else:
                p = _masked_silu(raw * alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
            p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            acc = warpgroup_mma(p, v_ring.index(slot), acc)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(slot), count=1)
    _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H, D, BLOCK_M, o_layout)


@gluon.jit
def _overlapped_tiles(q_smem, k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, alpha, r, self_end, hist_end,
                      key_cols, s_zero, acc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TANH: gl.constexpr,
                      p_layout: gl.constexpr):
    """The consumer's tile loop with asynchronous wgmma: tile t + 1's S is issued before tile t's SiLU and tile t's
    P V after it; both are waited for (P among the dependencies, its registers being an operand) before tile t's
    slot goes back. The consumer holds two slots while the producer fills the others (STAGES >= 3). The last
    iteration issues its own S again (result unused) rather than wait for a tile that is never loaded. Returns the
    accumulator."""
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
    for tile in range(num_tiles):
        slot = tile % STAGES
        ahead = gl.minimum(tile + 1, num_tiles - 1)
        mbarrier.wait(ready.index(ahead % STAGES), (ahead // STAGES) & 1)
        fence_async_shared()
        s_next = warpgroup_mma(q_smem, k_ring.index(ahead % STAGES).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        p = _masked_silu(s * alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = warpgroup_mma(p, v_ring.index(slot), acc, is_async=True)
        s, acc, p = warpgroup_mma_wait(0, deps=[s_next, acc, p])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)
    return acc


@gluon.jit
def _tma_tile(cache_desc, k_buf, v_buf, bar, page_a, page_b, n0, head, D: gl.constexpr, PAGE: gl.constexpr,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Bulk copies of the whole history tile of keys n0 .. n0 + BLOCK_N (pages page_a, then page_b when a tile
    spans two) into (k_buf, v_buf), completing `bar` when all its bytes landed. cache_desc views the pool as
    [pages * 2 * ROWS, H * D] rows with [min(PAGE, BLOCK_N), D] boxes."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    mbarrier.expect(bar, 2 * BLOCK_N * D * 2)          # K and V, 16-bit values
    k_row = page_a * (2 * ROWS) + n0 % PAGE
    tma.async_copy_global_to_shared(cache_desc, [k_row, head * D], bar, k_buf.slice(0, BOX))
    tma.async_copy_global_to_shared(cache_desc, [k_row + ROWS, head * D], bar, v_buf.slice(0, BOX))
    if BOX < BLOCK_N:
        k_row = page_b * (2 * ROWS)
        tma.async_copy_global_to_shared(cache_desc, [k_row, head * D], bar, k_buf.slice(BOX, BOX))
        tma.async_copy_global_to_shared(cache_desc, [k_row + ROWS, head * D], bar, v_buf.slice(BOX, BOX))


@gluon.jit
def _copy_tile(k_ring, v_ring, ready, empty, tile, pages, num_hist, num_tiles, lo, hi, page_row, cache_h, k_ptr, v_ptr,
               k_stride, v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
               ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Tile `tile` by every loader thread's cp.async (page ids `pages`) once its slot is free, `ready` completing
    when this partition's thread 0 has arrived and every thread's copies landed; returns the next tile's page ids."""
    slot = tile % STAGES
    mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
    _issue_tile(k_ring.index(slot), v_ring.index(slot), tile, pages, num_hist, num_tiles, lo, hi, cache_h, k_ptr,
                v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N, layout)
    next_pages = _tile_pages(page_row, tile + 1, lo, hi, PAGE, BLOCK_N, layout)
    async_copy.mbarrier_arrive(ready.index(slot))
    gl.thread_barrier()
    mbarrier.arrive(ready.index(slot), count=1)
    return next_pages


@gluon.jit
def _ws_producer(k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, hi, page_row, cache_h, pool, k_ptr,
                 v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr,
                 PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 TMA: gl.constexpr):
    """The warp-specialised kernel's loader partition: each tile's copies into the next free slot, page ids
    loaded before waiting for the slot. With TMA, `pool` is the page pool's descriptor (_tma_tile) and whole history
    tiles go by TMA; every other tile (all of them without TMA) by cp.async (_copy_tile)."""
    cols_per_warp: gl.constexpr = 32 if D // 8 >= 32 else D // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_per_warp, cols_per_warp], [gl.num_warps(), 1],
                                            [1, 0])
    if TMA:
        whole = gl.maximum(hi - lo, 0) // BLOCK_N
    else:
        whole = 0
    pages = _tile_pages(page_row, whole, lo, hi, PAGE, BLOCK_N, layout)
    for tile in range(num_tiles):
        slot = tile % STAGES
        if TMA:
            if tile < whole:
                n0 = lo + tile * BLOCK_N
                page_a, page_b = _tile_page_pair(page_row, n0, PAGE, BLOCK_N)
                mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
                _tma_tile(pool, k_ring.index(slot), v_ring.index(slot), ready.index(slot), page_a, page_b, n0, head,
                          D, PAGE, ROWS, BLOCK_N)
            else:
                pages = _copy_tile(k_ring, v_ring, ready, empty, tile, pages, num_hist, num_tiles, lo, hi, page_row,
                                   cache_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE,
                                   ROWS, BLOCK_N, STAGES, layout)
        else:
            pages = _copy_tile(k_ring, v_ring, ready, empty, tile, pages, num_hist, num_tiles, lo, hi, page_row,
                               cache_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE,
                               ROWS, BLOCK_N, STAGES, layout)
