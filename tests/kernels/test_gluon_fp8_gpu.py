"""The fp8 Gluon kernel on an H200 against the torch fp8 reference and the `tl` kernel's fp8 path: small ragged
batches with 0-history users for both formats, head dims and scale copies, BS=1 16K at 0 and 256 candidates, the
scales applied in the dots (bit for bit the decode's result), the tanh SiLU, unmasked whole tiles (bit for bit the
masked result), 64-key tiles in one or two code slots (the defaults at D=256: 32-key tiles' result to fp32
rounding), `auto` taking the kernel (with the "async" scale copy and those defaults), and one CUDA graph replayed
across lengths (the bit-move decode: also test_gluon_fp8_paths_gpu)."""

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, kv_append, paged_attention_reference
from layerflow.kernels.gluon_attention import KERNEL_ENV
from layerflow.kernels.gluon_fp8 import GluonFp8Attention
from layerflow.kernels.gluon_fp8_tiling import DECODE_ENV, Fp8Tiling
from tests.kernels.cuda_graph import captured, replay_on
from tests.kernels.paged_batch import PagedBatch, make_paged_batch, quantised_batch

pytestmark = pytest.mark.gpu

H, PAGE, MAX_SEQ_LEN = 4, 32, 16384 + 512
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL = ([0, 300, 2, 1500 + 64, 64], [0, 17, 2, 64, 64], [256, 3, 4, 0, 1])


def fp8_batch(history, appended, candidates, head_dim, kv_dtype, **capacity) -> PagedBatch:
    """A bf16 batch whose cache holds fp8 pages, after the appended tokens' fp8 append."""
    exact = make_paged_batch(history, appended, candidates, num_heads=H, head_dim=head_dim, page_size=PAGE,
                             dtype=torch.bfloat16, device="cuda", **capacity)
    batch = quantised_batch(exact, kv_dtype, PAGE)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    return batch


def attention(batch: PagedBatch, kernel: str, head_dim: int, kv_dtype, tiling: Fp8Tiling | None = None):
    users, tokens = batch.page_table.shape[0], batch.q.shape[0]
    attn = PagedAttention(users, tokens, batch.page_table.shape[1], H, head_dim, PAGE, torch.bfloat16, "cuda",
                          head_dim ** -0.5, MAX_SEQ_LEN,
                          tiling=default_tiling(head_dim, torch.bfloat16, tokens // users), kv_dtype=kv_dtype,
                          kernel=kernel)
    assert isinstance(attn.gluon, GluonFp8Attention) == (kernel == "gluon")
    if tiling is not None:
        attn.gluon = GluonFp8Attention(tiling)
    return attn


def run(batch: PagedBatch, kernel: str, head_dim: int, kv_dtype, tiling: Fp8Tiling | None = None) -> torch.Tensor:
    return attention(batch, kernel, head_dim, kv_dtype, tiling).run(batch.q, batch.k, batch.v, batch.kv_cache,
                                                                     *batch.lengths, torch.zeros_like(batch.q))


def relative_error(out: torch.Tensor, expected: torch.Tensor, total: int) -> float:
    out, expected = out[:total].float(), expected[:total].float()
    assert torch.isfinite(out).all()
    return float((out - expected).norm() / expected.norm())


def check(batch: PagedBatch, head_dim: int, kv_dtype, tiling: Fp8Tiling | None = None) -> None:
    """Within bf16 rounding of the fp32 reference over the same fp8 pages, and of the `tl` kernel's fp8 path."""
    f32 = [t.float() for t in (batch.q, batch.k, batch.v)]
    expected = paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]),
                                         alpha=head_dim ** -0.5, max_seq_len=MAX_SEQ_LEN, kv_dtype=kv_dtype)
    gluon = run(batch, "gluon", head_dim, kv_dtype, tiling)
    tl = run(batch, "triton", head_dim, kv_dtype)
    total = batch.total_tokens
    assert relative_error(gluon, expected, total) < 1e-2
    assert relative_error(gluon, tl, total) < 1e-2


def tiling_id(tiling: Fp8Tiling) -> str:
    return f"{tiling.block_n}x{tiling.stages}c{tiling.code_stages}:{tiling.scale_copy}"


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("scale_copy", ["load", "async"])
def test_small_ragged_batch_matches_reference_and_tl(kv_dtype, head_dim, scale_copy):
    tiling = Fp8Tiling(block_n=64 if head_dim <= 128 else 32, scale_copy=scale_copy)
    check(fp8_batch(*SMALL, head_dim, kv_dtype), head_dim, kv_dtype, tiling)


@pytest.mark.parametrize("tiling", [Fp8Tiling(32, 3, scale_copy="load"),
                                    Fp8Tiling(32, 2, code_stages=3, scale_copy="load"),
                                    Fp8Tiling(64, 2, scale_copy="load"),
                                    Fp8Tiling(32, 2, code_stages=3, scale_copy="async"),
                                    Fp8Tiling(32, 3, code_stages=5, scale_copy="async")], ids=tiling_id)
def test_other_tilings_compute_the_same(tiling):
    check(fp8_batch([4096 + 64, 700], [64, 64], [0, 256], 128, E4M3), 128, E4M3, tiling)


@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_copy", ["load", "async"])
def test_bs1_16k_matches_reference_and_tl(kv_dtype, candidates, scale_copy):
    check(fp8_batch([16384 + 64], [64], [candidates], 256, kv_dtype), 256, kv_dtype,
          Fp8Tiling(block_n=32, scale_copy=scale_copy))


