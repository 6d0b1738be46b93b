"""q.k on fp8 MMAs in the fp8 Gluon kernel (layerflow.kernels.gluon_fp8, tiling `qk` "fp8x2"): Hopper's
wgmma takes e4m3 operands at twice the bf16 rate if both are K-major in shared memory, and a K page holds
[tokens, D] with D contiguous, which is K-major for Q K^T: the cached K codes feed the dot as they landed, with no
decode. The queries become e4m3 terms once per program (layerflow.kernels.fp8.query_terms: one term, or two whose sum
keeps about bf16's 8 significant bits), each with a power-of-two scale per row; the keys' scales multiply the columns
of S. All scales are powers of two, so S is the dot over the dequantised terms and keys (the fp8 MMA accumulates in
fp32 at its own precision). The V dot stays in the model's dtype: V pages are MN-major for it, which fp8 wgmma does
not take. The block's own keys (self tiles) are quantised by the cache's rule as the loader stages them, so every K
tile the dots read holds e4m3 codes."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

from layerflow.kernels.gluon_fp8_tiles import _row_scales, _scale_of, _self_rows

QUERY_CHUNK = gl.constexpr(32)    # query rows quantised per step (bounds the registers it takes)


@gluon.jit
def _e4m3_rows(x):
    """(e4m3 codes, fp32 scale per row) of fp32 rows `x` by the cache's rule (layerflow.kernels.fp8.quantise): the
    scale 2^k, k the smallest with max|x| * 2^-k <= 448, clamped to [-126, 126]; codes rounded to nearest even."""
    bits = gl.max(gl.abs(x), axis=1).to(gl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32) - 8
    k = gl.minimum(gl.maximum(k, -126), 126)
    codes = (x * _scale_of(127 - k)[:, None]).to(gl.float8e4nv)
    return codes, _scale_of(k + 127)


@gluon.jit
def _store_query_terms(q_terms, q_scales, q_ptr, q_stride, q_start, row0, q_len, head, D: gl.constexpr,
                       BLOCK_M: gl.constexpr, TERMS: gl.constexpr, layout: gl.constexpr):
    """The block's queries as TERMS e4m3 terms into q_terms [TERMS, BLOCK_M, D] and their row scales into q_scales
    [TERMS, BLOCK_M]: each term quantises what the terms before it missed (exact fp32 differences); zero past q_len."""
    rows = gl.arange(0, QUERY_CHUNK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(BLOCK_M // QUERY_CHUNK):
        j = row0 + c * QUERY_CHUNK + rows
        token = (q_start + j).to(gl.int64)
        rest = gl.load(q_ptr + token[:, None] * q_stride + head * D + cols[None, :], mask=(j < q_len)[:, None],
                       other=0.0).to(gl.float32)
        for t in gl.static_range(TERMS):
            codes, scales = _e4m3_rows(rest)
            q_terms.index(t).slice(c * QUERY_CHUNK, QUERY_CHUNK).store(codes)
            q_scales.index(t).slice(c * QUERY_CHUNK, QUERY_CHUNK).store(scales)
            rest = rest - codes.to(gl.float32) * scales[:, None]


@gluon.jit
def _fill_key_codes(k_dst, k_dot_scales, k_codes, k_scales, tile, num_hist, k_ptr, k_stride, q_start, q_len, head,
                    row0, D: gl.constexpr, BLOCK_N: gl.constexpr, FILL_ROWS: gl.constexpr,
                    ASYNC_SCALES: gl.constexpr, layout: gl.constexpr):
    """Tile `tile`'s keys as e4m3 codes into k_dst and their fp32 scales into k_dot_scales: a history tile's landed
    codes moved as they are (bytes, no decode), a self tile's rows (the block's own K) quantised by the cache's rule,
    zero past q_len."""
    if tile < num_hist:
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            raw = k_codes.slice(c * FILL_ROWS, FILL_ROWS).load(layout)
            k_dst.slice(c * FILL_ROWS, FILL_ROWS).store(raw.to(gl.float8e4nv, bitcast=True))
        k_dot_scales.store(_row_scales(k_scales, BLOCK_N, ASYNC_SCALES, layout))
    else:
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            token, head_cols, row_ok = _self_rows(q_start, q_len, head, row0, tile - num_hist, c, D, BLOCK_N,
                                                  FILL_ROWS, layout)
            keys = gl.load(k_ptr + token * k_stride + head_cols, mask=row_ok, other=0.0)
            codes, scales = _e4m3_rows(keys.to(gl.float32))
            k_dst.slice(c * FILL_ROWS, FILL_ROWS).store(codes)
            k_dot_scales.slice(c * FILL_ROWS, FILL_ROWS).store(scales)


@gluon.jit
def _query_scales(q_scales, TERMS: gl.constexpr, s_layout: gl.constexpr):
    """The first query term's row scales as a [BLOCK_M, 1] column of S, and the second term's over the first's
    (a power of two; the first's again when TERMS is 1: unused)."""
    first = q_scales.index(0).load(gl.SliceLayout(1, s_layout))[:, None]
    if TERMS == 2:
        ratio = q_scales.index(1).load(gl.SliceLayout(1, s_layout))[:, None] / first
    else:
        ratio = first
    return first, ratio


@gluon.constexpr_function
def _scores_layout(num_warps, BLOCK_N, TERMS):
    """The layout of S: a wgmma accumulator of the depth of the dot's operands (32 with e4m3 queries, else 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, BLOCK_N, 32 if TERMS > 0 else 16])


@gluon.jit
def _fp8_scores(q_terms, k_tile, first_scale, ratio, s_zero, TERMS: gl.constexpr):
    """Q K^T of one tile of e4m3 key codes (their scales not applied) on fp8 MMAs (s_zero: a zero S in
    _scores_layout): the sum over the query terms of each term's dot times its row scale. With two terms the first's
    dot accumulates onto the second's times `ratio` (the scales' quotient) in one accumulator, so only one S is
    live (the sm_90 build: 7 spill stores, not 43); all scales are powers of two, so the rescaling is exact."""
    keys = k_tile.permute((1, 0))
    if TERMS == 2:
        s = warpgroup_mma(q_terms.index(1), keys, s_zero, use_acc=False) * ratio
        s = warpgroup_mma(q_terms.index(0), keys, s)
    else:
        s = warpgroup_mma(q_terms.index(0), keys, s_zero, use_acc=False)
    return s * first_scale
