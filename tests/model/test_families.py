"""The layer families and the model options: the registry, each family's output written out independently, the
config's validation, the presets, and models without embedding tables."""

import pytest
import torch
import torch.nn.functional as F

from layerflow.model import PRESETS, HSTUConfig, HSTUWeights, batch_n, layer_family
from layerflow.model.config import FAMILIES
from layerflow.model.embedding import embed
from layerflow.model.family import LAYER_FAMILIES

BASE = dict(num_layers=1, num_heads=2, dqk=8, dv=4, embedding_dim=16, max_seq_len=64, dtype=torch.float64,
            item_vocab_size=0, position_table_size=0)


def test_registry_covers_the_config_families():
    assert tuple(LAYER_FAMILIES) == FAMILIES
    for name in FAMILIES:
        assert layer_family(HSTUConfig(**{**BASE, "family": name})).name == name


@pytest.mark.parametrize("family,norm", [("hstu", "layer"), ("stu", "layer"), ("stu", "group"), ("hstu", "group")])
def test_family_math_written_out(family, norm):
    """dqk != dv on purpose: the projection splits u, v (dv wide) before q, k (dqk wide)."""
    config = HSTUConfig(**{**BASE, "family": family, "output_norm": norm})
    weights = HSTUWeights.init(config, seed=1)
    layer, fam = weights.layers[0], weights.family
    x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    raw = F.layer_norm(x.float(), (16,), layer.ln_in_weight.float(), layer.ln_in_bias.float(), 1e-6).double() \
        @ layer.uvqk_weight + layer.uvqk_bias
    u_raw, v_raw, q_raw, k_raw = raw[:, :8], raw[:, 8:16], raw[:, 16:32], raw[:, 32:48]
    u, v, q, k = fam.input_projection(layer, x)
    act = F.silu if family == "hstu" else (lambda t: t)
    torch.testing.assert_close(u, F.silu(u_raw))
    torch.testing.assert_close(v.reshape(5, -1), act(v_raw))
    torch.testing.assert_close(q.reshape(5, -1), act(q_raw))
    torch.testing.assert_close(k.reshape(5, -1), act(k_raw))
    attn = torch.randn(5, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    flat = attn.reshape(5, 8)
    if norm == "layer":
        normed = F.layer_norm(flat.float(), (8,), layer.ln_attn_weight.float(), layer.ln_attn_bias.float(), 1e-6)
    else:
        normed = F.group_norm(flat.float(), 2, layer.ln_attn_weight.float().repeat_interleave(4),
                              layer.ln_attn_bias.float().repeat_interleave(4), 1e-6)
    gated = u * normed.double()
    y = gated if family == "hstu" else torch.cat([u, flat, gated], dim=1)
    # The norms run in float32 (as in GR and recsys-examples); group_norm sums in another order.
    torch.testing.assert_close(fam.output(layer, x, u, attn), x + y @ layer.out_weight, rtol=1e-5, atol=1e-6)


def test_layer_shapes_per_family_and_norm():
    stu = layer_family(HSTUConfig(**{**BASE, "family": "stu", "output_norm": "group"})).layer_shapes()
    assert stu["out_weight"] == (3 * 2 * 4, 16) and stu["ln_attn_weight"] == (2,) and stu["uvqk_weight"] == (16, 48)
    hstu = layer_family(HSTUConfig(**BASE)).layer_shapes()
    assert hstu["out_weight"] == (8, 16) and hstu["ln_attn_weight"] == (8,)


@pytest.mark.parametrize("field,value,match", [
    ("family", "gpt", "family='gpt'"),
    ("output_norm", "rms", "output_norm='rms'"),
    ("attn_n_rule", "max", "attn_n_rule='max'"),
    ("attn_alpha", 0.0, "attn_alpha=0.0"),
    ("attn_alpha", True, "attn_alpha=True"),
    ("contextual_len", -1, "contextual_len=-1"),
    ("contextual_len", 64, "contextual_len=64 must be < max_seq_len"),
    ("max_attn_len", 2.0, "max_attn_len=2.0"),
    ("target_aware", "yes", "target_aware='yes'"),
    ("item_vocab_size", 10, "both 0"),
])
def test_config_rejects_bad_options(field, value, match):
    with pytest.raises(ValueError, match=match):
        HSTUConfig(**{**BASE, field: value})


def test_alpha_and_n_rules():
    assert HSTUConfig(**BASE).alpha == pytest.approx(8 ** -0.5, rel=1e-15)
    assert HSTUConfig(**{**BASE, "attn_alpha": 0.25}).alpha == 0.25
    constant, batch = HSTUConfig(**BASE), HSTUConfig(**{**BASE, "attn_n_rule": "batch"})
    assert batch_n(constant, [5, 40], [6, 2]) == 64
    assert batch_n(batch, [5, 40], [6, 2]) == 46 and batch_n(batch, [], [40, 7]) == 40


def test_dlrmv3_preset():
    c = PRESETS["dlrmv3"]
    assert (c.family, c.num_layers, c.num_heads, c.dqk, c.dv, c.embedding_dim) == ("stu", 5, 4, 128, 128, 512)
    assert c.target_aware and c.output_norm == "layer" and not c.embedding_tables
    assert c.max_seq_len >= 16384 + 2048
    assert {"hstu-bench", "tiny", "dlrmv3"} <= set(PRESETS)


def test_model_without_tables_saves_and_loads_with_its_config(tmp_path):
    config = HSTUConfig(**{**BASE, "family": "stu", "output_norm": "group", "contextual_len": 2, "max_attn_len": 9})
    weights = HSTUWeights.init(config, seed=4)
    assert weights.item_embedding is None and "item_embedding" not in weights.state_dict()
    weights.save(tmp_path / "m.safetensors")
    loaded = HSTUWeights.load(tmp_path / "m.safetensors")
    assert loaded.config == config and loaded.family.name == "stu"
    assert all(torch.equal(a, b) for a, b in zip(weights.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(ValueError, match="no embedding tables"):
        embed(loaded, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="item_embedding given"):
        HSTUWeights(config, torch.zeros(1, 16), torch.zeros(1, 16), weights.layers)
