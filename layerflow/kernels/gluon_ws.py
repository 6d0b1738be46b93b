"""The warp-specialised schedule of the Gluon attention kernel (GluonTiling variant "ws"): a loader
warpgroup copies each tile into the next free ring slot and the block's warps run both dots, handing slots back and
forth through two mbarriers per slot (ready: the tile landed; empty: the dots are done with it)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, warpgroup_mma

from layerflow.kernels.gluon_tiles import _issue_tile, _silu_of_seen, _store_partial, _tile_pages


@gluon.jit
def _ws_consumer(q_smem, k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, alpha, r, self_end, hist_end,
                 key_cols, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H: gl.constexpr,
                 D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """The warp-specialised kernel's default partition: both dots of each tile once the producer says it has
    landed, then the slot back to the producer, then the block's partial."""
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    for tile in range(num_tiles):
        slot = tile % STAGES
        mbarrier.wait(ready.index(slot), (tile // STAGES) & 1)
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False) * alpha
        p = _silu_of_seen(s, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = warpgroup_mma(p, v_ring.index(slot), acc)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)
    _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H, D, BLOCK_M, o_layout)


@gluon.jit
def _ws_producer(k_ring, v_ring, ready, empty, num_tiles, num_hist, lo, hi, page_row, cache_h, k_ptr, v_ptr,
                 k_stride, v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr,
                 PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The warp-specialised kernel's loader partition: each tile's copies into the next free slot, page ids one
    tile ahead; `ready` completes when this partition's thread 0 has arrived and every thread's copies landed."""
    cols_per_warp: gl.constexpr = 32 if D // 8 >= 32 else D // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_per_warp, cols_per_warp], [gl.num_warps(), 1],
                                            [1, 0])
    pages = _tile_pages(page_row, 0, lo, hi, PAGE, BLOCK_N, layout)
    for tile in range(num_tiles):
        slot = tile % STAGES
        mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
        _issue_tile(k_ring.index(slot), v_ring.index(slot), tile, pages, num_hist, num_tiles, lo, hi, cache_h,
                    k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N, layout)
        pages = _tile_pages(page_row, tile + 1, lo, hi, PAGE, BLOCK_N, layout)
        async_copy.mbarrier_arrive(ready.index(slot))
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)
