"""The warp-specialised partitions of the fp8 Gluon attention kernel (layerflow.kernels.gluon_fp8): the block's
warps run both dots of each decoded tile; a loader partition keeps the code pipeline going and decodes each landed
tile into the next free bf16 slot of the ring, through a ring of code slots or (one code slot) refilling the one
slot as soon as it is decoded. Slots change hands through two mbarriers each (ready: decoded; empty: the dots are
done with it)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, warpgroup_mma

from layerflow.kernels.gluon_fp8_qk import _fill_key_codes, _fp8_scores, _query_scales
from layerflow.kernels.gluon_fp8_tiles import (_advance_codes, _code_layout, _fill_tile, _issue_codes, _start_codes,
                                              _tile_dots)
from layerflow.kernels.gluon_tiles import _store_partial, _tile_pages, _whole_tiles


@gluon.jit
def _fp8_consumer(q_smem, q_scales, k_ring, v_ring, k_dot_scales, v_dot_scales, ready, empty, num_tiles, num_hist, lo,
                  alpha, r, self_end, hist_end, key_cols, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len,
                  head, H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, DOT_SCALES: gl.constexpr, TANH: gl.constexpr, WHOLE: gl.constexpr,
                  QK_TERMS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Default partition: both dots of each tile once the loader says its slot is filled, the slot back to
    the loader, then the block's partial. WHOLE: no mask on the tiles every row sees whole (_whole_tiles).
    QK_TERMS > 0: q_smem holds that many e4m3 query terms (row scales in q_scales) and the K slots e4m3 codes
    (their scales in k_dot_scales): Q K^T on fp8 MMAs (gluon_fp8_qk)."""
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    if WHOLE:
        whole = _whole_tiles(hist_end, lo, num_hist, BLOCK_N)
    else:  # unused: every tile is masked
        whole = 0
    if QK_TERMS > 0:
        first_scale, ratio = _query_scales(q_scales, QK_TERMS, s_layout)
    else:  # unused: the queries are in the model's dtype
        first_scale, ratio = alpha, alpha
    for tile in range(num_tiles):
        slot = tile % STAGES
        mbarrier.wait(ready.index(slot), (tile // STAGES) & 1)
        fence_async_shared()
        if QK_TERMS > 0:
            raw = _fp8_scores(q_smem, k_ring.index(slot), first_scale, ratio, s_zero, QK_TERMS)
        else:
            raw = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False)
        acc = _tile_dots(raw, v_ring.index(slot), k_dot_scales.index(slot), v_dot_scales.index(slot), acc, alpha,
                         tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N,
                         DOT_SCALES or QK_TERMS > 0, DOT_SCALES, TANH, WHOLE, s_layout, p_layout)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)
    _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H, D, BLOCK_M, o_layout)


