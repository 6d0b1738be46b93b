"""The fp8 Q K^T emulation of benchmarks/fp8_q_quality.py (the evidence against an fp8 Q K^T in the fp8 Gluon
kernel): e4m3 queries keep each row's largest element exact, the emulation with queries left alone is the paged
reference, and with e4m3 queries it moves only the rows that see cached history."""

import torch

from benchmarks.fp8_q_quality import e4m3_rows, fp8_qk_attention
from layerflow.kernels import kv_append_reference, paged_attention_reference
from tests.kernels.paged_batch import make_paged_batch, quantised_batch

E4M3 = torch.float8_e4m3fn
PAGE = 16
LENGTHS = dict(history_lens=[0, 37, 20], appended_lens=[0, 3, 20], candidate_lens=[5, 2, 0])


def test_e4m3_rows_keep_each_rows_amax_and_round_the_rest_to_3_mantissa_bits():
    q = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(0))
    out = e4m3_rows(q)
    amax = q.abs().amax(-1)
    assert torch.allclose(out.abs().amax(-1), amax, rtol=1e-6)
    scale = amax.unsqueeze(-1) / 448                      # half a step: 2^-4 relative, 2^-10 scales if subnormal
    assert ((out - q).abs() <= torch.maximum(q.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-6)).all()
    assert not torch.equal(out, q)


def test_the_emulation_is_the_reference_without_fp8_and_moves_only_rows_that_see_cached_keys():
    exact = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    batch = quantised_batch(exact, E4M3, PAGE)
    kv_append_reference(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=E4M3)
    kv_append_reference(exact.k, exact.v, exact.kv_cache, *exact.lengths)
    args = (batch.q, batch.k, batch.v)
    kwargs = dict(alpha=64 ** -0.5, max_seq_len=128)

    def attend(fn, cache, kv_dtype):
        out = fn(*args, cache, *batch.lengths, torch.zeros_like(batch.q), kv_dtype=kv_dtype, **kwargs)
        return out[:batch.total_tokens]

    plain = attend(fp8_qk_attention, exact.kv_cache, None)
    assert torch.allclose(plain, attend(paged_attention_reference, exact.kv_cache, None), rtol=1e-5, atol=1e-6)
    reference = attend(paged_attention_reference, batch.kv_cache, E4M3)
    emulated = attend(fp8_qk_attention, batch.kv_cache, E4M3)
    no_history = slice(0, 5)                                   # the first user: candidates alone, nothing cached
    assert torch.allclose(emulated[no_history], reference[no_history], rtol=1e-5, atol=1e-6)
    seen = slice(5, None)
    error = float((emulated[seen] - reference[seen]).norm() / reference[seen].norm())
    assert 0 < error < 0.05, error
