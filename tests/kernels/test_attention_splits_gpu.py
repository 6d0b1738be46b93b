"""The split rules and the self tiles' split on an H200: the Gluon kernel under the "rows" rule (a 512-token capacity
running 320 real rows) and with the candidates' self tiles on the last split, against the fp32 reference (one graph
replayed across lengths under both: test_gluon_attention_gpu.py)."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, paged_attention_reference
from layerflow.kernels.gluon_attention import default_gluon_tiling
from tests.kernels.paged_batch import PagedBatch
from tests.kernels.test_gluon_attention_gpu import H, MAX_SEQ_LEN, PAGE, appended_batch, relative_error

pytestmark = pytest.mark.gpu

D, DTYPE, TOLERANCE = 256, torch.bfloat16, 1e-2


def attention(batch: PagedBatch, splits: str, self_last: bool) -> PagedAttention:
    users, tokens = batch.page_table.shape[0], batch.q.shape[0]
    return PagedAttention(users, tokens, batch.page_table.shape[1], H, D, PAGE, DTYPE, "cuda", D ** -0.5,
                          MAX_SEQ_LEN, tiling=default_tiling(D, DTYPE, tokens // users), kernel="gluon",
                          gluon_tiling=replace(default_gluon_tiling(D, PAGE), self_last=self_last), splits=splits)


def reference(batch: PagedBatch) -> torch.Tensor:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    return paged_attention_reference(*f32, *batch.lengths, torch.zeros_like(f32[0]), alpha=D ** -0.5,
                                     max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("history", [2048, 16384], ids=["2k", "16k"])
@pytest.mark.parametrize("splits,self_last", [("bucket", False), ("bucket", True), ("rows", False), ("rows", True)],
                         ids=["bucket-first", "bucket-last", "rows-first", "rows-last"])
def test_320_rows_in_a_512_token_capacity_match_the_reference(history, splits, self_last):
    """hstu-bench's request in the engine's 512-token bucket (its page-table width too, so these compile the
    kernels the engine's graphs run)."""
    batch = appended_batch([history + 64], [64], [256], D, DTYPE, max_tokens=512, max_pages_per_user=528)
    attn = attention(batch, splits, self_last)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    assert relative_error(out, reference(batch), batch.total_tokens) < TOLERANCE
    if splits == "rows":
        assert attn.split_rule == "rows" and attn.active_splits.tolist() == [int(attn.split_table[3])]
        assert int(attn.split_table[3]) < attn.num_splits     # 3 real query blocks of 4: fewer splits
