"""The torch model of the fp8 Gluon kernel's dots on fp8 MMAs (benchmarks/fp8_q_quality.py runs the quality gate on
it): e4m3 query terms (fp8.query_terms, paged_attention_reference's q_terms) and weight terms for the V dot over V
codes (fp8.weight_terms, p_terms) by the cache's rule, the reference with one or two terms against the reference
without, the V codes' transposed page layout, and the refusal of a cache it does not serve."""

import pytest
import torch

from layerflow.kernels import kv_append_reference, paged_attention_reference
from layerflow.kernels.fp8 import page_views, quantise, query_terms, transpose_value_codes, weight_terms
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


@pytest.mark.parametrize("terms_of, base", [("q_terms", {}), ("p_terms", {"q_terms": 2})])
def test_the_reference_with_e4m3_terms_moves_the_rows_by_their_precision(terms_of, base):
    """Query terms against the model's queries; weight terms (the V dot over V codes, fp8x2 queries) against the
    weights in full precision over the same queries."""
    exact = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    batch = quantised_batch(exact, E4M3, PAGE)
    kv_append_reference(batch.k, batch.v, batch.kv_cache, *batch.lengths, kv_dtype=E4M3)

    def attend(**terms) -> torch.Tensor:
        out = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                        torch.zeros_like(batch.q), alpha=64 ** -0.5, max_seq_len=128,
                                        kv_dtype=E4M3, **base, **terms)
        return out[:batch.total_tokens]

    plain = attend()

    def error(terms: int) -> float:
        return float((attend(**{terms_of: terms}) - plain).norm() / plain.norm())

    assert 1e-3 < error(1) < 0.05
    assert 0 < error(2) < error(1) / 4


def test_weight_terms_quantise_each_row_and_tile_by_the_caches_rule():
    weights = torch.randn(2, 5, 150, generator=torch.Generator().manual_seed(1)) * 1e-3
    weights[0, 0, 64:128] *= 2 ** -20                      # a tile far below the row's others
    one = weight_terms(weights, 1, tile=64)
    codes, scales = quantise(weights[..., 64:128], E4M3)
    assert torch.equal(one[..., 64:128], codes.view(E4M3).float() * (scales.int() - 127).float().exp2()[..., None])
    assert torch.equal(weight_terms(weights, 1, tile=1000), query_terms(weights, 1)[0])
    two = weight_terms(weights, 2, tile=64)
    assert float(((two - weights).abs() / weights.abs().amax(-1, keepdim=True)).amax()) <= 2 ** -8
    running = weight_terms(weights, 1, tile=64, running=True)
    assert torch.equal(running[..., :64], one[..., :64])
    small = weights[0, 0, 64:128]
    assert float((running[0, 0, 64:128] - small).abs().amax()) > float((one[0, 0, 64:128] - small).abs().amax())
    with pytest.raises(ValueError, match="terms=0"):
        weight_terms(weights, 0)


def test_transposed_value_codes_hold_each_heads_dims_tokens_contiguously_and_keep_the_rest():
    batch = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    cache = quantised_batch(batch, E4M3, PAGE).kv_cache
    moved = transpose_value_codes(cache, PAGE)
    codes, scales = page_views(cache, PAGE)
    moved_codes, moved_scales = page_views(moved, PAGE)
    assert torch.equal(moved_codes[:, 0], codes[:, 0]) and torch.equal(moved_scales, scales)
    assert torch.equal(moved[:, :, PAGE:], cache[:, :, PAGE:])
    pages, heads, dim = cache.shape[0], cache.shape[3], cache.shape[4]
    by_dim = moved_codes[:, 1].reshape(pages, heads, dim, PAGE)
    assert torch.equal(by_dim[3, 1, 5], codes[3, 1, :, 1, 5])
    assert torch.equal(by_dim.permute(0, 3, 1, 2), codes[:, 1])
    with pytest.raises(ValueError, match="page_size=0"):
        transpose_value_codes(cache, 0)


def test_query_terms_need_an_e4m3_cache():
    batch = make_paged_batch(**LENGTHS, num_heads=2, head_dim=64, page_size=PAGE, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="q_terms=1, p_terms=0 over kv_dtype=None"):
        paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                  torch.zeros_like(batch.q), alpha=0.125, max_seq_len=128, q_terms=1)
