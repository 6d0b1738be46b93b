"""The V dot on e4m3 MMAs in the fp8 Gluon kernel (layerflow.kernels.gluon_fp8, tiling `pv` "fp8", with `qk`
"fp8x2"): fp8 wgmma takes only K-major operands, and P V reduces over the keys, so the V codes are read from pages
that store them transposed (layerflow.kernels.fp8.transpose_value_codes: `[H, D, page]` per page, a page's tokens
contiguous per head and dim) into `[D, BLOCK_N]` slots: no decode. Each key's V scale (and 1/N) multiplies its column
of the weights before they are quantised by the cache's rule per row of the tile (fp8.weight_terms, one term: a
power-of-two scale per row and tile), so the tile's dot over the codes times the row scales is the dot over the
dequantised values up to the weights' e4m3 rounding. The fp8 MMA accumulates at reduced precision and is not
promoted, so each tile's dot runs into a fresh accumulator that is added to O times the tile's row scales (exact);
to bound the registers O is held as four column chunks of D / 4, each with its own MMA per tile. The candidates'
own values are quantised by the cache's rule as the loader stages them (paged_attention_reference's `p_terms`)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from layerflow.kernels.gluon_fp8_qk import _e4m3_rows, _fp8_scores, _query_scales, _self_row_codes
from layerflow.kernels.gluon_fp8_tiles import _row_scales, _value_code_layout
from layerflow.kernels.gluon_tiles import _masked_silu, _store_partial, _tile_silu, _whole_tiles

CHUNKS = gl.constexpr(4)     # column chunks of O (each D / 4 wide, its own accumulator and MMA per tile)


@gluon.constexpr_function
def _chunk_layout(num_warps, D):
    """The layout of one column chunk of O: a wgmma accumulator of N = D / CHUNKS at the fp8 instruction's depth."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, D // CHUNKS.value, 32])


@gluon.jit
def _fill_value_codes(v_dst, v_dot_scales, v_codes, v_scales, tile, num_hist, lo, hi, v_ptr, v_stride, q_start,
                      q_len, head, row0, D: gl.constexpr, BLOCK_N: gl.constexpr, FILL_ROWS: gl.constexpr,
                      ASYNC_SCALES: gl.constexpr, layout: gl.constexpr):
    """Tile `tile`'s values as e4m3 codes [D, BLOCK_N] into v_dst and their fp32 scales into v_dot_scales: a history
    tile's landed transposed codes moved as they are (bytes; zero for keys at or past hi, which the copy brings with
    their run of 16: a page's unwritten bytes may hold any code, NaN ones included, and a zero weight does not
    cancel a NaN in the dot), a self tile's rows (the block's own V) quantised by the cache's rule and stored
    transposed, zero past q_len."""
    if tile < num_hist:
        t_layout: gl.constexpr = _value_code_layout(BLOCK_N, gl.num_warps())
        rows: gl.constexpr = D // 4
        key_ok = (lo + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, t_layout)) < hi)[None, :]
        for c in gl.static_range(4):
            raw = gl.where(key_ok, v_codes.slice(c * rows, rows).load(t_layout), 0)
            v_dst.slice(c * rows, rows).store(raw.to(gl.float8e4nv, bitcast=True))
        v_dot_scales.store(_row_scales(v_scales, BLOCK_N, ASYNC_SCALES, layout))
    else:
        keys_major = v_dst.permute((1, 0))
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            codes, scales = _self_row_codes(v_ptr, v_stride, q_start, q_len, head, row0, tile - num_hist, c, D,
                                            BLOCK_N, FILL_ROWS, layout)
            keys_major.slice(c * FILL_ROWS, FILL_ROWS).store(codes)
            v_dot_scales.slice(c * FILL_ROWS, FILL_ROWS).store(scales)


