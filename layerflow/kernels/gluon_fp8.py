"""Paged HSTU attention over an fp8 cache on Hopper in Gluon: the fp8 codes of each K/V tile are copied (cp.async)
into a ring of code slots, decoded and scaled in registers into a bf16/fp16 tile, and both dots run on wgmma over
that tile exactly as in the bf16 Gluon kernel (layerflow.kernels.gluon_attention).

Same grid, split and partial layout as the `tl` kernel (its split reduction sums the partials), default mask only.
Numerics are the `tl` kernel's "model" fp8 path (layerflow.kernels.fp8): every fp8 code is exact in bf16/fp16 and a
scale is a power of two, so code * 2^k in the tile gives the products the `tl` kernel forms by scaling q.k and the
weights instead (bf16(p) * code * 2^kv == bf16(p * 2^kv) * code); only the order of the fp32 sums differs.

A loader warpgroup issues the copies, decodes each landed tile into the next free slot of a bf16 ring and signals
it (mbarriers ready/empty per slot); the block's warps only run the dots, so decoding overlaps them. How a tile's
scale bytes reach the scale ring (Fp8Tiling.scale_copy, else $LAYERFLOW_FP8_SCALE_COPY):
- "load": loaded into registers with the tile's copies and stored into the ring an iteration later;
- "async": the 4-byte words holding them are copied by cp.async in the tile's own copy group, so the loader never
  waits on a register load of bytes from HBM (it did once per tile with "load").
Where the scales are applied (Fp8Tiling.scale_site, else $LAYERFLOW_FP8_SCALE_SITE):
- "decode": the loader writes code * scale into the tile;
- "dots": the loader writes the codes alone (one conversion fewer per code: no fp32 multiply) and the tile's key
  scales beside them; the block's warps multiply each key's column of Q K^T by its K scale (with alpha) and of the
  weights by its V scale, 2 x BLOCK_N products per row instead of 2 x D per key. Powers of two: the same products.
The SiLU (Fp8Tiling.silu, else $LAYERFLOW_FP8_SILU): "exact" (exp2 and a reciprocal) or "tanh" (one tanh.approx
per score, gluon_tiles._tanh_silu_of_seen, the bf16 kernel's default at D=256).
How the loader decodes (Fp8Tiling.decode, else $LAYERFLOW_FP8_DECODE, else "bits" for bf16 models and "cvt" for
fp16 ones): "cvt", the native conversion through fp32 (sm_90 build, per code: one F2FP, i.e. half an e4m3x2 unpack
and half a bf16x2 pack, on the conversion pipe, 16 results per clock per SM in NVIDIA's table; one HADD2 f16 -> f32;
one FMUL), or "bits" (bf16 models): bit moves and two bf16 multiplies (gluon_fp8_tiles._bits_asm; per code half a
PRMT, half a shift, half a LOP3 and one HMUL2: no conversion instruction), the same bits for every code the
quantiser writes.
The split count and the self tiles as in the bf16 kernel: it reads the "rows" rule's table (layerflow.kernels.splits:
the count of the launch's real query blocks, so a bucket larger than the batch still fills whole waves) and the
candidates' self tiles are dealt with the history and run by the last split (gluon_tiles._balanced_range).
How Q K^T runs (Fp8Tiling.qk, else $LAYERFLOW_FP8_QK; "fp8x2" by default over e4m3 pages): "bf16" over the decoded
keys as above, or "fp8x2" on fp8 MMAs over the key codes themselves, the queries as two e4m3 terms
(layerflow.kernels.gluon_fp8_qk); V is decoded either way.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from layerflow.kernels.gluon_fp8_qk import _scores_layout, _store_query_terms
from layerflow.kernels.gluon_fp8_tiles import _code_layout, _code_smem_layout
from layerflow.kernels.gluon_fp8_ws import _fp8_consumer, _fp8_one_slot_producer, _fp8_producer
from layerflow.kernels.gluon_fp8_tiling import QK_TERMS, Fp8Tiling, default_fp8_tiling, fp8_tiling_reason, \
    fp8_unsupported_reason
from layerflow.kernels.gluon_launcher import GluonLauncher, chosen
from layerflow.kernels.gluon_tiles import _program_range, _row_bounds, _row_splits, _user_block

# The H200 showed this kernel correct and faster than the `tl` kernel's fp8 path at every shape measured.
AUTO_TAKES_FP8 = True


@gluon.jit
def _gluon_fp8_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, page_table_ptr, q_offsets_ptr, history_lens_ptr, appended_lens_ptr, inv_n_ptr,
    dst_ptr, q_stride, k_stride, v_stride, page_table_stride, split_stride, max_batch, alpha, split_table_ptr,
    active_splits_ptr,
    H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BATCH_P2: gl.constexpr, NUM_SPLITS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_STAGES: gl.constexpr,
    INV_N_PER_USER: gl.constexpr, ROWS: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr,
    FILL_ROWS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
    DOT_SCALES: gl.constexpr, TANH: gl.constexpr, WHOLE: gl.constexpr, DECODE_BITS: gl.constexpr,
    QK_TERMS: gl.constexpr, num_warps: gl.constexpr,
):
    split = gl.program_id(0)
    head = gl.program_id(2)
    num_splits = NUM_SPLITS
    if split_table_ptr is not None:     # the "rows" rule: this launch's count, programs past it exit
        num_splits = _row_splits(q_offsets_ptr, max_batch, split_table_ptr, active_splits_ptr, BATCH_P2, BLOCK_M,
                                 num_warps)
        if split >= num_splits:
            return
    user, block = _user_block(q_offsets_ptr, gl.program_id(1), max_batch, BATCH_P2, BLOCK_M, num_warps)
    if user >= max_batch:
        return
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    layout: gl.constexpr = _code_layout(D, num_warps)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    code_smem: gl.constexpr = _code_smem_layout(D)
    s_layout: gl.constexpr = _scores_layout(num_warps, BLOCK_N, QK_TERMS)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_start, q_len, row0, hist, appended, lo, hi, num_hist, num_tiles = _program_range(
        q_offsets_ptr, history_lens_ptr, appended_lens_ptr, user, block, split, num_splits, BLOCK_M, BLOCK_N,
        True)

    scale_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if QK_TERMS > 0:   # Q K^T on fp8 MMAs (gluon_fp8_qk): e4m3 query terms, K slots of e4m3 codes
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [QK_TERMS, BLOCK_M, D], code_smem)
        q_scales = gl.allocate_shared_memory(gl.float32, [QK_TERMS, BLOCK_M], scale_smem)
        _store_query_terms(q_smem, q_scales, q_ptr, q_stride, q_start, row0, q_len, head, D, BLOCK_M, QK_TERMS,
                           layout)
    else:
        q_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        q_token = (q_start + row0 + q_rows).to(gl.int64)
        d_cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        q_tile = gl.load(q_ptr + q_token[:, None] * q_stride + head * D + d_cols[None, :],
                         mask=(row0 + q_rows < q_len)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], smem_layout, q_tile)
    k_codes = gl.allocate_shared_memory(gl.uint8, [CODE_STAGES, BLOCK_N, D], code_smem)
    v_codes = gl.allocate_shared_memory(gl.uint8, [CODE_STAGES, BLOCK_N, D], code_smem)
    # "async": each key's slot holds the int32 word its scale byte lies in; "load": the fp32 scale itself.
    scale_dtype: gl.constexpr = gl.int32 if ASYNC_SCALES else gl.float32
    k_scales = gl.allocate_shared_memory(scale_dtype, [CODE_STAGES, BLOCK_N], scale_smem)
    v_scales = gl.allocate_shared_memory(scale_dtype, [CODE_STAGES, BLOCK_N], scale_smem)

    r, self_end, hist_end = _row_bounds(0, BLOCK_M, row0, q_len, appended, hist, hi, s_layout)
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    page_row = page_table_ptr + user * page_table_stride
    cache_h = cache_ptr + head * D
    scales_h = cache_ptr + PAGE * H * D + head * PAGE
    if INV_N_PER_USER:
        inv_n = gl.load(inv_n_ptr + user)
    else:
        inv_n = gl.load(inv_n_ptr)
    if QK_TERMS > 0:
        k_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], code_smem)
    else:
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
    if DOT_SCALES:
        k_dot_scales = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scale_smem)
        v_dot_scales = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scale_smem)
    elif QK_TERMS > 0:  # the keys' scales apply to S, the values' in the decode
        k_dot_scales = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scale_smem)
        v_dot_scales = v_scales
    else:  # unused: the decode applies the scales
        k_dot_scales, v_dot_scales = k_scales, v_scales
    if QK_TERMS == 0:  # unused: the queries are in the model's dtype
        q_scales = k_dot_scales
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(ready.index(t), count=1)
        mbarrier.init(empty.index(t), count=1)
    fence_async_shared()
    gl.thread_barrier()
    if CODE_STAGES == 1:
        gl.warp_specialize([
            (_fp8_consumer, (q_smem, q_scales, k_ring, v_ring, k_dot_scales, v_dot_scales, ready, empty, num_tiles,
                             num_hist, lo, alpha, r, self_end, hist_end, key_cols, inv_n, dst_ptr, split, split_stride,
                             q_start, row0, q_len, head, H, D, BLOCK_M, BLOCK_N, STAGES, DOT_SCALES, TANH, WHOLE,
                             QK_TERMS, s_layout, o_layout, p_layout)),
            (_fp8_one_slot_producer, (k_ring, v_ring, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales,
                                      v_scales, ready, empty, num_tiles, num_hist, lo, hi, page_row, cache_h,
                                      scales_h, k_ptr, v_ptr, k_stride, v_stride, q_start, q_len, head, row0, H, D,
                                      PAGE, ROWS, BLOCK_N, STAGES, FILL_ROWS, FP8, DOT_SCALES, DECODE_BITS,
                                      QK_TERMS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([
            (_fp8_consumer, (q_smem, q_scales, k_ring, v_ring, k_dot_scales, v_dot_scales, ready, empty, num_tiles,
                             num_hist, lo, alpha, r, self_end, hist_end, key_cols, inv_n, dst_ptr, split, split_stride,
                             q_start, row0, q_len, head, H, D, BLOCK_M, BLOCK_N, STAGES, DOT_SCALES, TANH, WHOLE,
                             QK_TERMS, s_layout, o_layout, p_layout)),
            (_fp8_producer, (k_ring, v_ring, k_dot_scales, v_dot_scales, k_codes, v_codes, k_scales, v_scales, ready,
                             empty, num_tiles, num_hist, lo, hi, page_row, cache_h, scales_h, k_ptr, v_ptr, k_stride,
                             v_stride, q_start, q_len, head, row0, H, D, PAGE, ROWS, BLOCK_N, STAGES, CODE_STAGES,
                             FILL_ROWS, FP8, ASYNC_SCALES, DOT_SCALES, DECODE_BITS, QK_TERMS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])


def fill_rows(block_n: int, head_dim: int, warps: int) -> int:
    """Rows decoded per step: at most 32 codes per thread of `warps` warps."""
    return min(block_n, 32 * 32 * warps // head_dim)


class GluonFp8Attention(GluonLauncher):
    """The fp8 Gluon kernel behind the `tl` kernel's launch interface; it ignores the `tl`-only knobs (its tiling, and
    the fp16 MMA choice of layerflow.kernels.fp8: this kernel runs the V dot in the model's dtype and Q K^T as its
    tiling's `qk` says)."""

    tiling_reason = staticmethod(fp8_tiling_reason)
    row_splits = True

    def _launch(self, grid: tuple[int, int, int], *args, H: int, D: int, PAGE: int, BATCH_P2: int, NUM_SPLITS: int,
                BLOCK_M: int, INV_N_PER_USER: bool, ROWS: int, WINDOW: int, CONTEXTUAL: int, FP8: int,
                split_table_ptr: torch.Tensor | None = None, active_splits_ptr: torch.Tensor | None = None,
                **tl_only) -> None:
        if WINDOW or CONTEXTUAL or FP8 not in (1, 2):
            raise ValueError(f"WINDOW={WINDOW}, CONTEXTUAL={CONTEXTUAL}, FP8={FP8}: the fp8 Gluon kernel serves the "
                             "default mask over fp8 pages only")
        t = self.tiling
        if t.scale_copy == "async" and PAGE % 4:
            raise ValueError(f"PAGE={PAGE}: scale_copy='async' copies 4-byte words of scales, so pages must hold a "
                             "multiple of 4 tokens")
        num_warps = BLOCK_M // 16
        _gluon_fp8_kernel[grid](*args, split_table_ptr=split_table_ptr, active_splits_ptr=active_splits_ptr, H=H,
                                D=D, PAGE=PAGE, BATCH_P2=BATCH_P2, NUM_SPLITS=NUM_SPLITS, BLOCK_M=BLOCK_M,
                                BLOCK_N=t.block_n, STAGES=t.stages, CODE_STAGES=t.code_stages,
                                INV_N_PER_USER=INV_N_PER_USER, ROWS=ROWS, FP8=FP8,
                                ASYNC_SCALES=t.scale_copy == "async",
                                FILL_ROWS=fill_rows(t.block_n, D, t.producer_warps),
                                PRODUCER_WARPS=t.producer_warps, PRODUCER_REGISTERS=t.producer_registers,
                                DOT_SCALES=t.scale_site == "dots", TANH=t.silu == "tanh",
                                WHOLE=t.unmasked_whole_tiles, DECODE_BITS=t.decode == "bits",
                                QK_TERMS=QK_TERMS[t.qk], num_warps=num_warps)


def select_fp8_kernel(choice: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                      block_m: int, window: int, contextual: int, tiling: Fp8Tiling | None = None,
                      page_size: int | None = None) -> GluonFp8Attention | None:
    """The fp8 Gluon launcher for an fp8 cache, or None for the `tl` kernel: `choice` "gluon" insists (ValueError
    naming why it cannot run), "auto" takes it where it can run while AUTO_TAKES_FP8 says it wins on the H200
    (page_size None: not checked, assumed a multiple of 4)."""
    if choice not in ("auto", "gluon"):
        raise ValueError(f"kernel={choice!r}: expected 'auto' or 'gluon' (the caller handles 'triton')")
    tiling = tiling or default_fp8_tiling(head_dim, block_m, page_size, dtype, kv_dtype)
    reason = fp8_unsupported_reason(device, dtype, kv_dtype, head_dim, block_m, window, contextual, tiling, page_size)
    return chosen(choice, reason, lambda: GluonFp8Attention(tiling), AUTO_TAKES_FP8)