@gluon.jit
def _fp8_producer(k_ring, v_ring, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales, v_scales, ready, empty,
                  num_tiles, num_hist, lo, hi, page_row, cache_h, scales_h, k_ptr, v_ptr, k_stride, v_stride, q_start,
                  q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_STAGES: gl.constexpr, FILL_ROWS: gl.constexpr,
                  FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr, DOT_SCALES: gl.constexpr,
                  DECODE_BITS: gl.constexpr, QK_TERMS: gl.constexpr):
    """Loader partition: the code pipeline, and each landed tile decoded into the next free bf16 slot (with
    QK_TERMS > 0 its K as e4m3 codes: _fill_slot); `ready` completes once every loader thread's stores are visible
    to the tensor cores."""
    layout: gl.constexpr = _code_layout(D, gl.num_warps())
    pages, k_bytes, v_bytes = _start_codes(k_codes, v_codes, k_scales, v_scales, num_hist, lo, hi, page_row, cache_h,
                                           scales_h, H, D, PAGE, ROWS, BLOCK_N, CODE_STAGES, ASYNC_SCALES, layout)
    for tile in range(num_tiles):
        pages, k_bytes, v_bytes = _advance_codes(tile, pages, k_bytes, v_bytes, k_codes, v_codes, k_scales, v_scales,
                                                 num_hist, lo, hi, page_row, cache_h, scales_h, H, D, PAGE, ROWS,
                                                 BLOCK_N, CODE_STAGES, ASYNC_SCALES, layout)
        slot = tile % STAGES
        code_slot = tile % CODE_STAGES
        mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
        _fill_slot(k_ring.index(slot), v_ring.index(slot), k_dot_scales.index(slot), v_dot_scales.index(slot),
                   k_codes.index(code_slot), v_codes.index(code_slot), k_scales.index(code_slot),
                   v_scales.index(code_slot), tile, num_hist, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head,
                   row0, D, BLOCK_N, FILL_ROWS, FP8, ASYNC_SCALES, DOT_SCALES, DECODE_BITS, QK_TERMS, layout)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _fp8_one_slot_producer(k_ring, v_ring, k_dot_scales, v_dot_scales, k_codes, v_codes, k_words, v_words, ready,
                           empty, num_tiles, num_hist, lo, hi, page_row, cache_h, scales_h, k_ptr, v_ptr, k_stride,
                           v_stride, q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                           ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           FILL_ROWS: gl.constexpr, FP8: gl.constexpr, DOT_SCALES: gl.constexpr,
                           DECODE_BITS: gl.constexpr, QK_TERMS: gl.constexpr):
    """Loader partition with one code slot (code_stages 1, "async" scale words): tile t + 1's codes are issued as
    soon as every loader thread has decoded tile t out of the slot (and signalled its bf16 slot), so they are in
    flight while the loader waits for the next free bf16 slot."""
    layout: gl.constexpr = _code_layout(D, gl.num_warps())
    k_slot, v_slot, k_word_slot, v_word_slot = k_codes.index(0), v_codes.index(0), k_words.index(0), v_words.index(0)
    _issue_codes(k_slot, v_slot, k_word_slot, v_word_slot, 0, _tile_pages(page_row, 0, lo, hi, PAGE, BLOCK_N, layout),
                 num_hist, lo, hi, cache_h, scales_h, H, D, PAGE, ROWS, BLOCK_N, True, layout)
    pages = _tile_pages(page_row, 1, lo, hi, PAGE, BLOCK_N, layout)
    for tile in range(num_tiles):
        slot = tile % STAGES
        async_copy.wait_group(0)
        mbarrier.wait(empty.index(slot), ((tile // STAGES) & 1) ^ 1)
        gl.thread_barrier()
        _fill_slot(k_ring.index(slot), v_ring.index(slot), k_dot_scales.index(slot), v_dot_scales.index(slot), k_slot,
                   v_slot, k_word_slot, v_word_slot, tile, num_hist, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len,
                   head, row0, D, BLOCK_N, FILL_ROWS, FP8, True, DOT_SCALES, DECODE_BITS, QK_TERMS, layout)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)
        _issue_codes(k_slot, v_slot, k_word_slot, v_word_slot, tile + 1, pages, num_hist, lo, hi, cache_h, scales_h,
                     H, D, PAGE, ROWS, BLOCK_N, True, layout)
        pages = _tile_pages(page_row, tile + 2, lo, hi, PAGE, BLOCK_N, layout)


@gluon.jit
def _fill_slot(k_dst, v_dst, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales, v_scales, tile, num_hist, k_ptr,
               v_ptr, k_stride, v_stride, q_start, q_len, head, row0, D: gl.constexpr, BLOCK_N: gl.constexpr,
               FILL_ROWS: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr, DOT_SCALES: gl.constexpr,
               DECODE_BITS: gl.constexpr, QK_TERMS: gl.constexpr, layout: gl.constexpr):
    """One ring slot for tile `tile`: _fill_tile, or with QK_TERMS > 0 its K as e4m3 codes and their scales
    (gluon_fp8_qk._fill_key_codes) and its V by _fill_tile."""
    if QK_TERMS > 0:
        _fill_key_codes(k_dst, k_dot_scales, k_codes, k_scales, tile, num_hist, k_ptr, k_stride, q_start, q_len, head,
                        row0, D, BLOCK_N, FILL_ROWS, ASYNC_SCALES, layout)
    _fill_tile(k_dst, v_dst, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales, v_scales, tile, num_hist, k_ptr,
               v_ptr, k_stride, v_stride, q_start, q_len, head, row0, D, BLOCK_N, FILL_ROWS, FP8, ASYNC_SCALES,
               DOT_SCALES, DECODE_BITS, layout, QK_TERMS == 0)
