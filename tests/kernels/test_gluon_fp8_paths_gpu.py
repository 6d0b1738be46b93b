"""The fp8 Gluon kernel's paths on an H200: the bit-move decode against the native conversion for every code at
every scale (bit for bit) and in the attention (bit for bit), and the "rows" split table with the self tiles on the
last split against the torch fp8 reference and the `tl` kernel's fp8 path."""

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from layerflow.kernels import PagedAttention, kv_append
from layerflow.kernels.gluon_fp8_tiling import DECODE_ENV, Fp8Tiling
from layerflow.kernels.gluon_fp8_tiles import _code_layout, _code_smem_layout, _decode_rows
from tests.kernels.test_gluon_fp8_gpu import E4M3, E5M2, H, MAX_SEQ_LEN, PAGE, SMALL, check, fp8_batch, run
from tests.kernels.paged_batch import make_paged_batch, quantised_batch

pytestmark = pytest.mark.gpu

ROWS, D = 32, 256
NON_FINITE = {1: [0x7F, 0xFF], 2: list(range(0x7C, 0x80)) + list(range(0xFC, 0x100))}


@gluon.jit
def _decode_both(codes_ptr, scales_ptr, cvt_ptr, bits_ptr, FP8: gl.constexpr, ROWS_N: gl.constexpr,
                 D_: gl.constexpr, num_warps: gl.constexpr):
    """Rows program_id * ROWS_N .. of a [rows, D_] code matrix and their fp32 scales decoded by both paths."""
    layout: gl.constexpr = _code_layout(D_, num_warps)
    rows = gl.program_id(0) * ROWS_N + gl.arange(0, ROWS_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D_, layout=gl.SliceLayout(0, layout))
    at = rows[:, None] * D_ + cols[None, :]
    codes = gl.allocate_shared_memory(gl.uint8, [ROWS_N, D_], _code_smem_layout(D_), gl.load(codes_ptr + at))
    scales = gl.allocate_shared_memory(gl.float32, [ROWS_N], gl.SwizzledSharedLayout(1, 1, 1, [0]),
                                       gl.load(scales_ptr + rows))
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    cvt = gl.allocate_shared_memory(gl.bfloat16, [ROWS_N, D_], tile)
    bits = gl.allocate_shared_memory(gl.bfloat16, [ROWS_N, D_], tile)
    _decode_rows(cvt, codes, scales, ROWS_N, FP8, False, False, False, layout)
    _decode_rows(bits, codes, scales, ROWS_N, FP8, False, False, True, layout)
    gl.thread_barrier()
    gl.store(cvt_ptr + at, cvt.load(layout))
    gl.store(bits_ptr + at, bits.load(layout))


@pytest.mark.parametrize("fp8", [1, 2], ids=["e4m3", "e5m2"])
def test_the_bit_move_decode_is_the_conversion_for_every_finite_code_at_every_scale(fp8):
    """Every code (columns) times every scale a page can hold, 2^-126 .. 2^126 and the zero of a zeroed scale word
    (rows): the same bf16 bits, subnormal and overflowing products included."""
    scale_bytes = torch.cat([torch.arange(0, 254), torch.tensor([127, 127])]).to(torch.int32)
    scales = (scale_bytes << 23).view(torch.float32).cuda()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1).cuda()
    cvt, bits = (torch.empty(256, 256, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _decode_both[(256 // ROWS,)](codes, scales, cvt, bits, FP8=fp8, ROWS_N=ROWS, D_=D, num_warps=4)
    finite = torch.ones(256, dtype=torch.bool)
    finite[NON_FINITE[fp8]] = False
    assert torch.isinf(cvt[:, finite].float()).any()       # the overflowing products are among those compared
    differ = (bits.view(torch.int16) != cvt.view(torch.int16)) & finite.cuda()[None, :]
    where = [(int(scale_bytes[r]), hex(c)) for r, c in differ.nonzero().tolist()[:8]]
    assert not differ.any(), f"{int(differ.sum())} (scale byte, code) pairs differ, e.g. {where}"


@pytest.mark.parametrize("candidates", [256, 0])
def test_the_bit_move_decode_gives_the_conversions_attention_bit_for_bit(candidates):
    """e4m3 at the D=256 defaults: one code slot beside 128-row query blocks, two (tanh) beside 64-row ones (0
    candidates); e5m2's decode is checked code by code above."""
    batch = fp8_batch([16384 + 64, 700], [64, 64], [candidates, 3 if candidates else 0], 256, E4M3)
    slots = dict(code_stages=1) if candidates else dict(code_stages=2, silu="tanh")
    expected = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=64, **slots))
    total = batch.total_tokens
    assert torch.equal(run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=64, decode="bits", **slots))[:total],
                       expected[:total])


def test_the_bit_move_decode_matches_reference_and_tl_on_small_ragged_batches():
    check(fp8_batch(*SMALL, 256, E5M2), 256, E5M2, Fp8Tiling(block_n=64, code_stages=1, decode="bits"))


@pytest.mark.parametrize("decode", ["cvt", "bits"])
@pytest.mark.parametrize("candidates", [0, 256])
def test_the_rows_split_table_and_self_tiles_last_match_reference_and_tl(monkeypatch, decode, candidates):
    """A 512-token capacity (16 splits of its 4 query blocks) over one user's 64 + `candidates` rows: the launch
    takes the table's count (11 for 3 blocks: one wave of 132 programs), the last split the self tiles."""
    monkeypatch.setenv(DECODE_ENV, decode)
    exact = make_paged_batch([16384 + 64], [64], [candidates], num_heads=H, head_dim=256, page_size=PAGE,
                             dtype=torch.bfloat16, device="cuda", max_tokens=512)
    batch = quantised_batch(exact, E4M3, PAGE)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=E4M3)
    attn = PagedAttention(1, 512, batch.page_table.shape[1], H, 256, PAGE, torch.bfloat16, "cuda", 256 ** -0.5,
                          MAX_SEQ_LEN, kv_dtype=E4M3, kernel="gluon")
    assert attn.split_rule == "rows" and attn.gluon.tiling.decode == decode
    attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    real_blocks = -(-(64 + candidates) // attn.block_m)
    assert attn.active_splits.tolist() == [int(attn.split_table[real_blocks])]
    if candidates:
        assert int(attn.split_table[real_blocks]) < attn.num_splits
    check(batch, 256, E4M3)
