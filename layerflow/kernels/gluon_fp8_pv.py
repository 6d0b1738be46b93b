"""The "pv" schedule of the fp8 Gluon attention kernel (Fp8Tiling.schedule "pv", with Q K^T on fp8 MMAs): the bf16
kernel's schedule (layerflow.kernels.gluon_pv) over fp8 pages. Per tile t the block's warps issue S(t) on e4m3 MMAs
(the two query terms) and P(t-1) V(t-1) as asynchronous wgmma, wait for S(t) only, hand K(t)'s slot back and compute
P(t) = SiLU(S(t)) while P(t-1) V(t-1) runs, so the SiLU hides behind the V dot instead of following both dots.

K and V have their own slots and barriers (k_ready / v_ready: the slot holds its tile; k_empty / v_empty: the dots
are done with it), so a K slot is refilled once its S is done while the V of the tile before is still read. The key
codes need no decode: a history tile's codes are copied by cp.async straight into its NVMMA-swizzled e4m3 K slot
(the layout the fp8 wgmma reads) with the 4-byte words holding its keys' scale bytes, the slot signalled when the
copies land (no register round trip, no wait in the loader); a self tile (the block's own keys) is quantised by the
cache's rule into the slot. The values are decoded by the loader as in the "ws" schedule: their codes travel
`code_stages` tiles ahead in a ring of code slots, each decoded (times its row's scale) into the next free bf16 V
slot.

The second query term's dot comes first and is waited for (its rescaling by the terms' power-of-two quotient needs
it), then the first's accumulates onto it beside the V dot: two S accumulators live at once spilled in the "ws"
build (gluon_fp8_qk._fp8_scores)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from layerflow.kernels.gluon_fp8_qk import _e4m3_row_bytes, _query_scales
from layerflow.kernels.gluon_fp8_tiles import _code_layout, _fill_tile, _scale_of, _self_rows
from layerflow.kernels.gluon_pv import _tile_p
from layerflow.kernels.gluon_tiles import _store_partial, _tile_pages, _whole_tiles


@gluon.jit
def _key_scales(k_words, key_cols, s_layout: gl.constexpr):
    """The fp32 scales of a K slot's keys as S's columns: byte n % 4 of key n's scale word (0 for a zeroed word)."""
    words = k_words.load(gl.SliceLayout(0, s_layout))
    return _scale_of((words >> (8 * (key_cols % 4))) & 255)


@gluon.jit
def _scaled(s, first, alpha, k_words, key_cols, s_layout: gl.constexpr):
    """alpha S: the first query term's row scales and alpha times the K slot's key scales applied to `s` at once,
    before the slot goes back (so the scales are not held through the SiLU: registers the V dot in flight needs)."""
    return s * first * (alpha * _key_scales(k_words, key_cols, s_layout))[None, :]


@gluon.jit
def _scores(q_terms, k_slot, ratio, s_zero):
    """Issue S = Q K^T of one K slot on fp8 MMAs, unscaled by the first term's row scales: the second term's dot,
    waited for and rescaled by `ratio`, then the first's accumulated onto it asynchronously (the caller waits)."""
    keys = k_slot.permute((1, 0))
    s = warpgroup_mma(q_terms.index(1), keys, s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s]) * ratio
    return warpgroup_mma(q_terms.index(0), keys, s, is_async=True)


