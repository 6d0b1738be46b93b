"""HSTU weights: deterministic init from a seed, safetensors save/load with fixed names.

Tensor names in a file (l = layer index):
  item_embedding            [item_vocab_size, E]
  position_embedding        [position_table_size, E]
  layers.l.ln_in.weight     [E]          layers.l.ln_in.bias     [E]
  layers.l.uvqk.weight      [E, H*(2dv+2dqk)]  (columns: u, v, q, k)
  layers.l.uvqk.bias        [H*(2dv+2dqk)]
  layers.l.ln_attn.weight   [H*dv]       layers.l.ln_attn.bias   [H*dv]
  layers.l.out.weight       [H*dv, E]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from layerflow.model.config import HSTUConfig


@dataclass
class LayerWeights:
    ln_in_weight: torch.Tensor
    ln_in_bias: torch.Tensor
    uvqk_weight: torch.Tensor
    uvqk_bias: torch.Tensor
    ln_attn_weight: torch.Tensor
    ln_attn_bias: torch.Tensor
    out_weight: torch.Tensor

    @staticmethod
    def shapes(config: HSTUConfig) -> dict[str, tuple[int, ...]]:
        e, a = config.embedding_dim, config.num_heads * config.dv
        return {
            "ln_in_weight": (e,),
            "ln_in_bias": (e,),
            "uvqk_weight": (e, config.uvqk_dim),
            "uvqk_bias": (config.uvqk_dim,),
            "ln_attn_weight": (a,),
            "ln_attn_bias": (a,),
            "out_weight": (a, e),
        }


def _file_name(field_name: str) -> str:
    """`ln_in_weight` -> `ln_in.weight`: the documented safetensors name."""
    stem, _, leaf = field_name.rpartition("_")
    return f"{stem}.{leaf}"


@dataclass
class HSTUWeights:
    config: HSTUConfig
    item_embedding: torch.Tensor
    position_embedding: torch.Tensor
    layers: list[LayerWeights]

    @classmethod
    def init(cls, config: HSTUConfig, seed: int = 0) -> "HSTUWeights":
        """Deterministic weights: the same (config, seed) gives the same bits on every machine."""
        gen = torch.Generator().manual_seed(seed)

        def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) * std).to(config.dtype)

        e = config.embedding_dim
        layers = []
        for _ in range(config.num_layers):
            shapes = LayerWeights.shapes(config)
            layers.append(LayerWeights(
                ln_in_weight=(1.0 + normal(shapes["ln_in_weight"], 0.1).float()).to(config.dtype),
                ln_in_bias=normal(shapes["ln_in_bias"], 0.1),
                uvqk_weight=normal(shapes["uvqk_weight"], e ** -0.5),
                uvqk_bias=normal(shapes["uvqk_bias"], 0.1),
                ln_attn_weight=(1.0 + normal(shapes["ln_attn_weight"], 0.1).float()).to(config.dtype),
                ln_attn_bias=normal(shapes["ln_attn_bias"], 0.1),
                out_weight=normal(shapes["out_weight"], (config.num_heads * config.dv) ** -0.5),
            ))
        return cls(
            config=config,
            item_embedding=normal((config.item_vocab_size, e), 1.0),
            position_embedding=normal((config.position_table_size, e), 0.1),
            layers=layers,
        )

    def to(self, device: torch.device | str) -> "HSTUWeights":
        return HSTUWeights(
            config=self.config,
            item_embedding=self.item_embedding.to(device),
            position_embedding=self.position_embedding.to(device),
            layers=[LayerWeights(**{f.name: getattr(lw, f.name).to(device) for f in fields(LayerWeights)})
                    for lw in self.layers],
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"item_embedding": self.item_embedding, "position_embedding": self.position_embedding}
        for i, lw in enumerate(self.layers):
            for f in fields(LayerWeights):
                out[f"layers.{i}.{_file_name(f.name)}"] = getattr(lw, f.name)
        return out

    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"hstu_config": json.dumps(self.config.to_dict())})

    @classmethod
    def load(cls, path: str | Path, config: HSTUConfig) -> "HSTUWeights":
        """Load a file written by `save`; every tensor must match `config` in name, shape and dtype."""
        tensors = load_file(str(path))
        expected = {"item_embedding": (config.item_vocab_size, config.embedding_dim),
                    "position_embedding": (config.position_table_size, config.embedding_dim)}
        for i in range(config.num_layers):
            for name, shape in LayerWeights.shapes(config).items():
                expected[f"layers.{i}.{_file_name(name)}"] = shape
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(f"{path}: tensors missing {missing[:5]} / unexpected {extra[:5]} for this config")
        for name, shape in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != config.dtype:
                raise ValueError(
                    f"{path}: {name} has shape {tuple(t.shape)} dtype {t.dtype}, config expects {shape} {config.dtype}"
                )
        layers = [LayerWeights(**{f.name: tensors[f"layers.{i}.{_file_name(f.name)}"] for f in fields(LayerWeights)})
                  for i in range(config.num_layers)]
        return cls(config, tensors["item_embedding"], tensors["position_embedding"], layers)
