"""The split rules of the paged attention (layerflow.kernels.splits): the bucket's split count, and the "rows" rule's
count of each launch's real query blocks, read from a device table; the split sums that read only what was written.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import AttentionTiling, PagedAttention, kv_append, paged_attention_reference  # noqa: E402
from layerflow.kernels import attention  # noqa: E402
from layerflow.kernels.pointwise import gated_layer_norm, gated_split_norm  # noqa: E402
from layerflow.kernels.gluon_attention import GluonAttention, default_gluon_tiling  # noqa: E402
from layerflow.kernels.splits import SplitPartials, fill_splits, rows_table, wave_splits  # noqa: E402
from tests.kernels.paged_batch import make_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA, MAX_SEQ_LEN, H, D, PAGE = 0.125, 300, 2, 64, 16
RAGGED = dict(history_lens=[0, 37, 1, 20, 0], appended_lens=[0, 3, 1, 20, 0], candidate_lens=[3, 2, 0, 0, 0])


def test_wave_splits_fill_whole_waves_of_132_sms():
    # hstu-bench's layer: 4 heads, 128-row query blocks. A 512-token bucket takes 15 splits (4 blocks: 240
    # programs, 0.91 of two waves); 320 real tokens are 3 blocks, for which 11 splits fill one wave exactly.
    assert wave_splits(16, 132, 128) == 15 and wave_splits(12, 132, 128) == 11
    assert rows_table(4, 4, 132, 15) == [1, 15, 15, 11, 15]
    assert wave_splits(1, 4, 3) == 3        # never enough programs: the count that fills the most


def test_a_launch_of_one_wave_can_fill_a_share_of_it():
    # BS=1 without candidates: one 64-row block, 4 heads. The wave takes 33 splits (132 programs); two thirds of it
    # 22 (88). A launch the wave rule spreads over two waves (8 blocks: 8 splits, 256 programs) keeps its count.
    assert fill_splits(4, 132, 128) == 33 and fill_splits(4, 132, 128, 2 / 3) == 22
    assert fill_splits(32, 132, 128, 2 / 3) == wave_splits(32, 132, 128) == 8
    assert fill_splits(4, 132, 12, 2 / 3) == 12 and fill_splits(33, 132, 128, 0.5) == 2
    assert rows_table(2, 4, 132, 33, 2 / 3) == [1, 22, 30]


def test_the_gluon_default_fills_two_thirds_of_the_wave_at_64_row_blocks_only(monkeypatch):
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention, "select_kernel", lambda *args, **kwargs: GluonAttention(default_gluon_tiling(256)))

    def table(tokens: int) -> list[int]:
        layer = PagedAttention(1, tokens, 528, 4, 256, 32, torch.bfloat16, "cpu", ALPHA, 16896)
        return layer.split_table.tolist()

    assert table(64) == [1, 22] and table(320) == rows_table(3, 4, 132, 11) == [1, 11, 11, 11]


def test_bucket_and_rows_rules_on_the_h200s_512_token_bucket(monkeypatch):
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)

    def layer(tokens: int, rule: str | None = None) -> PagedAttention:
        options = {} if rule is None else {"splits": rule}
        return PagedAttention(1, tokens, 528, 4, 256, 32, torch.bfloat16, "cpu", ALPHA, 16896, **options)

    bucket, rows, exact = layer(512, "bucket"), layer(512), layer(320, "bucket")
    assert (bucket.num_splits, bucket.query_slots, bucket.split_table) == (15, 4, None)
    assert rows.split_rule == "rows" and rows.split_table.tolist() == [1, 15, 15, 11, 15]
    assert rows.split_table[3] == exact.num_splits == 11      # 320 real rows split as in their own bucket
    assert rows.active_splits.tolist() == [15]
    # the tl kernel's page-table slice covers the chunk of the fewest splits a launch with real rows takes (11 here)
    assert rows.chunk_pages == bucket.chunk_pages == 64


def test_a_split_rule_not_known_is_named():
    with pytest.raises(ValueError, match="splits='waves'"):
        PagedAttention(1, 64, 4, H, D, PAGE, torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN, splits="waves")


def rows_attention(batch, num_splits: int) -> PagedAttention:
    return PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE,
                          torch.float32, DEVICE, ALPHA, MAX_SEQ_LEN,
                          tiling=AttentionTiling(16, 16, 4, 1, preload_pages=True, num_splits=num_splits))


@pytest.mark.parametrize("lengths", [RAGGED, dict(history_lens=[45], appended_lens=[5], candidate_lens=[40])],
                         ids=["ragged", "one-user"])
def test_rows_rule_launches_the_tables_count_and_sums_only_those_partials(lengths):
    batch = make_paged_batch(**lengths, num_heads=H, head_dim=D, page_size=PAGE, dtype=torch.float32, device=DEVICE,
                             max_batch=6, max_tokens=64)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    attn = rows_attention(batch, 6)
    blocks = sum(-(-(int(b) - int(a)) // 16) for a, b in zip(batch.q_offsets[:-1], batch.q_offsets[1:]))
    active = int(attn.split_table[blocks])
    assert active < attn.num_splits == 6
    attn.partials.fill_(float("nan"))    # what an earlier launch left: the splits past this launch's count keep it
    expected = paged_attention_reference(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths,
                                         torch.zeros_like(batch.q), alpha=ALPHA, max_seq_len=MAX_SEQ_LEN)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    total = batch.total_tokens
    assert attn.active_splits.tolist() == [active]
    assert torch.isnan(attn.partials[active:, :total]).all()
    torch.testing.assert_close(out[:total], expected[:total], rtol=1e-5, atol=1e-7)

    split = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q),
                     reduce=False)
    assert isinstance(split, SplitPartials) and split.active is attn.active_splits
    u = torch.randn(batch.q.shape[0], H * D, device=DEVICE)
    w, b = torch.randn(H * D, device=DEVICE), torch.randn(H * D, device=DEVICE)
    gated = gated_split_norm(u, split.partials.view(6, batch.q.shape[0], -1), w, b, 1e-6, active_splits=split.active)
    reference = gated_layer_norm(u, out.view(out.shape[0], -1), w, b, 1e-6)
    torch.testing.assert_close(gated[:total], reference[:total], rtol=1e-5, atol=1e-5)


def test_gated_split_norm_names_a_bad_count_tensor():
    u = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="active_splits torch.int64"):
        gated_split_norm(u, torch.zeros(2, 4, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                         torch.zeros(8, device=DEVICE), 1e-6, active_splits=torch.ones(1, dtype=torch.int64))

