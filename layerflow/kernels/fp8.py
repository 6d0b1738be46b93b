"""The fp8 KV cache's quantisation rule, in torch (the references) and as Triton helpers (the kernels).

Each (token, head) row of K or V gets its own power-of-two scale 2^k, k the smallest integer with
max|x| * 2^-k <= the format's largest finite value (448 for e4m3, 57344 for e5m2), and its elements are stored as
fp8(x * 2^-k), rounded to nearest even. Why per token and power-of-two:
- a page filled over several visits needs no rule for later tokens: a token's codes and scale depend on that token
  alone, so an append never touches the tokens already in the page, and a cached token reads back exactly as it was
  written, whichever step wrote it (the fp8 engine's cached step reads what its full recompute would);
- scaling by a power of two is exact, so quantising costs only the fp8 rounding, the scale can be applied after the
  q.k dot (and on the attention weights before the V dot) with the same result as dequantising every element first,
  and every backend computes the same codes;
- the scale is one byte (its exponent + 127, the E8M0 encoding) per head_dim codes, kept in the scale rows of the
  page it belongs to (layerflow.tier.layout).
Both kernels round with integer operations that reproduce torch's round-to-nearest-even conversion bit for bit
(Triton's interpreter mis-rounds fp8 casts whose mantissa carries into the exponent); decoding uses the native
conversion straight into the model's dtype (exact for every finite code, checked in the interpreter).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SCALE_BIAS = 127        # a scale byte is k + 127
MIN_EXPONENT, MAX_EXPONENT = -126, 126   # 2^k and 2^-k are both normal fp32


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 format: mantissa bits, exponent bias, and the exponent of its largest finite value (1.75 * 2^e)."""

    dtype: torch.dtype
    mantissa_bits: int
    bias: int
    max_exponent: int
    kernel_code: int    # the kernels' compile-time switch (0 means no fp8)

    @property
    def max_value(self) -> float:
        return 1.75 * 2.0 ** self.max_exponent


FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, 3, 7, 8, 1),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, 2, 15, 15, 2),
}


def fp8_format(kv_dtype: torch.dtype) -> Fp8Format:
    if kv_dtype not in FORMATS:
        raise ValueError(f"kv_dtype={kv_dtype}: expected one of {list(FORMATS)}")
    return FORMATS[kv_dtype]


def kernel_code(kv_dtype: torch.dtype | None) -> int:
    """The kernels' FP8 switch: 0 for a cache of the model's dtype."""
    return 0 if kv_dtype is None else fp8_format(kv_dtype).kernel_code


MMA_CHOICES = ("model", "fp16", "fp16v")
MMA_ENV = "LAYERFLOW_FP8_MMA"


