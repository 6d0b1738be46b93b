"""The fp8 Gluon kernel's V dot on fp8 MMAs (Fp8Tiling.pv "fp8", over pages whose V codes are transposed) on an
H200: its attention agrees with the torch reference of the same numerics (paged_attention_reference's p_terms=1
with q_terms=2, over the normal pages) on ragged batches (users with 0, 2 and partly filled pages, whose unwritten
bytes hold NaN codes here) and BS=1 16K, closer to it than to the reference of the bf16 V dot."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import paged_attention_reference
from layerflow.kernels.fp8 import page_views, transpose_value_codes
from tests.kernels.test_gluon_fp8_gpu import E4M3, MAX_SEQ_LEN, PAGE, SMALL, attention, fp8_batch, relative_error

pytestmark = pytest.mark.gpu

D = 256
NAN_CODE = 0x7F     # e4m3's NaN


def check_pv(batch) -> None:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v)]

    def reference(p_terms: int) -> torch.Tensor:
        return paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]),
                                         alpha=D ** -0.5, max_seq_len=MAX_SEQ_LEN, kv_dtype=E4M3, q_terms=2,
                                         p_terms=p_terms)

    attn = attention(batch, "gluon", D, E4M3, replace(attention(batch, "gluon", D, E4M3).gluon.tiling, pv="fp8"))
    pages = transpose_value_codes(batch.kv_cache, PAGE)
    out = attn.run(batch.q, batch.k, batch.v, pages, *batch.lengths, torch.zeros_like(batch.q))
    total = batch.total_tokens
    own, other = relative_error(out, reference(1), total), relative_error(out, reference(0), total)
    assert own < 1e-2 and own < other, (own, other)


def with_nan_in_unwritten_slots(batch):
    """The batch with every V code of its pages' unwritten token slots (past each user's history) set to NaN."""
    codes, _ = page_views(batch.kv_cache, PAGE)
    for user, history in enumerate(batch.history_lens.tolist()):
        first_page, slot = divmod(history, PAGE)
        if slot:
            codes[batch.page_table[user, first_page], 1, slot:] = NAN_CODE
    return batch


def test_small_ragged_batch_matches_its_reference():
    check_pv(with_nan_in_unwritten_slots(fp8_batch(*SMALL, D, E4M3)))


@pytest.mark.parametrize("candidates", [256, 0])
def test_bs1_16k_matches_its_reference(candidates):
    check_pv(fp8_batch([16384 + 64], [64], [candidates], D, E4M3))
