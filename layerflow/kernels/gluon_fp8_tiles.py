"""The per-tile pieces of the fp8 Gluon attention kernel (layerflow.kernels.gluon_fp8): the code slots' layouts,
the async copies of a tile's fp8 codes, its scale bytes, the decode of a landed tile into the dots' dtype (scaled, or
the codes alone with their scales beside them; by the native conversion or by bit moves), the code pipeline's
prologue and step, and the SiLU and V dot of a filled tile."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, warpgroup_mma

from layerflow.kernels.gluon_tiles import _masked_silu, _tile_pages, _tile_silu


@gluon.constexpr_function
def _code_layout(D, num_warps):
    """[rows, D] tiles of bytes: 16-byte vectors along D, warps stacked along the rows."""
    cols_per_warp = min(32, D // 16)
    return gl.BlockedLayout([1, 16], [32 // cols_per_warp, cols_per_warp], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _code_smem_layout(D):
    """Code slots: rows of D bytes, swizzled across as many 16-byte units as a row holds (at most 8)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, D), element_bitwidth=8, rank=2)


@gluon.jit
def _issue_codes(k_codes, v_codes, k_words, v_words, tile, page, num_hist, lo, hi, cache_h, scales_h,
                 H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 ASYNC_SCALES: gl.constexpr, layout: gl.constexpr):
    """Start copying the K and V codes of history tile `tile` (pages `page`) into a code slot, with ASYNC_SCALES
    each key's scale word into (k_words, v_words), and commit one group (empty for tiles past the history, so there
    is one group per tile); keys at or past hi are zeroed (codes and scale words)."""
    if tile < num_hist:
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        n = lo + tile * BLOCK_N + rows
        key_ok = n < hi
        page_at = page.to(gl.int64) * (2 * ROWS * H * D)
        ptrs = cache_h + (page_at + ((n % PAGE) * (H * D)).to(gl.int64))[:, None] + cols[None, :]
        async_copy.async_copy_global_to_shared(k_codes, ptrs, mask=key_ok[:, None])
        async_copy.async_copy_global_to_shared(v_codes, ptrs + ROWS * H * D, mask=key_ok[:, None])
        if ASYNC_SCALES:
            word_at = scales_h + page_at + (n % PAGE - n % 4)
            async_copy.async_copy_global_to_shared(k_words, word_at.to(gl.pointer_type(gl.int32), bitcast=True),
                                                   mask=key_ok)
            async_copy.async_copy_global_to_shared(
                v_words, (word_at + ROWS * H * D).to(gl.pointer_type(gl.int32), bitcast=True), mask=key_ok)
    async_copy.commit_group()


