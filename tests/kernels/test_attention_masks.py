"""The paged attention kernel under every mask option (contextual prefix, window, both), STU head shapes and the
device 1/N, against the paged torch reference and a dense computation from the model's own mask and attention.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import AttentionTiling, PagedAttention, kv_append, paged_attention_reference  # noqa: E402
from layerflow.kernels.reference import gather_history  # noqa: E402
from layerflow.model import HSTUConfig  # noqa: E402
from layerflow.model.mask import MaskRule, attention_mask, cached_read_range  # noqa: E402
from layerflow.model.reference import hstu_attention  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA, MAX_SEQ_LEN = 0.125, 300
MASKS = {
    "plain": MaskRule(),
    "ctx3": MaskRule(contextual_len=3),
    "window8": MaskRule(max_attn_len=8),
    "ctx3-window8": MaskRule(contextual_len=3, max_attn_len=8),
    "ctx5-window3": MaskRule(contextual_len=5, max_attn_len=3),   # the window ends inside the prefix
    "ctx1-window20": MaskRule(contextual_len=1, max_attn_len=20),
}
# A candidates-only user with no history, a user whose appended tokens span a page and a window, one shorter than
# the contextual prefix, one with 20 appended tokens (two query blocks), a long one, an empty one.
LENGTHS = dict(history_lens=[0, 37, 2, 20, 45, 0], appended_lens=[0, 3, 2, 20, 5, 0],
               candidate_lens=[3, 2, 1, 0, 4, 0])


def paged_batch(mask: MaskRule, head_dim: int = 64, num_heads: int = 2, page_size: int = 16,
                lengths: dict = LENGTHS) -> PagedBatch:
    batch = make_paged_batch(**lengths, num_heads=num_heads, head_dim=head_dim, page_size=page_size,
                             dtype=torch.float32, device=DEVICE, max_tokens=48)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    return batch


def kernel(batch: PagedBatch, mask: MaskRule, tiling: AttentionTiling, inv_n: torch.Tensor | None = None):
    num_heads, head_dim = batch.q.shape[1:]
    attn = PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], num_heads,
                          head_dim, batch.kv_cache.shape[2], torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN,
                          tiling=tiling, mask=mask)
    return attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q), inv_n)


def dense_expected(batch: PagedBatch, mask: MaskRule, n: list[float]) -> torch.Tensor:
    """Each user's whole history gathered densely, its queries' rows of the model's mask, the model's attention."""
    out = torch.zeros_like(batch.q)
    offsets, hist, appended = batch.q_offsets.tolist(), batch.history_lens.tolist(), batch.appended_lens.tolist()
    for b, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi == lo:
            continue
        k_hist, v_hist = gather_history(batch.kv_cache, batch.page_table[b], hist[b])
        cand = slice(lo + appended[b], hi)
        seen = attention_mask(hist[b], appended[b], hi - lo - appended[b], mask).to(DEVICE)
        out[lo:hi] = hstu_attention(batch.q[lo:hi], torch.cat([k_hist, batch.k[cand]]),
                                    torch.cat([v_hist, batch.v[cand]]), seen, ALPHA, n[b])
    return out


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("num_splits,preload", [(1, False), (3, True)])
def test_every_mask_option_matches_the_dense_model_math(mask_name, num_splits, preload):
    mask = MASKS[mask_name]
    batch = paged_batch(mask)
    out = kernel(batch, mask, AttentionTiling(16, 16, 4, 1, preload_pages=preload, num_splits=num_splits))
    total = batch.total_tokens
    assert torch.isfinite(out[:total]).all()
    expected = dense_expected(batch, mask, [MAX_SEQ_LEN] * batch.page_table.shape[0])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("head_dim,page_size", [(128, 32), (256, 16)])
@pytest.mark.parametrize("mask_name", ["plain", "ctx3-window8"])
def test_stu_head_shapes(head_dim, page_size, mask_name):
    """DLRMv3's heads (4 x 128) and the 256-wide ones, STU-style: attention does not depend on the family."""
    mask = MASKS[mask_name]
    lengths = dict(history_lens=[45, 9], appended_lens=[4, 9], candidate_lens=[6, 3])
    batch = paged_batch(mask, head_dim=head_dim, num_heads=4 if head_dim == 128 else 1, page_size=page_size,
                        lengths=lengths)
    out = kernel(batch, mask, AttentionTiling(16, 16, 4, 1, preload_pages=True, num_splits=2))
    expected = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                         torch.zeros_like(batch.q), alpha=ALPHA, max_seq_len=MAX_SEQ_LEN, mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mask_name", ["window8", "ctx3-window8", "ctx5-window3"])
