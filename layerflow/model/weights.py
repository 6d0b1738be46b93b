"""HSTU weights: deterministic init from a seed, safetensors save/load with fixed names and the config inside.

Tensor names in a file (l = layer index; shapes per family in layerflow.model.family):
  item_embedding            [item_vocab_size, E]        only in item-id models (config.embedding_tables)
  position_embedding        [position_table_size, E]    only in item-id models
  layers.l.ln_in.weight     [E]          layers.l.ln_in.bias     [E]
  layers.l.uvqk.weight      [E, H*(2dv+2dqk)]  (columns: u, v, q, k)
  layers.l.uvqk.bias        [H*(2dv+2dqk)]
  layers.l.ln_attn.weight   [H*dv] or [H]      layers.l.ln_attn.bias   (same)
  layers.l.out.weight       [H*dv, E] (hstu) or [3*H*dv, E] (stu)
The file's metadata key `hstu_config` holds the config as JSON, so a file loads without being told its shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layerflow.model.config import HSTUConfig
from layerflow.model.family import LayerFamily, layer_family
from layerflow.model.layer import LayerWeights

CONFIG_KEY = "hstu_config"

__all__ = ["CONFIG_KEY", "HSTUWeights", "LayerWeights", "read_config"]


def _file_name(field_name: str) -> str:
    """`ln_in_weight` -> `ln_in.weight`: the documented safetensors name."""
    stem, _, leaf = field_name.rpartition("_")
    return f"{stem}.{leaf}"


def read_config(path: str | Path) -> HSTUConfig | None:
    """The config stored in a weights file's metadata, or None for a file without one."""
    with safe_open(str(path), framework="pt") as f:
        text = (f.metadata() or {}).get(CONFIG_KEY)
    return None if text is None else HSTUConfig(**json.loads(text))


def expected_shapes(config: HSTUConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a file of this config, with its shape."""
    expected = {}
    if config.embedding_tables:
        expected["item_embedding"] = (config.item_vocab_size, config.embedding_dim)
        expected["position_embedding"] = (config.position_table_size, config.embedding_dim)
    shapes = layer_family(config).layer_shapes()
    for i in range(config.num_layers):
        for name, shape in shapes.items():
            expected[f"layers.{i}.{_file_name(name)}"] = shape
    return expected


@dataclass
class HSTUWeights:
    """A model's tensors. The embedding tables are None for a model whose caller brings token embeddings.

    `family` is the config's layer family, resolved once here.
    """

    config: HSTUConfig
    item_embedding: torch.Tensor | None
    position_embedding: torch.Tensor | None
    layers: list[LayerWeights]
    family: LayerFamily = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("item_embedding", "position_embedding"):
            if (getattr(self, name) is None) == self.config.embedding_tables:
                raise ValueError(f"{name} {'missing' if self.config.embedding_tables else 'given'}: the config "
                                 f"{'has' if self.config.embedding_tables else 'has no'} embedding tables")
        if len(self.layers) != self.config.num_layers:
            raise ValueError(f"{len(self.layers)} layers given, config has num_layers={self.config.num_layers}")
        self.family = layer_family(self.config)

    @property
    def device(self) -> torch.device:
        return self.layers[0].uvqk_weight.device

    @classmethod
    def init(cls, config: HSTUConfig, seed: int = 0) -> "HSTUWeights":
        """Deterministic weights: the same (config, seed) gives the same bits on every machine."""
        gen = torch.Generator().manual_seed(seed)

        def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) * std).to(config.dtype)

        e = config.embedding_dim
        shapes = layer_family(config).layer_shapes()
        layers = []
        for _ in range(config.num_layers):
            layers.append(LayerWeights(
                ln_in_weight=(1.0 + normal(shapes["ln_in_weight"], 0.1).float()).to(config.dtype),
                ln_in_bias=normal(shapes["ln_in_bias"], 0.1),
                uvqk_weight=normal(shapes["uvqk_weight"], e ** -0.5),
                uvqk_bias=normal(shapes["uvqk_bias"], 0.1),
                ln_attn_weight=(1.0 + normal(shapes["ln_attn_weight"], 0.1).float()).to(config.dtype),
                ln_attn_bias=normal(shapes["ln_attn_bias"], 0.1),
                out_weight=normal(shapes["out_weight"], shapes["out_weight"][0] ** -0.5),
            ))
        tables = config.embedding_tables
        return cls(
            config=config,
            item_embedding=normal((config.item_vocab_size, e), 1.0) if tables else None,
            position_embedding=normal((config.position_table_size, e), 0.1) if tables else None,
            layers=layers,
        )

    def to(self, device: torch.device | str) -> "HSTUWeights":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return HSTUWeights(self.config, move(self.item_embedding), move(self.position_embedding),
                           [lw.to(device) for lw in self.layers])

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.config.embedding_tables:
            out = {"item_embedding": self.item_embedding, "position_embedding": self.position_embedding}
        for i, lw in enumerate(self.layers):
            for f in fields(LayerWeights):
                out[f"layers.{i}.{_file_name(f.name)}"] = getattr(lw, f.name)
        return out

    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={CONFIG_KEY: json.dumps(self.config.to_dict())})

    @classmethod
    def load(cls, path: str | Path, config: HSTUConfig | None = None) -> "HSTUWeights":
        """Load a file written by `save`, shaped by the config in its metadata.

        A `config` given must equal the file's (when the file has one) and is what a file without metadata is read
        with; every tensor must match it in name, shape and dtype.
        """
        stored = read_config(path)
        if config is None and stored is None:
            raise ValueError(f"{path}: no {CONFIG_KEY!r} metadata; pass the model config")
        if config is not None and stored is not None and config != stored:
            given, found = config.to_dict(), stored.to_dict()
            diff = {k: (given[k], found[k]) for k in given if given[k] != found[k]}
            raise ValueError(f"{path}: config differs from the file's, (given, file): {diff}")
        config = config or stored
        tensors = load_file(str(path))
        expected = expected_shapes(config)
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
        return cls(config, tensors.get("item_embedding"), tensors.get("position_embedding"), layers)
