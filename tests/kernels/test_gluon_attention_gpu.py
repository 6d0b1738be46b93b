"""The Gluon attention kernel on an H200 against the `tl` kernel and the fp32 torch reference: ragged batches with
0-history users, 0 and 256 candidates, BS 1 and 8, every head dim, and one CUDA graph replayed across lengths."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import PagedAttention, default_tiling, kv_append, paged_attention_reference
from layerflow.kernels.gluon_attention import GluonTiling, default_gluon_tiling
from tests.kernels.cuda_graph import captured, replay_on
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

pytestmark = pytest.mark.gpu

H, PAGE, MAX_SEQ_LEN = 4, 32, 16384 + 512
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def appended_batch(history, appended, candidates, head_dim, dtype, **capacity) -> PagedBatch:
    batch = make_paged_batch(history, appended, candidates, num_heads=H, head_dim=head_dim, page_size=PAGE,
                             dtype=dtype, device="cuda", **capacity)
    kv_append(batch.k, batch.v, batch.kv_cache, *batch.lengths)
    return batch


def run(batch: PagedBatch, kernel: str, head_dim: int, dtype: torch.dtype, tiling: GluonTiling | None = None):
    users = batch.page_table.shape[0]
    tokens = batch.q.shape[0]
    attn = PagedAttention(users, tokens, batch.page_table.shape[1], H, head_dim, PAGE, dtype, "cuda",
                          head_dim ** -0.5, MAX_SEQ_LEN, tiling=default_tiling(head_dim, dtype, tokens // users),
                          kernel=kernel, gluon_tiling=tiling)
    assert (attn.gluon is not None) == (kernel == "gluon")
    return attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))


def relative_error(out: torch.Tensor, expected: torch.Tensor, total: int) -> float:
    out, expected = out[:total].float(), expected[:total].float()
    assert torch.isfinite(out).all()
    return float((out - expected).norm() / expected.norm())


def check(batch: PagedBatch, head_dim: int, dtype: torch.dtype, tiling: GluonTiling | None = None) -> None:
    f32 = [t.float() for t in (batch.q, batch.k, batch.v, batch.kv_cache)]
    expected = paged_attention_reference(*f32, *batch.lengths, torch.zeros_like(f32[0]), alpha=head_dim ** -0.5,
                                         max_seq_len=MAX_SEQ_LEN)
    gluon = run(batch, "gluon", head_dim, dtype, tiling)
    tl = run(batch, "triton", head_dim, dtype)
    total = batch.total_tokens
    assert relative_error(gluon, expected, total) < TOLERANCE[dtype]
    assert relative_error(gluon, tl, total) < TOLERANCE[dtype]


SMALL = ([0, 300, 2, 1500 + 64, 64], [0, 17, 2, 64, 64], [256, 3, 4, 0, 1])


@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16),
                                             (128, torch.float16)])
def test_small_ragged_batch_matches_tl_and_reference(head_dim, dtype):
    check(appended_batch(*SMALL, head_dim, dtype), head_dim, dtype)


@pytest.mark.parametrize("history", [[16384], [2048, 16384, 0, 8192, 3000, 12000, 6000, 10000]],
                         ids=["bs1-16k", "bs8-0-16k"])
@pytest.mark.parametrize("candidates", [0, 256])
def test_real_sizes_match_tl_and_reference(history, candidates):
    n = len(history)
    check(appended_batch([h + 64 for h in history], [64] * n, [candidates] * n, 256, torch.bfloat16), 256,
          torch.bfloat16)


@pytest.mark.parametrize("tiling", [GluonTiling(32, 2), GluonTiling(32, 4), GluonTiling(64, 2)],
                         ids=["32x2", "32x4", "64x2"])
def test_other_tilings_compute_the_same(tiling):
    check(appended_batch([4096 + 64, 700], [64, 64], [256, 0], 128, torch.bfloat16), 128, torch.bfloat16, tiling)


# The warp-specialised schedules ("pv", "pv2": two 64-row consumers) at the tilings the H200 A/B times (the TMA
# loader, the tanh SiLU, the loader's registers, unmasked whole tiles, the self tiles last, 32-key tiles); the
# synchronous ones are above.
VARIANTS = [GluonTiling(64, 2, "pv"), GluonTiling(32, 3, "pv"), GluonTiling(64, 2, "pv", loader="tma"),
            GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True),
            GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True, producer_registers=96),
            GluonTiling(64, 2, "pv", unmasked_whole_tiles=True),
            GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True, unmasked_whole_tiles=True, self_last=True),
            GluonTiling(64, 2, "pv2", loader="tma", tanh_silu=True, unmasked_whole_tiles=True, self_last=True),
            GluonTiling(64, 2, "pv2", block_m=128, loader="tma", tanh_silu=True, unmasked_whole_tiles=True,
                        self_last=True)]
PV2 = VARIANTS[-1]


def variant_id(tiling: GluonTiling) -> str:
    options = [f"m{tiling.block_m}"] * bool(tiling.block_m) + ["tma"] * (tiling.loader == "tma") + \
        ["tanh"] * tiling.tanh_silu + \
        [f"r{tiling.producer_registers}"] * (tiling.producer_registers != GluonTiling.producer_registers) + \
        ["wt"] * tiling.unmasked_whole_tiles + ["sl"] * tiling.self_last + \
        [f"f{round(tiling.m64_fill * 100)}"] * (tiling.m64_fill != 1)
    return ":".join([f"{tiling.block_n}x{tiling.stages}", tiling.variant, *options])


@pytest.mark.parametrize("tiling", VARIANTS, ids=variant_id)
def test_variants_match_tl_and_reference_on_a_small_batch(tiling):
    check(appended_batch(*SMALL, 256, torch.bfloat16), 256, torch.bfloat16, tiling)


def test_the_tanh_silu_holds_the_fp16_tolerance():
    """tanh.approx's ~2^-11 relative error against fp16's tighter bound, synchronous and warp-specialised."""
    batch = appended_batch(*SMALL, 128, torch.float16)
    for tiling in (GluonTiling(64, 3, tanh_silu=True), GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True)):
        check(batch, 128, torch.float16, tiling)


def test_two_consumer_halves_match_tl_and_reference_where_the_upper_half_is_partial_or_empty():
    """"pv2" on 128-row blocks whose upper half is full, partial (users of 100 and 217 rows) or empty (the last
    blocks of the 320-row users and the 20-row user), users of 0 and 16K cached history among them."""
    batch = appended_batch([3000, 64, 700, 16384 + 64, 300], [64, 64, 17, 64, 17], [36, 256, 200, 256, 3], 256,
                           torch.bfloat16)
    check(batch, 256, torch.bfloat16, PV2)


@pytest.mark.parametrize("users", [1, 8], ids=["bs1", "bs8"])
@pytest.mark.parametrize("candidates", [0, 256])
@pytest.mark.parametrize("tiling", [GluonTiling(32, 3), GluonTiling(64, 2)] + VARIANTS, ids=variant_id)
def test_variants_match_tl_at_the_benchmark_shapes(tiling, users, candidates):
    """benchmarks/kernels.py's BS=1/8, 16K, D=256 shapes (same capacities, so the same compiled kernels)."""
    batch = appended_batch([16384 + 64] * users, [64] * users, [candidates] * users, 256, torch.bfloat16)
    gluon = run(batch, "gluon", 256, torch.bfloat16, tiling)
    tl = run(batch, "triton", 256, torch.bfloat16)
    assert relative_error(gluon, tl, batch.total_tokens) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("splits,self_last,variant", [("bucket", False, "pv"), ("rows", True, "pv"),
                                                     ("rows", True, "pv2")],
                         ids=["bucket-first", "rows-last", "rows-last-pv2"])