def test_two_loader_warpgroups_compute_the_same():
    check(fp8_batch([16384 + 64], [64], [0], 256, E4M3), 256, E4M3,
          Fp8Tiling(block_n=32, scale_copy="async", producer_warps=8))


@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("scale_copy", ["load", "async"])
def test_scales_applied_in_the_dots_give_the_decodes_result_bit_for_bit(candidates, scale_copy):
    """Powers of two: scaling a column of Q K^T (and of the weights) equals scaling its key's codes."""
    batch = fp8_batch([16384 + 64, 700], [64, 64], [candidates, 3], 256, E4M3)
    decode = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=32, scale_copy=scale_copy))
    dots = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=32, scale_copy=scale_copy, scale_site="dots"))
    total = batch.total_tokens
    assert torch.equal(dots[:total], decode[:total])


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_the_tanh_silu_with_scales_in_the_dots_matches_reference_and_tl(kv_dtype):
    check(fp8_batch(*SMALL, 256, kv_dtype), 256, kv_dtype,
          Fp8Tiling(block_n=32, scale_copy="async", scale_site="dots", silu="tanh"))


@pytest.mark.parametrize("knobs", [{}, dict(scale_site="dots", silu="tanh")], ids=["decode:exact", "dots:tanh"])
def test_unmasked_whole_tiles_give_the_masked_result_bit_for_bit(knobs):
    """Every row of the block sees every key of a whole tile, so the mask changes none of its scores' SiLU (the
    batch of the scales-in-the-dots test, so the masked decode:exact kernel is the one it compiled)."""
    batch = fp8_batch([16384 + 64, 700], [64, 64], [256, 3], 256, E4M3)
    masked = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=32, unmasked_whole_tiles=False, **knobs))
    whole = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=32, unmasked_whole_tiles=True, **knobs))
    total = batch.total_tokens
    assert torch.equal(whole[:total], masked[:total])


@pytest.mark.parametrize("candidates, code_stages", [(0, 1), (256, 1), (0, 2)])
def test_64_key_tiles_with_one_or_two_code_slots_match_reference_tl_and_32_key_tiles(candidates, code_stages):
    """Only the tile width and where the codes wait change: 32-key tiles' products, summed in another order (two
    code slots of 64 keys fit beside a 64-row query block only: 0 candidates)."""
    batch = fp8_batch([16384 + 64, 700], [64, 64], [candidates, 3], 256, E4M3)
    wide = Fp8Tiling(block_n=64, code_stages=code_stages)
    check(batch, 256, E4M3, wide)
    total = batch.total_tokens
    narrow = run(batch, "gluon", 256, E4M3, Fp8Tiling(block_n=32))
    assert relative_error(run(batch, "gluon", 256, E4M3, wide), narrow, total) < 1e-3


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_64_key_tiles_in_one_code_slot_with_the_tanh_silu_on_small_ragged_batches_match_reference_and_tl(kv_dtype):
    check(fp8_batch(*SMALL, 256, kv_dtype), 256, kv_dtype, Fp8Tiling(block_n=64, code_stages=1, silu="tanh"))


@pytest.mark.parametrize("candidates", [0, 256])
def test_auto_takes_the_fp8_kernel_with_64_key_tiles_at_d256_and_it_matches_reference_and_tl(monkeypatch, candidates):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    tokens = 64 + candidates
    attn = PagedAttention(1, tokens, 4, H, 256, PAGE, torch.bfloat16, "cuda", 256 ** -0.5, MAX_SEQ_LEN,
                          tiling=default_tiling(256, torch.bfloat16, tokens), kv_dtype=E4M3)
    assert isinstance(attn.gluon, GluonFp8Attention)
    assert (attn.gluon.tiling.scale_copy, attn.gluon.tiling.block_n) == ("async", 64)
    check(fp8_batch([16384 + 64, 700], [64, 64], [candidates, 3], 256, E4M3), 256, E4M3)


@pytest.mark.parametrize("decode", ["bits", "cvt"])
def test_one_graph_replays_any_lengths_like_eager(monkeypatch, decode):
    """Over the "rows" split table read on the device: the bit-move decode (the bf16 default) and the conversion."""
    monkeypatch.setenv(DECODE_ENV, decode)
    max_batch, max_tokens, max_pages, num_pages = 4, 4 * 320, 16384 // PAGE + 4, 2 * (16384 // PAGE) + 64
    cases = [([16384 + 64], [64], [256]), ([2048, 5000, 64, 8192], [64, 64, 64, 1], [256, 0, 100, 256]),
             ([0, 300], [0, 17], [256, 3])]

    def batch_of(case) -> PagedBatch:
        pages = sum(-(-h // PAGE) for h in case[0])
        return fp8_batch(*case, 256, E4M3, max_batch=max_batch, max_tokens=max_tokens, max_pages_per_user=max_pages,
                         spare_pages=num_pages - pages)

    attn = PagedAttention(max_batch, max_tokens, max_pages, H, 256, PAGE, torch.bfloat16, "cuda", 256 ** -0.5,
                          MAX_SEQ_LEN, kv_dtype=E4M3, kernel="gluon")
    assert attn.gluon.tiling.decode == decode
    static = batch_of(cases[0])
    static_out = torch.zeros_like(static.q)
    graph = captured(lambda: attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out))
    for case in cases:
        fresh = batch_of(case)
        replay_on(graph, static, fresh, static_out)
        eager = attn.run(fresh.q, fresh.k, fresh.v, fresh.kv_cache, *fresh.lengths, torch.zeros_like(fresh.q))
        assert torch.equal(static_out[:fresh.total_tokens], eager[:fresh.total_tokens]), f"replay != eager: {case}"
