"""The fp8 KV cache's kernels on the CPU: the quantisation rule's bounds, the Triton append bit for bit against the
torch reference (interpreter), and the attention over fp8 pages against its reference and against the exact cache.
"""

import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import AttentionTiling, PagedAttention, kv_append, kv_append_reference  # noqa: E402
from layerflow.kernels import paged_attention_reference  # noqa: E402
from layerflow.kernels.fp8 import FORMATS, MMA_ENV, decode, dequantise, fp16_queries, fp16_scores  # noqa: E402
from layerflow.kernels.fp8 import value_unit  # noqa: E402
from layerflow.kernels.fp8 import page_views, quantise, scale_exponents  # noqa: E402
from layerflow.model.mask import MaskRule  # noqa: E402
from layerflow.tier.layout import FP8_DTYPES, fp8_page_size, fp8_scale_rows  # noqa: E402
from tests.kernels.paged_batch import make_paged_batch, quantised_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA, MAX_SEQ_LEN = 0.125, 300
RAGGED = dict(history_lens=[0, 37, 1, 20, 0], appended_lens=[0, 3, 1, 20, 0], candidate_lens=[3, 2, 0, 0, 0])
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, sorted."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype).float()
    return values[torch.isfinite(values)].unique()


def rounding_cases(kv_dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rows whose first element is the format's largest value (so the scale is 1): every finite value, every
    midpoint between neighbours (ties) and the fp32 values just above and below each midpoint."""
    values = fp8_values(kv_dtype)
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    cases = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    cases = torch.cat([cases, torch.zeros(-cases.numel() % (width - 1))]).view(-1, width - 1)
    return torch.cat([torch.full((cases.shape[0], 1), FORMATS[kv_dtype].max_value), cases], dim=1)


def test_the_formats_are_the_layouts():
    assert set(FORMATS) == set(FP8_DTYPES)
    for kv_dtype, fmt in FORMATS.items():
        assert fmt.max_value == torch.finfo(kv_dtype).max


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_round_trip_is_within_half_an_fp8_step(kv_dtype):
    fmt = FORMATS[kv_dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 64, generator=gen) * torch.logspace(-20, 20, 400)[:, None]
    x[0] = 0.0
    codes, scales = quantise(x, kv_dtype)
    back = dequantise(codes, scales, kv_dtype, torch.float32)
    scale = 2.0 ** (scales.double() - 127)
    absmax = x.abs().amax(dim=1).double()
    # The scale is the smallest power of two that brings the row's maximum within the format's range.
    assert (absmax[1:] / scale[1:] <= fmt.max_value).all() and (absmax[1:] / scale[1:] > fmt.max_value / 2).all()
    # Each element within half a step: relative 2^-(m+1) in the normal range, half a subnormal step below it.
    bound = torch.maximum(x.abs().double() * 2.0 ** -(fmt.mantissa_bits + 1),
                          scale[:, None] * 2.0 ** (-fmt.bias - fmt.mantissa_bits))
    assert ((back.double() - x.double()).abs() <= bound).all()
    assert (back[0] == 0).all() and torch.equal(back.sign(), torch.where(back == 0, 0.0, x.sign()))


def test_scale_exponents_clamp_and_read_the_mantissa():
    fmt = FORMATS[E4M3]
    rows = torch.tensor([[448.0], [449.0], [256.0], [255.9], [0.0], [1e-40], [3e38]])
    assert scale_exponents(rows, fmt).tolist() == [0, 1, 0, 0, -126, -126, 120]


def test_fp8_page_rows_invert():
    for page_size in (16, 32, 64, 128):
        for head_dim in (16, 32, 64, 128, 256):
            rows = page_size + fp8_scale_rows(page_size, head_dim)
            assert fp8_page_size(rows, head_dim) == page_size
    assert fp8_scale_rows(32, 256) == 1 and fp8_scale_rows(128, 64) == 2


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, FP8: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, decode(tl.load(codes_ptr + i), FP8, out_ptr.dtype.element_ty))


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_gives_every_finite_code_exactly_in_the_model_dtype(kv_dtype, dtype):
    """The attention's native conversion of codes straight into bf16/fp16/fp32 against torch's, bit for bit."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    _decode_kernel[(1,)](codes, out, FP8=FORMATS[kv_dtype].kernel_code)
    expected = codes.view(kv_dtype).to(dtype)
    finite = torch.isfinite(codes.view(kv_dtype).float())
    assert finite.sum() >= 240
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out[finite].view(bits), expected[finite].view(bits))