@gluon.jit
def _load_scale_bytes(scales_h, tile, page, lo, hi, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                      ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The K and V scale bytes (int32) of history tile `tile`'s keys (layerflow.tier.layout: `[H, PAGE]` bytes
    after an fp8 page half's codes); 127 (a scale of 1) for keys at or past hi."""
    n = lo + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    ok = n < hi
    ptrs = scales_h + page.to(gl.int64) * (2 * ROWS * H * D) + n % PAGE
    k_bytes = gl.load(ptrs, mask=ok, other=127)
    v_bytes = gl.load(ptrs + ROWS * H * D, mask=ok, other=127)
    return k_bytes.to(gl.int32), v_bytes.to(gl.int32)


@gluon.jit
def _scale_of(scale_bytes):
    """2^(byte - 127) as fp32: a scale byte is the fp32 exponent field of its scale."""
    return (scale_bytes << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _row_scales(scales, ROWS_N: gl.constexpr, ASYNC_SCALES: gl.constexpr, layout: gl.constexpr):
    """The fp32 scales of a slot's ROWS_N rows (the slice starts at a multiple of 4 rows): stored as they are, or
    (ASYNC_SCALES) byte n % 4 of each key n's little-endian scale word; a zeroed word gives a scale of 0."""
    if ASYNC_SCALES:
        words = scales.load(gl.SliceLayout(1, layout))
        shift = 8 * (gl.arange(0, ROWS_N, layout=gl.SliceLayout(1, layout)) % 4)
        return _scale_of((words >> shift) & 255)
    else:
        return scales.load(gl.SliceLayout(1, layout))


@gluon.constexpr_function
def _bits_asm(fp8_format, scaled):
    """PTX of the bit-move decode of four fp8 codes ($2, bytes 0..3) into two bf16x2 words ($0: codes 0, 1; $1: codes
    2, 3), times the bf16x2 scale pair of their row ($3, $4) when `scaled`. Each code's byte, sign-extended to 16 bits
    by one prmt per pair, shifted and masked is the bf16 whose sign, exponent and mantissa are the code's own: that
    bf16 is the code's value times 2^-120 (e4m3; 2^-112 for e5m2), subnormal codes included (they land on bf16
    subnormals of the same ratio); one exact multiply by 2^120 (2^112) gives the code's value, one by the scale 2^k
    the product rounded once to bf16, what the conversion through fp32 gives. No conversion instruction: integer and
    bf16 multiplies only. Codes the quantiser never writes (NaN, inf) decode to finite values."""
    shift, mask, bias = (4, "0x87F087F0", "0x7B807B80") if fp8_format == 1 else (5, "0x8FE08FE0", "0x77807780")
    last = ("mul.rn.bf16x2 $0, t0, $3;\nmul.rn.bf16x2 $1, t1, $4;" if scaled else
            "mov.b32 $0, t0;\nmov.b32 $1, t1;")
    return ("{\n.reg .b32 t0, t1, bias;\n"
            f"mov.b32 bias, {bias};\n"
            "prmt.b32 t0, $2, 0, 0x9180;\nprmt.b32 t1, $2, 0, 0xB3A2;\n"
            f"shl.b32 t0, t0, {shift};\nshl.b32 t1, t1, {shift};\n"
            f"and.b32 t0, t0, {mask};\nand.b32 t1, t1, {mask};\n"
            "mul.rn.bf16x2 t0, t0, bias;\nmul.rn.bf16x2 t1, t1, bias;\n"
            f"{last}\n}}")


@gluon.jit
def _bits_decode(raw, scales, FP8: gl.constexpr, SCALED: gl.constexpr):
    """The bf16 values of fp8 codes `raw` (uint8 [rows, D]) times their row's scale (`scales` [rows, 1], bf16), or
    without SCALED the codes' values alone (`scales` unused), by bit moves (_bits_asm): bit for bit the conversion's
    result for every finite code."""
    asm: gl.constexpr = _bits_asm(FP8, SCALED)
    if SCALED:
        values = gl.inline_asm_elementwise(asm, "=r,=r,r,r,r", [raw, scales], dtype=gl.bfloat16, is_pure=True,
                                           pack=4)
    else:
        values = gl.inline_asm_elementwise(asm, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)
    return values


@gluon.jit
def _decode_rows(dst, codes, scales, ROWS_N: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr,
                 DOT_SCALES: gl.constexpr, DECODE_BITS: gl.constexpr, layout: gl.constexpr):
    """dst = codes * scales (one scale per row) in dst's dtype, or with DOT_SCALES the codes alone (the dots apply
    the scales); exact either way: a code (times a power of two). DECODE_BITS (bf16 dst): by bit moves
    (_bits_decode), else by the native conversion through fp32; the same bits."""
    raw = codes.load(layout)
    if DECODE_BITS:
        if DOT_SCALES:
            dst.store(_bits_decode(raw, raw, FP8, False))
        else:
            row_scales = _row_scales(scales, ROWS_N, ASYNC_SCALES, layout).to(gl.bfloat16)
            dst.store(_bits_decode(raw, row_scales[:, None], FP8, True))
    else:
        if FP8 == 1:
            values = raw.to(gl.float8e4nv, bitcast=True)
        else:
            values = raw.to(gl.float8e5, bitcast=True)
        if DOT_SCALES:
            dst.store(values.to(dst.dtype))
        else:
            dst.store((values.to(gl.float32) * _row_scales(scales, ROWS_N, ASYNC_SCALES, layout)[:, None]).to(
                dst.dtype))


@gluon.jit
def _self_rows(q_start, q_len, head, row0, self_tile, c, D: gl.constexpr, BLOCK_N: gl.constexpr,
               FILL_ROWS: gl.constexpr, layout: gl.constexpr):
    """Rows c * FILL_ROWS .. of the block's self tile `self_tile` (its own K/V rows, [tokens, H * D] tensors): their
    tokens [FILL_ROWS, 1] (int64, times the tensor's row stride by the caller), the head's columns [1, D] and which
    rows exist (before q_len)."""
    j = row0 + self_tile * BLOCK_N + c * FILL_ROWS + gl.arange(0, FILL_ROWS, layout=gl.SliceLayout(1, layout))
    head_cols = head * D + gl.arange(0, D, layout=gl.SliceLayout(0, layout))[None, :]
    return (q_start + j).to(gl.int64)[:, None], head_cols, (j < q_len)[:, None]


@gluon.jit
def _fill_tile(k_dst, v_dst, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales, v_scales, tile, num_hist, k_ptr,
               v_ptr, k_stride, v_stride, q_start, q_len, head, row0, D: gl.constexpr, BLOCK_N: gl.constexpr,
               FILL_ROWS: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr, DOT_SCALES: gl.constexpr,
               DECODE_BITS: gl.constexpr, layout: gl.constexpr, KEYS: gl.constexpr):
    """Tile `tile`'s K and V in the dots' dtype into (k_dst, v_dst), FILL_ROWS rows at a time (bounding the
    registers it takes): a history tile decoded from its landed code slot and scale slot, a self tile (past the
    history) the block's own K/V rows, zero past q_len. With DOT_SCALES the history tile holds the codes alone and
    its keys' scales go to (k_dot_scales, v_dot_scales), ones for a self tile. Without KEYS only V (the caller
    stages the keys: gluon_fp8_qk._fill_key_codes)."""
    if tile < num_hist:
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            if KEYS:
                _decode_rows(k_dst.slice(c * FILL_ROWS, FILL_ROWS), k_codes.slice(c * FILL_ROWS, FILL_ROWS),
                             k_scales.slice(c * FILL_ROWS, FILL_ROWS), FILL_ROWS, FP8, ASYNC_SCALES, DOT_SCALES,
                             DECODE_BITS, layout)
            _decode_rows(v_dst.slice(c * FILL_ROWS, FILL_ROWS), v_codes.slice(c * FILL_ROWS, FILL_ROWS),
                         v_scales.slice(c * FILL_ROWS, FILL_ROWS), FILL_ROWS, FP8, ASYNC_SCALES, DOT_SCALES,
                         DECODE_BITS, layout)
        if DOT_SCALES:
            k_dot_scales.store(_row_scales(k_scales, BLOCK_N, ASYNC_SCALES, layout))
            v_dot_scales.store(_row_scales(v_scales, BLOCK_N, ASYNC_SCALES, layout))
    else:
        for c in gl.static_range(BLOCK_N // FILL_ROWS):
            token, head_cols, row_ok = _self_rows(q_start, q_len, head, row0, tile - num_hist, c, D, BLOCK_N,
                                                  FILL_ROWS, layout)
            if KEYS:
                k_dst.slice(c * FILL_ROWS, FILL_ROWS).store(gl.load(k_ptr + token * k_stride + head_cols,
                                                                    mask=row_ok, other=0.0))
            v_dst.slice(c * FILL_ROWS, FILL_ROWS).store(gl.load(v_ptr + token * v_stride + head_cols, mask=row_ok,
                                                                other=0.0))
        if DOT_SCALES:
            ones = gl.full([BLOCK_N], 1.0, gl.float32, gl.SliceLayout(1, layout))
            k_dot_scales.store(ones)
            v_dot_scales.store(ones)


@gluon.jit
def _store_scales(k_scales, v_scales, k_bytes, v_bytes):
    """A tile's scale bytes (loaded a step earlier) into its scale slot as fp32 scales."""
    k_scales.store(_scale_of(k_bytes))
    v_scales.store(_scale_of(v_bytes))


@gluon.jit
def _start_codes(k_codes, v_codes, k_scales, v_scales, num_hist, lo, hi, page_row, cache_h, scales_h,
                 H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 CODE_STAGES: gl.constexpr, ASYNC_SCALES: gl.constexpr, layout: gl.constexpr):
    """The code pipeline's prologue: copies of tiles 0 .. CODE_STAGES - 2 issued; without ASYNC_SCALES their scales
    stored but the last one's. Returns (page ids of tile CODE_STAGES - 1, the last tile's scale bytes still in
    flight; 127 placeholders with ASYNC_SCALES, where the scale words travel with the codes)."""
    for t in gl.static_range(CODE_STAGES - 1):
        _issue_codes(k_codes.index(t), v_codes.index(t), k_scales.index(t), v_scales.index(t), t,
                     _tile_pages(page_row, t, lo, hi, PAGE, BLOCK_N, layout), num_hist, lo, hi, cache_h, scales_h, H,
                     D, PAGE, ROWS, BLOCK_N, ASYNC_SCALES, layout)
    last: gl.constexpr = CODE_STAGES - 2
    if ASYNC_SCALES:
        k_bytes = gl.full([BLOCK_N], 127, gl.int32, gl.SliceLayout(1, layout))
        v_bytes = k_bytes
    else:
        for t in gl.static_range(CODE_STAGES - 2):
            k_bytes, v_bytes = _load_scale_bytes(scales_h, t, _tile_pages(page_row, t, lo, hi, PAGE, BLOCK_N,
                                                                          layout), lo, hi, H, D, PAGE, ROWS, BLOCK_N,
                                                 layout)
            _store_scales(k_scales.index(t), v_scales.index(t), k_bytes, v_bytes)
        k_bytes, v_bytes = _load_scale_bytes(scales_h, last, _tile_pages(page_row, last, lo, hi, PAGE, BLOCK_N,
                                                                         layout), lo, hi, H, D, PAGE, ROWS, BLOCK_N,
                                             layout)
    return _tile_pages(page_row, CODE_STAGES - 1, lo, hi, PAGE, BLOCK_N, layout), k_bytes, v_bytes


@gluon.jit
def _advance_codes(tile, pages, k_bytes, v_bytes, k_codes, v_codes, k_scales, v_scales, num_hist, lo, hi, page_row,
                   cache_h, scales_h, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, CODE_STAGES: gl.constexpr, ASYNC_SCALES: gl.constexpr,
                   layout: gl.constexpr):
    """One step of the code pipeline at tile `tile`: issue the copies of tile + CODE_STAGES - 1 (pages `pages`);
    without ASYNC_SCALES load its scale bytes and store the previous tile's (`k_bytes`, `v_bytes`, loaded a step
    ago); load the next page ids, then wait until tile `tile`'s copies have landed for every thread of the
    partition. Returns the carried (pages, k_bytes, v_bytes). A code or scale slot is refilled only after the tile
    it held was decoded."""
    ahead = tile + CODE_STAGES - 1
    slot = ahead % CODE_STAGES
    _issue_codes(k_codes.index(slot), v_codes.index(slot), k_scales.index(slot), v_scales.index(slot), ahead, pages,
                 num_hist, lo, hi, cache_h, scales_h, H, D, PAGE, ROWS, BLOCK_N, ASYNC_SCALES, layout)
    if not ASYNC_SCALES:
        next_k, next_v = _load_scale_bytes(scales_h, ahead, pages, lo, hi, H, D, PAGE, ROWS, BLOCK_N, layout)
        _store_scales(k_scales.index((ahead - 1) % CODE_STAGES), v_scales.index((ahead - 1) % CODE_STAGES), k_bytes,
                      v_bytes)
        k_bytes, v_bytes = next_k, next_v
    pages = _tile_pages(page_row, ahead + 1, lo, hi, PAGE, BLOCK_N, layout)
    async_copy.wait_group(CODE_STAGES - 1)
    gl.thread_barrier()
    return pages, k_bytes, v_bytes


@gluon.jit
def _tile_dots(raw, v_tile, k_dot_scales, v_dot_scales, acc, alpha, tile, whole, num_hist, lo, r, self_end, hist_end,
               key_cols, BLOCK_N: gl.constexpr, K_DOT_SCALES: gl.constexpr, V_DOT_SCALES: gl.constexpr,
               TANH: gl.constexpr, WHOLE: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
    """acc + SiLU(alpha raw) V over one filled tile (raw: its Q K^T), masked to the keys each row sees, with WHOLE
    unless the tile is one of the first `whole` (gluon_tiles._tile_silu: the same values without the mask); with
    K_DOT_SCALES each key's scale multiplies its column of raw (folded into its alpha), with V_DOT_SCALES each
    value's its column of the weights (exact: powers of two)."""
    if K_DOT_SCALES:
        col_alpha = (alpha * k_dot_scales.load(gl.SliceLayout(0, s_layout)))[None, :]
    else:
        col_alpha = alpha
    if WHOLE:
        p = _tile_silu(raw, col_alpha, tile, whole, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
    else:
        p = _masked_silu(raw * col_alpha, tile, num_hist, lo, r, self_end, hist_end, key_cols, BLOCK_N, TANH)
    if V_DOT_SCALES:
        p = p * v_dot_scales.load(gl.SliceLayout(0, s_layout))[None, :]
    return warpgroup_mma(gl.convert_layout(p.to(v_tile.dtype), p_layout), v_tile, acc)
