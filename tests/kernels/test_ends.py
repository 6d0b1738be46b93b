"""The model's two ends (layerflow.kernels.ends) against the torch math of layerflow.model.embedding: in the
interpreter on the CPU (small shapes), on the GPU at the benchmark model's width."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels.ends import candidate_dot, embed_rows  # noqa: E402
from layerflow.model import HSTUConfig, HSTUWeights  # noqa: E402
from layerflow.model.embedding import candidate_scores, embed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(dtype: torch.dtype, width: int) -> HSTUWeights:
    config = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=width, max_seq_len=64, dtype=dtype,
                        item_vocab_size=50, position_table_size=64)
    return HSTUWeights.init(config, seed=1).to(DEVICE)


def _ints(n: int, high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [24, 32])
def test_embedding_rows_are_the_models_bits(dtype, width):
    """24 columns: not a power of two, so the masked tail is part of the test; repeated ids and positions. The
    interpreter truncates fp32 to bf16 where the GPU rounds to nearest even: one rounding step apart there."""
    w = _weights(dtype, width)
    ids, positions = _ints(9, 50, seed=2), _ints(9, 64, seed=3)
    got, want = embed_rows(w.item_embedding, w.position_embedding, ids, positions), embed(w, ids, positions)
    assert got.dtype == dtype
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_scores_match_the_model(dtype):
    w = _weights(dtype, 24)
    x = torch.randn(11, 24, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    rows, ids = _ints(6, 11, seed=5), _ints(6, 50, seed=6)
    out = torch.full((6,), float("nan"), device=DEVICE)
    candidate_dot(x, w.item_embedding, rows, ids, out)
    torch.testing.assert_close(out, candidate_scores(w, x[rows.long()], ids), rtol=1e-5, atol=1e-5)


def test_a_column_slice_of_wider_rows_is_read_by_its_stride():
    w = _weights(torch.float32, 24)
    wide = torch.randn(5, 40, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    rows, ids = _ints(4, 5, seed=8), _ints(4, 50, seed=9)
    out = torch.empty(4, device=DEVICE)
    candidate_dot(wide[:, 8:32], w.item_embedding, rows, ids, out)
    torch.testing.assert_close(out, candidate_scores(w, wide[rows.long(), 8:32], ids), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_by_name():
    w = _weights(torch.float32, 24)
    ids = _ints(3, 50, seed=0)
    with pytest.raises(ValueError, match="ids/positions shapes"):
        embed_rows(w.item_embedding, w.position_embedding, ids, ids[:2])
    with pytest.raises(ValueError, match="x .* shape"):
        candidate_dot(torch.zeros(3, 16, device=DEVICE), w.item_embedding, ids, ids, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="float32 out"):
        candidate_dot(torch.zeros(3, 24, device=DEVICE), w.item_embedding, ids, ids,
                      torch.zeros(3, dtype=torch.float64, device=DEVICE))


@pytest.mark.gpu
def test_the_benchmark_models_ends_on_the_gpu():
    """E = 1024, 320 token rows, 256 candidates: the rows bit for bit, the scores within fp32 rounding."""
    w = _weights(torch.bfloat16, 1024)
    ids, positions = _ints(320, 50, seed=10), _ints(320, 64, seed=11)
    x = embed_rows(w.item_embedding, w.position_embedding, ids, positions)
    assert torch.equal(x, embed(w, ids, positions))
    rows, cand = _ints(256, 320, seed=12), _ints(256, 50, seed=13)
    out = torch.empty(256, device=DEVICE)
    candidate_dot(x, w.item_embedding, rows, cand, out)
    torch.testing.assert_close(out, candidate_scores(w, x[rows.long()], cand), rtol=1e-4, atol=1e-3)