@gluon.jit
def _chunk_dot(a, v_tile, c: gl.constexpr, acc, o_zero, tile_scale, D: gl.constexpr):
    """acc + (a . column chunk c of the V tile) * tile_scale, the dot in a fresh accumulator."""
    width: gl.constexpr = D // CHUNKS
    part = warpgroup_mma(a, v_tile.slice(c * width, width).permute((1, 0)), o_zero, use_acc=False)
    return acc + part * tile_scale


@gluon.jit
def _fp8_pv_consumer(q_smem, q_scales, k_ring, v_ring, k_dot_scales, v_dot_scales, ready, empty, num_tiles, num_hist,
                     lo, alpha, r, self_end, hist_end, key_cols, inv_n, dst_ptr, split, split_stride, q_start, row0,
                     q_len, head, H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, TANH: gl.constexpr, WHOLE: gl.constexpr, QK_TERMS: gl.constexpr,
                     s_layout: gl.constexpr):
    """Default partition with both dots on fp8 MMAs: per filled tile S from the e4m3 query terms and key codes
    (gluon_fp8_qk._fp8_scores), the masked SiLU times each key's scales (K inside, V and 1/N outside), the weights
    quantised per row, their dot with the V codes chunk by chunk; then the block's partial (1/N already applied)."""
    chunk_layout: gl.constexpr = _chunk_layout(gl.num_warps(), D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=chunk_layout, k_width=4)
    width: gl.constexpr = D // CHUNKS
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([BLOCK_M, width], gl.float32, chunk_layout)
    acc0, acc1, acc2, acc3 = o_zero, o_zero, o_zero, o_zero
    if WHOLE:
        whole = _whole_tiles(hist_end, lo, num_hist, BLOCK_N)
    else:  # unused: every tile is masked
        whole = 0
    first_scale, ratio = _query_scales(q_scales, QK_TERMS, s_layout)
    for tile in range(num_tiles):
        slot = tile % STAGES
        mbarrier.wait(ready.index(slot), (tile // STAGES) & 1)
        fence_async_shared()
        raw = _fp8_scores(q_smem, k_ring.index(slot), first_scale, ratio, s_zero, QK_TERMS)
        col_alpha = (alpha * k_dot_scales.index(slot).load(gl.SliceLayout(0, s_layout)))[None, :]
        if WHOLE:
            p = _tile_silu(raw, col_alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
        else:
            p = _masked_silu(raw * col_alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
        value_scales = v_dot_scales.index(slot).load(gl.SliceLayout(0, s_layout)) * inv_n
        codes, row_scales = _e4m3_rows(p * value_scales[None, :])
        a = gl.convert_layout(codes, a_layout)
        tile_scale = gl.convert_layout(row_scales, gl.SliceLayout(1, chunk_layout))[:, None]
        v_tile = v_ring.index(slot)
        acc0 = _chunk_dot(a, v_tile, 0, acc0, o_zero, tile_scale, D)
        acc1 = _chunk_dot(a, v_tile, 1, acc1, o_zero, tile_scale, D)
        acc2 = _chunk_dot(a, v_tile, 2, acc2, o_zero, tile_scale, D)
        acc3 = _chunk_dot(a, v_tile, 3, acc3, o_zero, tile_scale, D)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)
    # A chunk is a head of D / 4 columns in a row of H * 4 of them: _store_partial's addressing as it is.
    _store_partial(acc0, 1.0, dst_ptr, split, split_stride, q_start, row0, q_len, head * CHUNKS, H * CHUNKS, width,
                   BLOCK_M, chunk_layout)
    _store_partial(acc1, 1.0, dst_ptr, split, split_stride, q_start, row0, q_len, head * CHUNKS + 1, H * CHUNKS,
                   width, BLOCK_M, chunk_layout)
    _store_partial(acc2, 1.0, dst_ptr, split, split_stride, q_start, row0, q_len, head * CHUNKS + 2, H * CHUNKS,
                   width, BLOCK_M, chunk_layout)
    _store_partial(acc3, 1.0, dst_ptr, split, split_stride, q_start, row0, q_len, head * CHUNKS + 3, H * CHUNKS,
                   width, BLOCK_M, chunk_layout)
