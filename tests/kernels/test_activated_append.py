"""The KV append with the layer's SiLU folded in (`activated_kv_append`): every projection row of the batch activated
in place (the padding rows after it untouched) and the activated K/V in the pages, bit for bit as the SiLU followed by the reference append writes them. On the GPU the
SiLU compared against is torch.nn.functional.silu itself; in the CPU's interpreter (numpy's exp) it is the same
formula on numpy, since torch's CPU exp differs from numpy's in the last fp32 bit; and fp16 stands in for bf16 there,
since the interpreter truncates fp32 to bf16 where the GPU rounds."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import kv_append_reference  # noqa: E402
from layerflow.kernels.kv_append import activated_kv_append  # noqa: E402
from layerflow.tier.layout import FP8_DTYPES  # noqa: E402
from tests.kernels.paged_batch import make_paged_batch, quantised_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RAGGED = dict(history_lens=[0, 37, 1, 20, 0], appended_lens=[0, 3, 1, 20, 0], candidate_lens=[3, 2, 0, 0, 0])
HEADS, DIM, PAGE = 2, 64, 16
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _projection(tokens: int, dtype: torch.dtype, width: int = HEADS * DIM) -> torch.Tensor:
    """A fused projection [T, u | v | q | k] with values across SiLU's range (large negatives included)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return (torch.randn(tokens, 4 * width, generator=gen, device=DEVICE) * 6).to(dtype)


def _silu_(x: torch.Tensor) -> None:
    """The SiLU the kernel must equal, in place."""
    if x.is_cuda:
        F.silu(x, inplace=True)
        return
    f = x.float().numpy()
    x.copy_(torch.from_numpy(f / (np.float32(1.0) + np.exp(-f))))


def _views(uvqk: torch.Tensor, heads: int = HEADS, dim: int = DIM) -> tuple[torch.Tensor, ...]:
    u, v, q, k = torch.split(uvqk, [heads * dim] * 4, dim=-1)
    return u, v.view(-1, heads, dim), q.view(-1, heads, dim), k.view(-1, heads, dim)


def _both(dtype: torch.dtype, kv_dtype: torch.dtype | None, activate_qkv: bool, lengths: dict = RAGGED,
          heads: int = HEADS, dim: int = DIM, max_batch: int = 6, max_tokens: int = 48):
    """(kernel's projection and cache, expected projection and cache) for one ragged batch."""
    batch = make_paged_batch(**lengths, num_heads=heads, head_dim=dim, page_size=PAGE, dtype=dtype, device=DEVICE,
                             max_batch=max_batch, max_tokens=max_tokens)
    if kv_dtype is not None:
        batch = quantised_batch(batch, kv_dtype, PAGE)
    got = _projection(max_tokens, dtype, heads * dim)
    expected = got.clone()
    rows = expected[:batch.total_tokens]
    _silu_(rows if activate_qkv else rows[:, :heads * dim])
    expected_cache, got_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    _, ev, _, ek = _views(expected, heads, dim)
    kv_append_reference(ek, ev, expected_cache, *batch.lengths, kv_dtype)
    activated_kv_append(*_views(got, heads, dim), got_cache, *batch.lengths, kv_dtype, activate_qkv=activate_qkv)
    return (got, got_cache), (expected, expected_cache)


@pytest.mark.parametrize("activate_qkv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rows_and_pages_equal_silu_then_append(dtype, activate_qkv):
    (got, got_cache), (expected, expected_cache) = _both(dtype, None, activate_qkv)
    assert torch.equal(got, expected)
    assert torch.equal(got_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))   # poisoned slots stay NaN


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_fp8_pages_hold_the_activated_tokens_quantised(kv_dtype):
    (got, got_cache), (expected, expected_cache) = _both(HALF, kv_dtype, True)
    assert torch.equal(got, expected) and torch.equal(got_cache, expected_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, *FP8_DTYPES])
def test_hstu_bench_sizes_on_the_gpu(kv_dtype):
    """hstu-bench's heads (4 x 256), two users of 64 appended + 256 candidates in a 1024-row bucket."""
    lengths = dict(history_lens=[2048 + 64, 64], appended_lens=[64, 64], candidate_lens=[256, 256])
    (got, got_cache), (expected, expected_cache) = _both(torch.bfloat16, kv_dtype, True, lengths, heads=4, dim=256,
                                                         max_batch=2, max_tokens=1024)
    assert torch.equal(got, expected)
    assert torch.equal(got_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))


def test_mismatched_u_or_q_is_named():
    batch = make_paged_batch(**RAGGED, num_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float32,
                             device=DEVICE, max_batch=6, max_tokens=48)
    u, v, q, k = _views(_projection(48, torch.float32))
    with pytest.raises(ValueError, match=r"u torch.float32 shape \(48, 64\)"):
        activated_kv_append(u[:, :64], v, q, k, batch.kv_cache, *batch.lengths)
    with pytest.raises(ValueError, match=r"q torch.float32 shape \(47, 2, 64\)"):
        activated_kv_append(u, v, q[:47], k, batch.kv_cache, *batch.lengths)