@triton.jit
def _fp16_queries_kernel(q_ptr, out_ptr, alpha_ptr, alpha):
    i = tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]
    q, scaled_alpha = fp16_queries(tl.load(q_ptr + i), alpha)
    tl.store(out_ptr + i, q)
    tl.store(alpha_ptr, scaled_alpha)


@pytest.mark.parametrize("largest", [3.0e38, 7.0e4, 1.5, 2.0 ** -20, 0.0])
def test_fp16_queries_hold_bf16_queries_exactly_in_range_and_move_the_power_of_two_into_alpha(largest):
    """bf16 queries beyond fp16's range (and far below it) become fp16 times 2^e with alpha times 2^-e: the
    scaled queries are the originals exactly, the largest in [2^14, 2^15)."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(16, 64, generator=gen) * largest / 4).clamp(-largest, largest)
    q[3, 7] = largest
    q = q.to(torch.bfloat16).to(DEVICE)
    out = torch.empty(16, 64, dtype=torch.float16, device=DEVICE)
    alpha = torch.empty(1, dtype=torch.float32, device=DEVICE)
    _fp16_queries_kernel[(1,)](q, out, alpha, ALPHA)
    assert torch.isfinite(out.float()).all()
    factor = alpha.item() / ALPHA                       # 2^e
    assert factor == 2.0 ** round(torch.tensor(factor).log2().item())
    if largest > 0:
        assert 2.0 ** 14 <= out.float().abs().max().item() < 2.0 ** 15
        relevant = q.float().abs() >= largest * 2.0 ** -31
        assert torch.equal(out.double()[relevant] * factor, q.double()[relevant])
    else:
        assert (out == 0).all()


def test_fp16_mmas_are_chosen_by_argument_or_variable_for_16_bit_models_over_fp8_only(monkeypatch):
    monkeypatch.delenv(MMA_ENV, raising=False)
    assert not fp16_scores(None, torch.bfloat16, E4M3) and value_unit(None, torch.bfloat16, E4M3) == 1.0
    assert value_unit("fp16", torch.bfloat16, E4M3) == 1.0 and fp16_scores("fp16v", torch.bfloat16, E4M3)
    assert value_unit("fp16v", torch.bfloat16, E4M3) == 256.0 and value_unit("fp16v", torch.float16, E5M2) == 32768.0
    assert value_unit("fp16v", torch.float32, E4M3) == 1.0 and value_unit("fp16v", torch.bfloat16, None) == 1.0
    assert fp16_scores("fp16", torch.bfloat16, E4M3) and fp16_scores("fp16", torch.bfloat16, E5M2)
    assert fp16_scores("fp16", torch.float16, E4M3) and not fp16_scores("fp16", torch.float32, E4M3)
    assert not fp16_scores("fp16", torch.bfloat16, None)
    monkeypatch.setenv(MMA_ENV, "fp16")
    assert fp16_scores(None, torch.bfloat16, E4M3) and not fp16_scores("model", torch.bfloat16, E4M3)
    monkeypatch.setenv(MMA_ENV, "fp32")
    with pytest.raises(ValueError, match="fp8_mma='fp32'"):
        fp16_scores(None, torch.bfloat16, E4M3)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_fp16_mmas_over_fp8_pages_match_the_reference(kv_dtype):
    """q.k on fp16 MMAs with the queries rescaled by a power of two (K decoded into q's dtype), the V dot in the
    model's dtype or (fp16v) on fp16 with its weights in units of 2^max_exponent, against the model-dtype path and
    the reference over the same pages. An fp16 model: the interpreter mis-computes bf16 attention, so the bf16 case
    is the GPU tests'."""
    exact = make_paged_batch(**RAGGED, num_heads=2, head_dim=64, page_size=16, dtype=torch.float16, device=DEVICE,
                             max_batch=6, max_tokens=40)
    batch = quantised_batch(exact, kv_dtype, 16)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    q, alpha = batch.q * 2.0 ** 10, ALPHA * 2.0 ** -10      # |q| up to ~4e3: e > 0
    total = batch.total_tokens
    expected = paged_attention_reference(q.float(), batch.k.float(), batch.v.float(), batch.kv_cache,
                                         *batch.lengths, torch.zeros(q.shape), alpha=alpha, max_seq_len=MAX_SEQ_LEN,
                                         kv_dtype=kv_dtype)[:total]
    for mma in ("model", "fp16", "fp16v"):
        attn = PagedAttention(6, 40, batch.page_table.shape[1], 2, 64, 16, torch.float16, DEVICE, alpha,
                              MAX_SEQ_LEN, tiling=AttentionTiling(16, 16, 4, 1, num_splits=2), kv_dtype=kv_dtype,
                              fp8_mma=mma)
        assert attn.fp16_scores == (mma != "model") and (attn.value_unit > 1) == (mma == "fp16v")
        out = attn.run(q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(q))[:total].float()
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_triton_append_rounds_bit_for_bit_like_torch(kv_dtype):
    """Every rounding case (ties, carries into the exponent, subnormals) through the Triton kernel."""
    heads, dim, page = 2, 64, 16
    cases = rounding_cases(kv_dtype, dim)
    tokens = cases.shape[0] // heads * heads
    k = cases[:tokens].reshape(-1, heads, dim).to(DEVICE)
    v = (-k).contiguous()
    n = k.shape[0]
    pages = -(-n // page)
    rows = page + fp8_scale_rows(page, dim)
    caches = [torch.zeros(pages, 2, rows, heads, dim, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    lengths = (torch.arange(pages, dtype=torch.int32, device=DEVICE).view(1, pages),
               torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
               torch.tensor([n], dtype=torch.int32, device=DEVICE), torch.tensor([n], dtype=torch.int32, device=DEVICE))
    kv_append(k, v, caches[0], *lengths, kv_dtype=kv_dtype)
    kv_append_reference(k, v, caches[1], *lengths, kv_dtype=kv_dtype)
    assert torch.equal(caches[0], caches[1])
    codes, scales = page_views(caches[0], page)
    stored = codes[:, 0].reshape(-1, heads, dim)[:n]
    assert torch.equal(stored, k.to(kv_dtype).view(torch.uint8))     # scale 1: torch's own conversion
    assert (scales[:, 0].transpose(1, 2).reshape(-1, heads)[:n] == 127).all()


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_triton_append_matches_the_reference_on_a_ragged_batch(kv_dtype):
    batch = quantised_batch(make_paged_batch(**RAGGED, num_heads=2, head_dim=64, page_size=16, dtype=torch.float32,
                                             device=DEVICE, max_batch=6, max_tokens=40), kv_dtype, 16)
    expected = batch.kv_cache.clone()
    before = batch.kv_cache.clone()
    kv_append_reference(batch.k, batch.v, expected, *batch.lengths, kv_dtype=kv_dtype)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    assert torch.equal(batch.kv_cache, expected)
    codes, scales = page_views(batch.kv_cache, 16)
    old_codes, old_scales = page_views(before, 16)
    changed = (codes != old_codes).any(dim=(1, 3, 4)).sum().item()
    assert changed == 3 + 1 + 20                  # slots (page, position) of appended tokens, no candidates
    scale_changed = (scales != old_scales).any(dim=(1, 2)).sum().item()
    assert scale_changed == 3 + 1 + 20


def test_a_page_filled_over_several_visits_keeps_its_earlier_tokens():
    """Three visits append into one page: the bytes of the tokens already there never change."""
    heads, dim, page = 2, 64, 16
    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros(2, 2, page + 1, heads, dim, dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
    held = 0
    snapshots = []
    for visit, count in enumerate((5, 4, 7)):
        k, v = (torch.randn(count, heads, dim, generator=gen).to(DEVICE) * 10 ** visit for _ in range(2))
        held += count
        ints = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, count], [held], [count])]
        kv_append(k, v, cache, table, *ints, kv_dtype=E4M3)
        snapshots.append((held, cache.clone()))
    codes, scales = page_views(cache, page)
    for tokens, snapshot in snapshots:
        old_codes, old_scales = page_views(snapshot, page)
        assert torch.equal(codes[1, :, :tokens], old_codes[1, :, :tokens])
        assert torch.equal(scales[1, :, :, :tokens], old_scales[1, :, :, :tokens])


def fp8_attention(lengths: dict, kv_dtype: torch.dtype, *, head_dim: int = 64, page_size: int = 16,
                  tiling: AttentionTiling, mask: MaskRule = MaskRule(), max_batch: int | None = None,
                  max_tokens: int | None = None):
    """(Triton over fp8 pages, the reference over the same pages, the reference over the exact pages, tokens)."""
    exact = make_paged_batch(**lengths, num_heads=2, head_dim=head_dim, page_size=page_size, dtype=torch.float32,
                             device=DEVICE, max_batch=max_batch, max_tokens=max_tokens)
    batch = quantised_batch(exact, kv_dtype, page_size)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=kv_dtype)
    kv_append(exact.k, exact.v, exact.kv_cache, *exact.lengths)
    attn = PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], 2, head_dim,
                          page_size, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, tiling=tiling, mask=mask,
                          kv_dtype=kv_dtype)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.full_like(batch.q, 7.0))
    common = dict(alpha=ALPHA, mask=mask, max_seq_len=MAX_SEQ_LEN)
    expected = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                         torch.full_like(batch.q, 7.0), kv_dtype=kv_dtype, **common)
    unquantised = paged_attention_reference(exact.q, exact.k, exact.v, exact.kv_cache, *exact.lengths,
                                            torch.full_like(exact.q, 7.0), **common)
    return out, expected, unquantised, batch.total_tokens


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("num_splits,preload", [(1, False), (3, True)])
def test_attention_over_fp8_pages_matches_its_reference(kv_dtype, num_splits, preload):
    tiling = AttentionTiling(16, 16, 4, 1, preload_pages=preload, num_splits=num_splits)
    out, expected, unquantised, total = fp8_attention(RAGGED, kv_dtype, tiling=tiling, max_batch=6, max_tokens=40)
    assert torch.isfinite(out[:total]).all()       # no poisoned slot was read
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert (out[total:] == 7.0).all()
    error = (out[:total] - unquantised[:total]).norm() / unquantised[:total].norm()
    assert 0 < error < (0.05 if kv_dtype == E4M3 else 0.1)


