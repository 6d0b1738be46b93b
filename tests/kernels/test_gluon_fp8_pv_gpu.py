"""The fp8 Gluon kernel's "pv" schedule (Fp8Tiling.schedule, gluon_fp8_pv) on an H200: the same sums in the same order
as the "ws" schedule with Q K^T on fp8 MMAs, so bit for bit its output at the same tile size (small ragged batches
at D=64/128/256, BS=1 16K at 0 and 256 candidates, 32- and 64-key tiles, two or three slots), its default tiling
taken under $LAYERFLOW_FP8_SCHEDULE=pv and within bf16 rounding of the torch reference of those numerics, and one CUDA
graph replayed across lengths."""

from dataclasses import replace

import pytest
import torch

from layerflow.kernels import paged_attention_reference
from layerflow.kernels.gluon_fp8_tiling import SCHEDULE_ENV, Fp8Tiling
from tests.kernels.test_gluon_fp8_gpu import E4M3, MAX_SEQ_LEN, SMALL, attention, fp8_batch, relative_error, run
from tests.kernels.test_gluon_fp8_gpu import test_one_graph_replays_any_lengths_like_eager as \
    replays_any_lengths_like_eager

pytestmark = pytest.mark.gpu

WS = dict(qk="fp8x2", decode="bits")


def pv_id(tiling: Fp8Tiling) -> str:
    return f"{tiling.block_n}x{tiling.stages}c{tiling.code_stages}"


PV_TILINGS = [Fp8Tiling(32, 2, 4, schedule="pv", **WS), Fp8Tiling(32, 3, 4, schedule="pv", **WS),
              Fp8Tiling(64, 2, 2, schedule="pv", **WS)]


def same_as_ws(batch, head_dim: int, pv: Fp8Tiling) -> torch.Tensor:
    """The pv output, asserted bitwise equal to the ws schedule's at pv's tile size (ws: one code slot at 64 keys,
    where two do not fit beside the query terms at D=256; four at 32)."""
    ws = replace(pv, schedule="ws", stages=2, code_stages=1 if pv.block_n == 64 else 4)
    out = run(batch, "gluon", head_dim, E4M3, pv)
    expected = run(batch, "gluon", head_dim, E4M3, ws)
    assert torch.equal(out[:batch.total_tokens], expected[:batch.total_tokens])
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_small_ragged_batches_give_the_ws_schedules_result_bit_for_bit(head_dim):
    same_as_ws(fp8_batch(*SMALL, head_dim, E4M3), head_dim, Fp8Tiling(32 if head_dim > 128 else 64, 2,
                                                                      4 if head_dim > 128 else 2, schedule="pv",
                                                                      **WS))


@pytest.mark.parametrize("pv", PV_TILINGS, ids=pv_id)
@pytest.mark.parametrize("candidates", [256, 0])
def test_bs1_16k_gives_the_ws_schedules_result_bit_for_bit(pv, candidates):
    same_as_ws(fp8_batch([16384 + 64], [64], [candidates], 256, E4M3), 256, pv)


@pytest.mark.parametrize("candidates", [256, 0])
def test_the_default_pv_tiling_matches_the_reference_of_its_numerics(monkeypatch, candidates):
    monkeypatch.setenv(SCHEDULE_ENV, "pv")
    batch = fp8_batch([2048 + 64, 700], [64, 64], [candidates, 3], 256, E4M3)
    attn = attention(batch, "gluon", 256, E4M3)
    assert attn.gluon.tiling.schedule == "pv"
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    f32 = [t.float() for t in (batch.q, batch.k, batch.v)]
    expected = paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]),
                                         alpha=256 ** -0.5, max_seq_len=MAX_SEQ_LEN, kv_dtype=E4M3, q_terms=2)
    assert relative_error(out, expected, batch.total_tokens) < 1e-2


def test_one_graph_replays_any_lengths_like_eager(monkeypatch):
    """test_gluon_fp8_gpu's replay across lengths over the "rows" split table, under the pv schedule."""
    monkeypatch.setenv(SCHEDULE_ENV, "pv")
    replays_any_lengths_like_eager(monkeypatch, "bits")


PVS = dict(schedule="pvs", **WS)


@pytest.mark.parametrize("history", [16384, 2048])
def test_pvs_with_the_exact_masked_silu_gives_the_ws_schedules_result_bit_for_bit(history):
    """P through shared memory: the same bf16 P as in registers, so the same sums."""
    batch = fp8_batch([history + 64], [64], [256], 256, E4M3)
    pvs = run(batch, "gluon", 256, E4M3, Fp8Tiling(64, 2, 1, unmasked_whole_tiles=False, **PVS))
    ws = run(batch, "gluon", 256, E4M3, Fp8Tiling(64, 2, 1, **WS))
    assert torch.equal(pvs[:batch.total_tokens], ws[:batch.total_tokens])


@pytest.mark.parametrize("history", [16384, 2048])
def test_the_default_pvs_tiling_agrees_with_the_ws_schedules_tanh_silu(monkeypatch, history):
    """The default "pvs" tiling (tanh SiLU) against ws with the tanh SiLU: alpha and the key scales are applied to S
    before its halving there, after it in ws (the same values but for subnormal products)."""
    monkeypatch.setenv(SCHEDULE_ENV, "pvs")
    batch = fp8_batch([history + 64], [64], [256], 256, E4M3)
    attn = attention(batch, "gluon", 256, E4M3)
    assert (attn.gluon.tiling.schedule, attn.gluon.tiling.silu, attn.gluon.tiling.block_n) == ("pvs", "tanh", 64)
    out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
    ws = run(batch, "gluon", 256, E4M3, Fp8Tiling(64, 2, 1, silu="tanh", **WS))
    assert relative_error(out, ws, batch.total_tokens) < 1e-6
