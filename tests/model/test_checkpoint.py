"""Checkpoint import: a recsys-examples state dict built from a layerflow `hstu` model (their names, their Linear
layout) imported through the CLI gives the same outputs; bad state dicts are refused naming the tensor."""

import pytest
import torch

from layerflow.cli import main as cli_main
from layerflow.model import HSTUConfig, HSTUWeights, cached_step, prefill
from layerflow.model.checkpoint import ModelOptions, import_state_dict

PREFIX = "_hstu_block._attention_layers."
CONFIG = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=128,
                    dtype=torch.float32, item_vocab_size=0, position_table_size=0, family="hstu",
                    contextual_len=2, max_attn_len=10)
OPTIONS = ModelOptions(num_heads=2, max_seq_len=128, contextual_len=2, max_attn_len=10)


def recsys_state_dict(weights: HSTUWeights, input_norm: bool = True) -> dict[str, torch.Tensor]:
    """What recsys-examples' layers would hold: Linear weights as [out, in], their other names, a wrapping module's
    tensors beside the stack."""
    state = {"_embedding_collection.weight": torch.randn(10, 32)}
    for i, lw in enumerate(weights.layers):
        p = f"{PREFIX}{i}."
        state[p + "_linear_uvqk.weight"] = lw.uvqk_weight.t().clone()
        state[p + "_linear_uvqk.bias"] = lw.uvqk_bias.clone()
        state[p + "_linear_proj.weight"] = lw.out_weight.t().clone()
        state[p + "_output_layernorm_weight"] = lw.ln_attn_weight.clone()
        state[p + "_output_layernorm_bias"] = lw.ln_attn_bias.clone()
        if input_norm:
            state[p + "_input_layernorm_weight"] = lw.ln_in_weight.clone()
            state[p + "_input_layernorm_bias"] = lw.ln_in_bias.clone()
    return state


def outputs(weights: HSTUWeights) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    history = torch.randn(12 + 30, 32, generator=gen)
    first = prefill(weights, history, [12, 30])
    delta = torch.randn(5 + 3, 32, generator=gen)
    step = cached_step(weights, first.history_k, first.history_v, [12, 30], delta, [2, 0], [3, 3])
    return first.outputs, step.outputs


@pytest.mark.parametrize("input_norm", [True, False])
def test_recsys_examples_import_reproduces_the_model(tmp_path, input_norm):
    weights = HSTUWeights.init(CONFIG, seed=3)
    if not input_norm:   # their layer without a learnable input norm normalises with weight 1 and bias 0
        for lw in weights.layers:
            lw.ln_in_weight.fill_(1.0)
            lw.ln_in_bias.zero_()
    src, out = tmp_path / "recsys.pt", tmp_path / "model.safetensors"
    torch.save(recsys_state_dict(weights, input_norm), src)
    cli_main(["import-checkpoint", "--format", "recsys-examples", str(src), "--out", str(out), "--num-heads", "2",
              "--max-seq-len", "128", "--contextual-len", "2", "--max-attn-len", "10"])
    loaded = HSTUWeights.load(out, CONFIG)
    assert loaded.config == CONFIG
    for got, want in zip(outputs(loaded), outputs(weights)):
        assert torch.equal(got, want)


def test_dtype_is_converted_only_when_asked():
    state = recsys_state_dict(HSTUWeights.init(CONFIG, seed=3))
    assert import_state_dict("recsys-examples", state, OPTIONS).config.dtype == torch.float32
    converted = import_state_dict("recsys-examples", state, OPTIONS, dtype=torch.bfloat16)
    assert converted.config.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in converted.state_dict().values())
    state[PREFIX + "1._linear_uvqk.bias"] = state[PREFIX + "1._linear_uvqk.bias"].half()
    with pytest.raises(ValueError, match=rf"several dtypes: torch.float32 .*torch.float16 \(e.g. {PREFIX}1"):
        import_state_dict("recsys-examples", state, OPTIONS)


def broken(change: str) -> dict[str, torch.Tensor]:
    state = recsys_state_dict(HSTUWeights.init(CONFIG, seed=3))
    key = PREFIX + "1._linear_proj.weight"
    if change == "missing":
        del state[key]
    elif change == "extra":
        state[PREFIX + "1._linear_proj.bias"] = torch.zeros(32)
    elif change == "shape":
        state[key] = state[key][:, :-1].clone()
    elif change == "half-norm":
        del state[PREFIX + "0._input_layernorm_bias"]
    elif change == "second-stack":
        state.update({"_other." + k: v for k, v in state.items() if k.startswith(PREFIX)})
    elif change == "stray":
        state[PREFIX + "scale"] = torch.ones(1)
    return state


@pytest.mark.parametrize("change,match", [
    ("missing", rf"missing tensor {PREFIX}1._linear_proj.weight"),
    ("extra", rf"unexpected tensor {PREFIX}1._linear_proj.bias"),
    ("shape", rf"{PREFIX}1._linear_proj.weight has shape \(32, 31\), expected \(32, 32\)"),
    ("half-norm", rf"missing tensor {PREFIX}0._input_layernorm_bias \(its pair is present\)"),
    ("second-stack", r"several layer stacks"),
    ("stray", rf"unexpected tensor {PREFIX}scale"),
])
def test_bad_state_dicts_are_refused_naming_the_tensor(change, match):
    with pytest.raises(ValueError, match=match):
        import_state_dict("recsys-examples", broken(change), OPTIONS)


def test_given_options_are_checked_against_the_shapes():
    state = recsys_state_dict(HSTUWeights.init(CONFIG, seed=3))
    with pytest.raises(ValueError, match="output_norm='group' but the output norm has 32 weights"):
        import_state_dict("recsys-examples", state, ModelOptions(num_heads=2, max_seq_len=128, output_norm="group"))
    with pytest.raises(ValueError, match="output projection rows 32 are not 1 x num_heads=3"):
        import_state_dict("recsys-examples", state, ModelOptions(num_heads=3, max_seq_len=128))
    with pytest.raises(ValueError, match="num_heads=0"):
        import_state_dict("recsys-examples", state, ModelOptions(num_heads=0, max_seq_len=128))
    with pytest.raises(ValueError, match="format='keras'"):
        import_state_dict("keras", state, OPTIONS)
    with pytest.raises(ValueError, match="no tensor named '<prefix><layer>._uvqk_weight'"):
        import_state_dict("gr-stu", state, OPTIONS)
    with pytest.raises(ValueError, match="no tensor under the prefix 'encoder.'"):
        import_state_dict("recsys-examples", state, OPTIONS, prefix="encoder.")