@pytest.mark.parametrize("page_size,head_dim", [(32, 64), (128, 64), (64, 256)])
def test_attention_over_fp8_pages_with_several_scale_rows_and_a_window(page_size, head_dim):
    lengths = dict(history_lens=[2 * page_size + 5, 3], appended_lens=[4, 3], candidate_lens=[2, 1])
    mask = MaskRule(contextual_len=2, max_attn_len=page_size)
    out, expected, _, _ = fp8_attention(lengths, E4M3, head_dim=head_dim, page_size=page_size, mask=mask,
                                        tiling=AttentionTiling(16, 16, 4, 1, num_splits=2))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_fp8_kernels_refuse_a_cache_of_another_kind():
    batch = make_paged_batch([4], [4], [0], num_heads=1, head_dim=64, page_size=16, dtype=torch.float32,
                             device=DEVICE)
    with pytest.raises(ValueError, match="a uint8 kv_cache"):
        kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=E4M3)
    attn = PagedAttention(1, 8, 2, 1, 64, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, kv_dtype=E4M3)
    with pytest.raises(ValueError, match="kv_cache shape"):
        attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, batch.q.clone())
    with pytest.raises(ValueError, match="kv_dtype"):
        PagedAttention(1, 8, 2, 1, 64, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, kv_dtype=torch.bfloat16)
