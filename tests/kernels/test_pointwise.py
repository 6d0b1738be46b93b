"""The normalisation kernels against the model family's torch math, in the interpreter on the CPU (small shapes):
the input LayerNorm, and the output gate in every family and norm, as the pipeline calls it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels.pointwise import gated_layer_norm, gated_split_norm, layer_norm  # noqa: E402
from layerflow.kernels.splits import SplitPartials  # noqa: E402
from layerflow.model import HSTUConfig, HSTUWeights  # noqa: E402
from layerflow.model import family as model_family  # noqa: E402
from layerflow.runtime.pipeline import TritonKernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: the two sum in another order; bf16: torch's default tolerance, about one rounding step."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_matches_the_model(dtype):
    """48 columns: not a power of two, so the masked tail is part of the test."""
    x, weight, bias = _randn(7, 48, seed=0, dtype=dtype), _randn(48, seed=1, dtype=dtype), _randn(48, seed=2,
                                                                                                   dtype=dtype)
    got, want = layer_norm(x, weight, bias, 1e-6), model_family.layer_norm(x, weight, bias, 1e-6)
    assert got.dtype == dtype
    _assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,norm", [("hstu", "layer"), ("hstu", "group"), ("stu", "layer"), ("stu", "group")])
def test_the_output_gate_writes_the_family_output_input(family, norm, dtype):
    """3 heads of 6 (neither a power of two); u is the first columns of the uvqk projection, as in the pipeline."""
    config = HSTUConfig(num_layers=1, num_heads=3, dqk=6, dv=6, embedding_dim=16, max_seq_len=64, dtype=dtype,
                        item_vocab_size=0, position_table_size=0, family=family, output_norm=norm)
    weights = HSTUWeights.init(config, seed=3).to(DEVICE)
    layer = weights.layers[0]
    u = _randn(5, config.uvqk_dim, seed=4, dtype=dtype)[:, :18]
    attn = _randn(5, 3, 6, seed=5, dtype=dtype)
    got = TritonKernels(weights, page_size=16, max_pages=4).output_input(layer, u, attn)
    want = weights.family.output_input(layer, u, attn)
    assert got.shape == want.shape == (5, weights.family.output_blocks * 18)
    _assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,norm", [("hstu", "layer"), ("stu", "group")])
def test_the_gate_over_split_partials_is_the_gate_over_their_sum(family, norm, dtype):
    """3 splits of fp32 partials: the gate adds them in split order and rounds once, as the attention's reduction
    does, so its output equals the gate over the summed, rounded attention output bit for bit (the CPU interpreter
    truncates fp32 to bf16 where the GPU rounds to nearest: there the expected sum is truncated too)."""
    config = HSTUConfig(num_layers=1, num_heads=3, dqk=6, dv=6, embedding_dim=16, max_seq_len=64, dtype=dtype,
                        item_vocab_size=0, position_table_size=0, family=family, output_norm=norm)
    weights = HSTUWeights.init(config, seed=3).to(DEVICE)
    layer, kernels = weights.layers[0], TritonKernels(weights, page_size=16, max_pages=4)
    u = _randn(5, config.uvqk_dim, seed=4, dtype=dtype)[:, :18]
    partials = _randn(3, 5, 3, 6, seed=6)

    def rounded(total: torch.Tensor) -> torch.Tensor:
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            total = (total.view(torch.int32) & -65536).view(torch.float32)   # the interpreter's truncation
        return total.to(dtype)

    summed = rounded((partials[0] + partials[1]) + partials[2])
    got = kernels.output_input(layer, u, SplitPartials(partials, None))
    assert torch.equal(got, kernels.output_input(layer, u, summed))
    # The "rows" split rule's count of written partials: all 3 give the same bits, 2 ignore a poisoned third.
    count = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    assert torch.equal(kernels.output_input(layer, u, SplitPartials(partials, count)), got)
    two = rounded(partials[0] + partials[1])
    poisoned = torch.cat([partials[:2], torch.full_like(partials[2:], float("nan"))])
    assert torch.equal(kernels.output_input(layer, u, SplitPartials(poisoned, count - 1)),
                       kernels.output_input(layer, u, two))
    _assert_close(got, weights.family.output_input(layer, u, summed))


def test_no_rows_launch_nothing():
    a = torch.empty(0, 8, device=DEVICE)
    assert gated_layer_norm(a, a, torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE), 1e-6, groups=2,
                            concat=True).shape == (0, 24)


def test_bad_shapes_are_refused_by_value():
    a, w = torch.zeros(4, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="groups=3"):
        gated_layer_norm(a, a, w, w, 1e-6, groups=3)
    with pytest.raises(ValueError, match=r"weight/bias shapes \(8,\)/\(8,\): expected \[2\]"):
        gated_layer_norm(a, a, w, w, 1e-6, groups=2)
    with pytest.raises(ValueError, match=r"out torch.float32 shape \(4, 8\)"):
        gated_layer_norm(a, a, w, w, 1e-6, a.clone(), concat=True)
    with pytest.raises(ValueError, match=r"x shape \(8, 4\)"):
        layer_norm(a.t(), torch.ones(4, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="u/a torch.bfloat16/torch.float32"):
        gated_layer_norm(a.bfloat16(), a, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"partials torch.bfloat16 \(2, 4, 8\)"):
        gated_split_norm(a, torch.zeros(2, 4, 8, dtype=torch.bfloat16, device=DEVICE), w, w, 1e-6)
