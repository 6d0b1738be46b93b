"""The split rules and the self tiles' split on an H200: the Gluon kernel under the "rows" rule (a 512-token capacity
running 320 real rows), with the candidates' self tiles on the last split and with the history cap, against the fp32
reference (one graph replayed across lengths under both: test_gluon_attention_gpu.py); and the early launch (pdl) of
the attention and its gate, bit for bit as without it in a captured graph."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, paged_attention_reference
from layerflow.kernels.gluon_attention import default_gluon_tiling
from layerflow.kernels.pointwise import gated_split_norm
from tests.kernels.cuda_graph import captured
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


def capped(batch: PagedBatch, min_tiles: int, pdl: bool) -> PagedAttention:
    users, tokens = batch.page_table.shape[0], batch.q.shape[0]
    return PagedAttention(users, tokens, batch.page_table.shape[1], H, D, PAGE, DTYPE, "cuda", D ** -0.5, MAX_SEQ_LEN,
                          tiling=default_tiling(D, DTYPE, tokens // users), kernel="gluon", min_split_tiles=min_tiles,
                          pdl=pdl)


@pytest.mark.parametrize("history", [2048, 16384], ids=["2k", "16k"])
@pytest.mark.parametrize("min_tiles", [4, 8])
def test_history_cap_matches_the_reference(history, min_tiles):
    """hstu-bench's request in a 512-token capacity: the table's count for 3 query blocks, capped at
    (history tiles of 64 keys) // min_tiles."""
    batch = appended_batch([history + 64], [64], [256], D, DTYPE, max_tokens=512, max_pages_per_user=528)
    attn = capped(batch, min_tiles, pdl=False)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    assert relative_error(out, reference(batch), batch.total_tokens) < TOLERANCE
    expected = max(1, min(int(attn.split_table[3]), -(-(history + 64) // 64) // min_tiles))
    assert attn.active_splits.tolist() == [expected]


@pytest.mark.parametrize("history", [2048, 16384], ids=["2k", "16k"])
@pytest.mark.parametrize("min_tiles", [0, 8], ids=["table", "capped"])
def test_early_launch_in_a_graph_changes_no_bit(history, min_tiles):
    """A graph of what a layer runs around the attention: a kernel writing the queries, the attention and the gate
    summing its partials, each launched early under pdl; replayed on three query sets, every bit as without pdl."""
    batch = appended_batch([history + 64], [64], [256], D, DTYPE, max_tokens=320, max_pages_per_user=528)
    gen = torch.Generator(device="cuda").manual_seed(1)
    queries = [torch.randn(batch.q.shape, generator=gen, device="cuda").to(DTYPE) for _ in range(3)]
    u = torch.randn(batch.q.shape[0], H * D, generator=gen, device="cuda").to(DTYPE)
    w, b = torch.randn(H * D, device="cuda").to(DTYPE), torch.randn(H * D, device="cuda").to(DTYPE)
    source = torch.empty_like(batch.q)

    def layer(attn: PagedAttention, out: torch.Tensor) -> None:
        batch.q.copy_(source * 1.5)
        split = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.empty_like(batch.q),
                         reduce=False)
        gated_split_norm(u, split.partials.view(split.partials.shape[0], split.partials.shape[1], -1), w, b, 1e-6,
                         out=out, active_splits=split.active, pdl=attn.pdl)

    eager, early = capped(batch, min_tiles, pdl=False), capped(batch, min_tiles, pdl=True)
    out, want = torch.empty_like(u), torch.empty_like(u)
    source.copy_(queries[0])
    graph = captured(lambda: layer(early, out))
    for q in queries:
        source.copy_(q)
        layer(eager, want)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:batch.total_tokens], want[:batch.total_tokens])