@pytest.mark.parametrize("preload", [False, True])
def test_window_reads_only_the_pages_of_its_read_range(mask_name, preload):
    """Page-table entries wholly before each user's cached_read_range point at a NaN page (as pages the engine did
    not onboard would hold anything): the kernel and the reference never read them."""
    mask = MASKS[mask_name]
    lengths = dict(history_lens=[80, 70, 66], appended_lens=[3, 0, 20], candidate_lens=[4, 5, 2])
    batch = paged_batch(mask, lengths=lengths)
    page = batch.kv_cache.shape[2]
    used = {int(p) for b, h in enumerate(lengths["history_lens"]) for p in batch.page_table[b, :-(-h // page)]}
    nan_page = next(p for p in range(batch.kv_cache.shape[0]) if p not in used)
    assert torch.isnan(batch.kv_cache[nan_page]).all()
    redirected = 0
    for b, (h, a, c) in enumerate(zip(*lengths.values())):
        start = cached_read_range(mask, h - a, a, c).start
        batch.page_table[b, :start // page] = nan_page
        redirected += start // page
    assert redirected >= 5
    out = kernel(batch, mask, AttentionTiling(16, 16, 4, 1, preload_pages=preload, num_splits=3))
    assert torch.isfinite(out[:batch.total_tokens]).all()
    expected = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                         torch.zeros_like(batch.q), alpha=ALPHA, max_seq_len=MAX_SEQ_LEN, mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


def test_inv_n_from_a_device_tensor_per_batch_or_per_user():
    mask = MASKS["ctx3-window8"]
    batch = paged_batch(mask)
    users = batch.page_table.shape[0]
    tiling = AttentionTiling(16, 16, 4, 1, num_splits=2)
    batch_n = torch.tensor([1 / 46], dtype=torch.float32, device=DEVICE)
    torch.testing.assert_close(kernel(batch, mask, tiling, batch_n), dense_expected(batch, mask, [46.0] * users),
                               rtol=1e-5, atol=1e-7)
    per_user = torch.tensor([1 / (40 + b) for b in range(users)], dtype=torch.float32, device=DEVICE)
    torch.testing.assert_close(kernel(batch, mask, tiling, per_user),
                               dense_expected(batch, mask, [40.0 + b for b in range(users)]), rtol=1e-5, atol=1e-7)
    default = kernel(batch, mask, tiling)
    torch.testing.assert_close(default, dense_expected(batch, mask, [MAX_SEQ_LEN] * users), rtol=1e-5, atol=1e-7)


def test_bad_inv_n_and_unsupported_masks_raise():
    batch = paged_batch(MaskRule())
    attn = PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], 2, 64, 16,
                          torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, tiling=AttentionTiling(16, 16, 4, 1))
    for bad in (torch.ones(2, device=DEVICE), torch.ones(1, dtype=torch.float64, device=DEVICE)):
        with pytest.raises(ValueError, match="inv_n"):
            attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q), bad)
    with pytest.raises(ValueError, match="target_aware=False"):
        PagedAttention(1, 8, 2, 1, 64, 16, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN,
                       mask=MaskRule(target_aware=False))
    with pytest.raises(ValueError, match="dqk=64 != dv=128"):
        PagedAttention.for_model(HSTUConfig(dqk=64, dv=128), 1, 8, 2, 16, DEVICE)


def test_for_model_takes_the_config_options():
    config = HSTUConfig(family="stu", num_heads=4, dqk=128, dv=128, embedding_dim=512, contextual_len=3,
                        max_attn_len=8, attn_alpha=0.5, max_seq_len=1000, dtype=torch.float32)
    attn = PagedAttention.for_model(config, 2, 32, 4, 16, DEVICE)
    assert (attn.mask, attn.alpha, attn.max_seq_len, attn.head_dim, attn.num_heads) == (
        config.mask_rule, 0.5, 1000, 128, 4)
    assert attn.constant_inv_n.item() == pytest.approx(1 / 1000)