@gluon.jit
def _fp8_pv_consumer(q_terms, q_scales, k_ring, k_words, v_ring, p_ring, k_ready, v_ready, k_empty, v_empty,
                     num_tiles, num_hist, lo, alpha, r, self_end, hist_end, key_cols, inv_n, dst_ptr, split,
                     split_stride, q_start, row0, q_len, head, H: gl.constexpr, D: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TANH: gl.constexpr,
                     WHOLE: gl.constexpr, P_SMEM: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                     p_layout: gl.constexpr):
    """The block's warps: tile 0's S and P, then per tile t >= 1 S(t) and P(t-1) V(t-1) in flight together with
    P(t) computed between the two waits, the last tile's P V, and the block's partial. WHOLE skips the mask on the
    tiles every row sees whole (gluon_tiles._tile_silu). P_SMEM: P is the V dot's operand from shared memory (two
    buffers in p_ring) instead of registers, so no P is held in registers while the V dot runs (the "pvs" schedule:
    64-key tiles at D=256 without the wgmma serialised for registers); else p_ring is unused."""
    dtype: gl.constexpr = v_ring.dtype
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    first, ratio = _query_scales(q_scales, 2, s_layout)
    if WHOLE:
        whole = _whole_tiles(hist_end, lo, num_hist, BLOCK_N)
    else:  # unused: every tile is masked
        whole = 0
    if num_tiles > 0:               # a split past the block's last key has no tile to wait for
        mbarrier.wait(k_ready.index(0), 0)
        fence_async_shared()        # the K slot's cp.async writes, before the tensor cores read it
        s = _scores(q_terms, k_ring.index(0), ratio, s_zero)
        s = warpgroup_mma_wait(0, deps=[s])
        s = _scaled(s, first, alpha, k_words.index(0), key_cols, s_layout)
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(0), count=1)
        if P_SMEM:
            p_ring.index(0).store(_tile_p(s, 1.0, 0, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N,
                                          TANH, WHOLE, dtype, s_layout))
            fence_async_shared()
            gl.thread_barrier()
        else:
            p = _tile_p(s, 1.0, 0, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH, WHOLE, dtype,
                        p_layout)
        for tile in range(1, num_tiles):
            slot = tile % STAGES
            prev = (tile - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (tile // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((tile - 1) // STAGES) & 1)
            fence_async_shared()
            s = _scores(q_terms, k_ring.index(slot), ratio, s_zero)
            if P_SMEM:
                acc = warpgroup_mma(p_ring.index((tile - 1) % 2), v_ring.index(prev), acc, is_async=True)
            else:
                acc = warpgroup_mma(p, v_ring.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])
            s = _scaled(s, first, alpha, k_words.index(slot), key_cols, s_layout)
            gl.thread_barrier()
            mbarrier.arrive(k_empty.index(slot), count=1)
            if P_SMEM:   # P(t) into the buffer P(t - 2) V(t - 2) read (done), while P(t - 1) V(t - 1) reads the other
                p_ring.index(tile % 2).store(_tile_p(s, 1.0, tile, whole, num_hist, lo, r, self_end, hist_end,
                                                     key_cols, BLOCK_N, TANH, WHOLE, dtype, s_layout))
                fence_async_shared()
                acc = warpgroup_mma_wait(0, deps=[acc])
            else:
                p_next = _tile_p(s, 1.0, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH,
                                 WHOLE, dtype, p_layout)
                acc, p = warpgroup_mma_wait(0, deps=[acc, p])
                p = p_next
            gl.thread_barrier()
            mbarrier.arrive(v_empty.index(prev), count=1)
        last = (num_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
        if P_SMEM:
            acc = warpgroup_mma(p_ring.index((num_tiles - 1) % 2), v_ring.index(last), acc)
        else:
            acc = warpgroup_mma(p, v_ring.index(last), acc)
    _store_partial(acc, inv_n, dst_ptr, split, split_stride, q_start, row0, q_len, head, H, D, BLOCK_M, o_layout)


@gluon.jit
def _history_rows(tile, page, lo, hi, cache_h, scales_h, half, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """History tile `tile`'s code pointers [BLOCK_N, D] and scale-word pointers [BLOCK_N] of its keys (half 0) or
    values (half 1) on pages `page`, and which keys exist (below hi)."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    n = lo + tile * BLOCK_N + rows
    page_at = page.to(gl.int64) * (2 * ROWS * H * D) + half * (ROWS * H * D)
    codes = cache_h + (page_at + ((n % PAGE) * (H * D)).to(gl.int64))[:, None] + cols[None, :]
    words = (scales_h + page_at + (n % PAGE - n % 4)).to(gl.pointer_type(gl.int32), bitcast=True)
    return codes, words, n < hi


@gluon.jit
def _stage_keys(k_slot, k_word_slot, ready, tile, page, num_hist, lo, hi, cache_h, scales_h, k_ptr, k_stride,
                q_start, q_len, head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_N: gl.constexpr, FILL_ROWS: gl.constexpr, layout: gl.constexpr):
    """Tile `tile`'s keys into an e4m3 K slot and their scale words into k_word_slot, `ready` completing when they
    are there for the tensor cores: a history tile by cp.async of its codes and words (keys past hi zeroed: zero
    codes, a zero scale), `ready` tracking the copies; a self tile quantised by the cache's rule, its scale byte
    placed at byte n % 4 of key n's word."""
    if tile < num_hist:
        codes, words, key_ok = _history_rows(tile, page, lo, hi, cache_h, scales_h, 0, H, D, PAGE, ROWS, BLOCK_N,
                                             layout)
        async_copy.async_copy_global_to_shared(k_slot, codes.to(gl.pointer_type(gl.float8e4nv), bitcast=True),
                                               mask=key_ok[:, None])
        async_copy.async_copy_global_to_shared(k_word_slot, words, mask=key_ok)
        async_copy.mbarrier_arrive(ready)
    else:
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            token, head_cols, row_ok = _self_rows(q_start, q_len, head, row0, tile - num_hist, c, D, BLOCK_N,
                                                  FILL_ROWS, layout)
            keys = gl.load(k_ptr + token * k_stride + head_cols, mask=row_ok, other=0.0)
            key_codes, scale_bytes = _e4m3_row_bytes(keys.to(gl.float32))
            k_slot.slice(c * FILL_ROWS, FILL_ROWS).store(key_codes)
            shift = 8 * (gl.arange(0, FILL_ROWS, layout=gl.SliceLayout(1, layout)) % 4)
            k_word_slot.slice(c * FILL_ROWS, FILL_ROWS).store(scale_bytes << shift)
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _issue_value_codes(v_codes, v_words, tile, page, num_hist, lo, hi, cache_h, scales_h, H: gl.constexpr,
                       D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                       layout: gl.constexpr):
    """Start copying history tile `tile`'s value codes and scale words into a code slot and commit one group (empty
    past the history, so there is one group per tile)."""
    if tile < num_hist:
        codes, words, key_ok = _history_rows(tile, page, lo, hi, cache_h, scales_h, 1, H, D, PAGE, ROWS, BLOCK_N,
                                             layout)
        async_copy.async_copy_global_to_shared(v_codes, codes, mask=key_ok[:, None])
        async_copy.async_copy_global_to_shared(v_words, words, mask=key_ok)
    async_copy.commit_group()


@gluon.jit
def _fp8_pv_producer(k_ring, k_words, v_ring, v_codes, v_words, k_ready, v_ready, k_empty, v_empty, num_tiles,
                     num_hist, lo, hi, page_row, cache_h, scales_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len,
                     head, row0, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_STAGES: gl.constexpr,
                     FILL_ROWS: gl.constexpr, FP8: gl.constexpr, DECODE_BITS: gl.constexpr):
    """The loader: per step, tile t + 1's keys once their slot is free (_stage_keys), then tile t's values decoded
    from their landed code slot into the next free V slot, that code slot then refilled with tile t + CODE_STAGES's
    codes. The keys run a tile ahead of the values, as the dots need them."""
    layout: gl.constexpr = _code_layout(D, gl.num_warps())
    for t in gl.static_range(CODE_STAGES):
        _issue_value_codes(v_codes.index(t), v_words.index(t), t, _tile_pages(page_row, t, lo, hi, PAGE, BLOCK_N,
                                                                              layout),
                           num_hist, lo, hi, cache_h, scales_h, H, D, PAGE, ROWS, BLOCK_N, layout)
    k_pages = _tile_pages(page_row, 0, lo, hi, PAGE, BLOCK_N, layout)
    v_pages = _tile_pages(page_row, CODE_STAGES, lo, hi, PAGE, BLOCK_N, layout)
    for step in range(num_tiles + 1):
        if step < num_tiles:
            slot = step % STAGES
            mbarrier.wait(k_empty.index(slot), ((step // STAGES) & 1) ^ 1)
            _stage_keys(k_ring.index(slot), k_words.index(slot), k_ready.index(slot), step, k_pages, num_hist, lo, hi,
                        cache_h, scales_h, k_ptr, k_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N,
                        FILL_ROWS, layout)
            k_pages = _tile_pages(page_row, step + 1, lo, hi, PAGE, BLOCK_N, layout)
        if step > 0:
            tile = step - 1
            slot = tile % STAGES
            code_slot = tile % CODE_STAGES
            async_copy.wait_group(CODE_STAGES - 1)
            mbarrier.wait(v_empty.index(slot), ((tile // STAGES) & 1) ^ 1)
            gl.thread_barrier()
            v_slot = v_ring.index(slot)
            _fill_tile(v_slot, v_slot, v_slot, v_slot, v_codes.index(code_slot), v_codes.index(code_slot),
                       v_words.index(code_slot), v_words.index(code_slot), tile, num_hist, v_ptr, v_ptr, v_stride,
                       v_stride, q_start, q_len, head, row0, D, BLOCK_N, FILL_ROWS, FP8, True, False, DECODE_BITS,
                       layout, False)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(v_ready.index(slot), count=1)
            _issue_value_codes(v_codes.index(code_slot), v_words.index(code_slot), tile + CODE_STAGES, v_pages,
                               num_hist, lo, hi, cache_h, scales_h, H, D, PAGE, ROWS, BLOCK_N, layout)
            v_pages = _tile_pages(page_row, tile + CODE_STAGES + 1, lo, hi, PAGE, BLOCK_N, layout)
