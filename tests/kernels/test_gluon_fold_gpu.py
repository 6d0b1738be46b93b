"""The Gluon attention summing its own split partials (GluonTiling.fold_splits) on an H200: against the fp32 torch
reference and the unfolded launch at the benchmark's shapes and on ragged batches with 0-history users and several
heads, and under a CUDA graph replayed twice in a row per batch (the tiles' barriers must be ready again after every
launch); where a launch could not run all its programs at once, the partials are summed as without the fold."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, paged_attention_reference
from layerflow.kernels.gluon_attention import default_gluon_tiling
from tests.kernels.cuda_graph import captured, replay_on
from tests.kernels.paged_batch import PagedBatch
from tests.kernels.test_gluon_attention_gpu import MAX_SEQ_LEN, PAGE, TOLERANCE, H, appended_batch, relative_error

pytestmark = pytest.mark.gpu

D = 256
FOLD = replace(default_gluon_tiling(D, PAGE), fold_splits=True)


def attention(batch: PagedBatch, folded: bool) -> PagedAttention:
    return PagedAttention(batch.page_table.shape[0], batch.q.shape[0], batch.page_table.shape[1], H, D, PAGE,
                          torch.bfloat16, "cuda", D ** -0.5, MAX_SEQ_LEN, kernel="gluon",
                          gluon_tiling=FOLD if folded else default_gluon_tiling(D, PAGE))


def outputs(batch: PagedBatch, attn: PagedAttention) -> torch.Tensor:
    return attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))


def reference(batch: PagedBatch) -> torch.Tensor:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    return paged_attention_reference(*f32, *batch.lengths, torch.zeros_like(f32[0]), alpha=D ** -0.5,
                                     max_seq_len=MAX_SEQ_LEN)


def arrivals(attn: PagedAttention) -> torch.Tensor:
    """The tiles' barriers' arrival counts (the low 32 bits of each word; 0 once every launch has left)."""
    return attn.fold_barriers & 0xFFFFFFFF


def check_folded(batch: PagedBatch) -> None:
    folded, plain = attention(batch, True), attention(batch, False)
    assert folded.fold_barriers is not None and plain.fold_barriers is None
    out = outputs(batch, folded)
    total = batch.total_tokens
    assert relative_error(out, reference(batch), total) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, outputs(batch, plain), total) < 4e-3     # the split order: bf16's last bit at most
    assert not arrivals(folded).any(), "a tile's arrivals were not reset by its last program"


@pytest.mark.parametrize("candidates", [0, 256])
def test_folded_launch_matches_the_reference_at_the_benchmark_shape(candidates):
    check_folded(appended_batch([16384 + 64], [64], [candidates], D, torch.bfloat16))


@pytest.mark.parametrize("lengths", [([0], [0], [256]), ([300], [17], [3]), ([2048 + 64], [64], [256])],
                         ids=["0-history", "17-appended", "2k"])
def test_folded_launch_matches_on_short_and_empty_histories(lengths):
    """BS=1 (a 320-token bucket is what folds with 4 heads on 132 SMs: a ragged batch's launches do not fit one
    wave, test_a_launch_too_large_for_one_wave_sums_as_without_the_fold)."""
    check_folded(appended_batch(*lengths, D, torch.bfloat16, max_tokens=320, max_pages_per_user=16384 // PAGE + 4))


def test_folded_launch_is_deterministic_and_moves_each_generation_once_per_launch():
    batch = appended_batch([2048 + 64], [64], [256], D, torch.bfloat16)
    attn = attention(batch, True)
    first = outputs(batch, attn)
    for _ in range(3):
        assert torch.equal(outputs(batch, attn), first)
    assert not arrivals(attn).any()
    assert ((attn.fold_barriers >> 32) == 4).all()


def test_a_launch_too_large_for_one_wave_sums_as_without_the_fold():
    batch = appended_batch([16384 + 64] * 8, [64] * 8, [256] * 8, D, torch.bfloat16)
    folded = attention(batch, True)
    assert folded.fold_barriers is None
    assert torch.equal(outputs(batch, folded), outputs(batch, attention(batch, False)))


def test_one_graph_replays_twice_per_batch_like_eager():
    """The barriers' arrivals are back at 0 after every replay, so back-to-back replays over changing lengths (the
    "rows" rule's split count changes with them: 11 splits at 3 query blocks, 16 at 2, 33 at 1) give eager's bits;
    a BS=1 320-token bucket, the one whose every launch fits one wave."""
    max_batch, max_tokens, max_pages, num_pages = 1, 320, 16384 // PAGE + 4, 16384 // PAGE + 64
    cases = [([16384 + 64], [64], [256]), ([2048 + 64], [64], [128]), ([0], [0], [256]), ([300], [17], [3]),
             ([8192 + 64], [64], [0])]

    def batch_of(case) -> PagedBatch:
        pages = sum(-(-h // PAGE) for h in case[0])
        return appended_batch(*case, D, torch.bfloat16, max_batch=max_batch, max_tokens=max_tokens,
                              max_pages_per_user=max_pages, spare_pages=num_pages - pages)

    static = batch_of(cases[0])
    attn = attention(static, True)
    assert attn.fold_barriers is not None
    static_out = torch.zeros_like(static.q)
    graph = captured(lambda: attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out))
    for case in cases:
        fresh = batch_of(case)
        eager = outputs(fresh, attn)
        total = fresh.total_tokens
        for _ in range(2):
            replay_on(graph, static, fresh, static_out)
            assert torch.equal(static_out[:total], eager[:total]), f"replay != eager: {case}"
            assert not arrivals(attn).any()
        assert relative_error(eager, reference(fresh), total) < TOLERANCE[torch.bfloat16]