def _mma_choice(choice: str | None, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> str:
    """`choice` (else the LAYERFLOW_FP8_MMA variable, else "model"), "model" where fp16 MMAs do not apply: pages of
    the model's dtype, or an fp32 model (its queries would lose bits; for an fp16 one only the queries' scaling is
    new, which is how the interpreter, mis-computing bf16 attention, checks the path)."""
    choice = choice or os.environ.get(MMA_ENV) or "model"
    if choice not in MMA_CHOICES:
        raise ValueError(f"fp8_mma={choice!r}: expected one of {MMA_CHOICES} (argument or ${MMA_ENV})")
    return choice if kv_dtype is not None and dtype in (torch.bfloat16, torch.float16) else "model"


def fp16_scores(choice: str | None, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> bool:
    """Whether q.k over fp8 pages runs on fp16 MMAs (`fp16_queries`; "fp16" and "fp16v") instead of the model's
    dtype: e4m3x2 -> f16x2 is one conversion on sm_89+, e4m3 -> bf16 three."""
    return _mma_choice(choice, dtype, kv_dtype) != "model"


def value_unit(choice: str | None, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> float:
    """1.0: the V dot runs in the model's dtype; else ("fp16v") it runs on fp16 MMAs too, with the attention
    weights times the value scales carried in units of this power of two (2^max_exponent of the format: a weight
    times a value scale, ~|p| * max|v| / 2^max_exponent, is then ~|p| * max|v|, in fp16's range unless it exceeds
    65504; the sum is scaled back exactly once)."""
    if _mma_choice(choice, dtype, kv_dtype) != "fp16v":
        return 1.0
    return 2.0 ** fp8_format(kv_dtype).max_exponent


# ---- torch --------------------------------------------------------------------------------------------------------

def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32, exactly (exponent in [-126, 127], int32)."""
    return ((exponent + SCALE_BIAS) << 23).view(torch.float32)


def scale_exponents(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """k per row of `x` [..., D] (int32): the smallest with max|x| * 2^-k <= fmt.max_value, clamped to
    [MIN_EXPONENT, MAX_EXPONENT]; read off the fp32 bits of the row maximum, as the kernel does."""
    bits = x.float().abs().amax(dim=-1).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    over = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)     # mantissa above 1.75: one binade more
    return (exponent - fmt.max_exponent + over).clamp(MIN_EXPONENT, MAX_EXPONENT)


def quantise(x: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., D], scale bytes uint8 [...]) of `x` [..., D] under the module's rule."""
    fmt = fp8_format(kv_dtype)
    k = scale_exponents(x, fmt)
    scaled = x.float() * _power_of_two(-k).unsqueeze(-1)      # exact: |scaled| <= max_value
    return scaled.to(fmt.dtype).view(torch.uint8), (k + SCALE_BIAS).to(torch.uint8)


def dequantise(codes: torch.Tensor, scales: torch.Tensor, kv_dtype: torch.dtype,
               dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] and scale bytes [...] back to values of `dtype` (exact for fp32 and bf16)."""
    values = codes.view(fp8_format(kv_dtype).dtype).float()
    return (values * _power_of_two(scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)).to(dtype)


QUERY_DTYPE = torch.float8_e4m3fn     # the queries' format when q.k runs on fp8 MMAs


def query_terms(q: torch.Tensor, terms: int) -> list[torch.Tensor]:
    """q [..., D] as `terms` e4m3 terms (fp32 values; their sum approximates q) for q.k on fp8 MMAs: the first is q
    quantised by the module's rule (a power-of-two scale per row), each next one what the terms before it missed,
    quantised the same way. One term keeps e4m3's 4 significant bits of q, two about 8 (bf16 has 8). The fp8 Gluon
    kernel forms the same terms (the differences are exact in fp32)."""
    if terms < 1:
        raise ValueError(f"terms={terms}: expected at least 1")
    rest, out = q.float(), []
    for _ in range(terms):
        term = dequantise(*quantise(rest, QUERY_DTYPE), QUERY_DTYPE, torch.float32)
        out.append(term)
        rest = rest - term
    return out


def page_views(kv_cache: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an fp8 cache `[pages, 2, rows, H, D]` (uint8): the codes `[pages, 2, page_size, H, D]` and the scale
    bytes `[pages, 2, H, page_size]` (layerflow.tier.layout). Writes through them land in the cache."""
    pages, _, rows, heads, dim = kv_cache.shape
    codes = kv_cache[:, :, :page_size]
    scales = kv_cache[:, :, page_size:].reshape(pages, 2, (rows - page_size) * heads * dim)[..., :heads * page_size]
    return codes, scales.view(pages, 2, heads, page_size)


# ---- Triton -------------------------------------------------------------------------------------------------------

@triton.jit
def power_of_two(exponent):
    """2^exponent as fp32 (int32 exponent in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def tile_scales(scales_ptr, page_base, n, hi, PAGE: tl.constexpr, V_OFFSET: tl.constexpr):
    """The K and V scales (fp32) of history keys `n` in the pages at `page_base`, from their scale bytes at
    `scales_ptr` and `+ V_OFFSET`; keys at or past `hi` (past the chunk) read 1 without touching memory."""
    ok = n < hi
    ptrs = scales_ptr + page_base + n % PAGE
    k_bytes = tl.load(ptrs, mask=ok, other=127)
    v_bytes = tl.load(ptrs + V_OFFSET, mask=ok, other=127)
    return power_of_two(k_bytes.to(tl.int32) - 127), power_of_two(v_bytes.to(tl.int32) - 127)


@triton.jit
def fp16_queries(q, alpha):
    """(q * 2^-e as fp16, alpha * 2^e) for a block of bf16 queries, so q.k runs on fp16 MMAs against keys decoded
    by the one-instruction e4m3 -> fp16 conversion (into bf16 it takes three). e puts the block's largest |q| in
    [2^14, 2^15): nothing overflows, every element within 2^-31 of the largest converts exactly (fp16's 11 bits
    hold bf16's 8), and the power of two moved into alpha gives the dot's scores unchanged."""
    absmax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
    e = tl.minimum(tl.maximum(((absmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, -100), 113)
    return (q.to(tl.float32) * power_of_two(-e)).to(tl.float16), alpha * power_of_two(e)


@triton.jit
def scale_exponent(absmax, FP8: tl.constexpr):
    """`scale_exponents` of row maxima (fp32, >= 0) in the format `FP8` names (1: e4m3, 2: e5m2)."""
    bits = absmax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    if FP8 == 1:
        k = exponent - 8
    else:
        k = exponent - 15
    return tl.minimum(tl.maximum(k, -126), 126)


@triton.jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr):
    """fp8 bits (int32) of fp32 `y`, |y| <= the format's max, rounded to nearest even.

    Normal results: the fp32 bits rounded at the fp8 mantissa's last bit by an integer add (a carry moves into the
    exponent by itself), then rebiased. Subnormal ones (|y| below the smallest normal) are multiples of one step:
    |y| / step is rounded to an integer by adding 2^23 in fp32 (exact scaling, one hardware rounding).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    rounded = (magnitude + ((1 << (22 - MANTISSA)) - 1) + ((magnitude >> (23 - MANTISSA)) & 1)) >> (23 - MANTISSA)
    normal = rounded - ((127 - BIAS) << MANTISSA)
    steps = magnitude.to(tl.float32, bitcast=True) * SUBNORMAL_STEPS + 8388608.0
    subnormal = steps.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    return code | sign


@triton.jit
def encode(y, FP8: tl.constexpr):
    """fp8 codes (uint8) of the scaled values `y` (fp32) in the format `FP8` names (1: e4m3, 2: e5m2)."""
    if FP8 == 1:
        code = _round_to_fp8(y, 3, 7, 512.0)         # subnormal step 2^-9
    else:
        code = _round_to_fp8(y, 2, 15, 65536.0)      # subnormal step 2^-16
    return code.to(tl.uint8)


@triton.jit
def decode(codes, FP8: tl.constexpr, dtype: tl.constexpr):
    """fp8 codes (uint8) as values of `dtype` by the native conversion (one cvt per pair of codes on the GPU, no
    pass through fp32): exact for every finite code into bf16, fp16 and fp32, which hold every fp8 value. e5m2 into
    fp16 is a shift (its codes are the top byte of fp16's), which the interpreter also gets right on subnormals."""
    if FP8 == 1:
        values = codes.to(tl.float8e4nv, bitcast=True).to(dtype)
    elif dtype == tl.float16:
        values = (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    else:
        values = codes.to(tl.float8e5, bitcast=True).to(dtype)
    return values
