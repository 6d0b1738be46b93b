"""The torch model of the fp8 Gluon kernel's q.k on fp8 MMAs (fp8.query_terms, paged_attention_reference's q_terms;
benchmarks/fp8_q_quality.py runs the quality gate on it): e4m3 query terms by the cache's rule, the reference with
one or two terms against the reference on the model's queries, and the refusal of a cache it does not serve."""

import pytest
import torch

from layerflow.kernels import kv_append_reference, paged_attention_reference
from layerflow.kernels.fp8 import quantise, query_terms
from tests.kernels.paged_batch import make_paged_batch, quantised_batch

E4M3 = torch.float8_e4m3fn
PAGE = 16
LENGTHS = dict(history_lens=[0, 37, 20], appended_lens=[0, 3, 20], candidate_lens=[5, 2, 0])


def test_each_query_term_is_the_rest_quantised_by_the_caches_rule_and_two_keep_about_8_bits():
    q = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(0)) * 3
    first, second = query_terms(q, 2)
    assert torch.equal(first, query_terms(q, 1)[0])
    codes, scales = quantise(q, E4M3)
    assert torch.equal(first, codes.view(E4M3).float() * (scales.int() - 127).float().exp2()[..., None])
    one = (first - q).abs().amax() / q.abs().amax()
    two = (first + second - q).abs().amax() / q.abs().amax()
    assert 2 ** -9 < one <= 2 ** -4 and two <= 2 ** -8, (float(one), float(two))
    with pytest.raises(ValueError, match="terms=0"):
        query_terms(q, 0)


def test_the_reference_with_query_terms_moves_the_rows_by_their_precision():
    exact = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    batch = quantised_batch(exact, E4M3, PAGE)
    kv_append_reference(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=E4M3)

    def attend(terms: int) -> torch.Tensor:
        out = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                        torch.zeros_like(batch.q), alpha=64 ** -0.5, max_seq_len=128,
                                        kv_dtype=E4M3, q_terms=terms)
        return out[:batch.total_tokens]

    plain = attend(0)

    def error(terms: int) -> float:
        return float((attend(terms) - plain).norm() / plain.norm())

    assert 1e-3 < error(1) < 0.05
    assert 0 < error(2) < error(1) / 4


def test_query_terms_need_an_e4m3_cache():
    batch = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="q_terms=1 over kv_dtype=None"):
        paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                  torch.zeros_like(batch.q), alpha=0.125, max_seq_len=128, q_terms=1)