def test_one_graph_replays_any_lengths_like_eager(splits, self_last, variant):
    """Under the "rows" split rule the graph's split count follows each replay's rows, here with the self tiles on
    the last split too, in one consumer or two consumer halves (the default schedule)."""
    max_batch, max_tokens, max_pages, num_pages = 4, 4 * 320, 16384 // PAGE + 4, 2 * (16384 // PAGE) + 64
    cases = [([16384 + 64], [64], [256]), ([2048, 5000, 64, 8192], [64, 64, 64, 1], [256, 0, 100, 256]),
             ([0, 300], [0, 17], [256, 3])]

    def batch_of(case) -> PagedBatch:
        pages = sum(-(-h // PAGE) for h in case[0])
        return appended_batch(*case, 256, torch.bfloat16, max_batch=max_batch, max_tokens=max_tokens,
                              max_pages_per_user=max_pages, spare_pages=num_pages - pages)

    attn = PagedAttention(max_batch, max_tokens, max_pages, H, 256, PAGE, torch.bfloat16, "cuda", 256 ** -0.5,
                          MAX_SEQ_LEN, kernel="gluon", splits=splits,
                          gluon_tiling=replace(default_gluon_tiling(256, PAGE), self_last=self_last, variant=variant))
    static = batch_of(cases[0])
    static_out = torch.zeros_like(static.q)
    graph = captured(lambda: attn.run(static.q, static.k, static.v, static.kv_cache, *static.lengths, static_out))
    for case in cases:
        fresh = batch_of(case)
        replay_on(graph, static, fresh, static_out)
        eager = attn.run(fresh.q, fresh.k, fresh.v, fresh.kv_cache, *fresh.lengths, torch.zeros_like(fresh.q))
        assert torch.equal(static_out[:fresh.total_tokens], eager[:fresh.total_tokens]), f"replay != eager: {case}"
