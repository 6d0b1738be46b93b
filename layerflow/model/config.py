"""The HSTU model's shape and options, validated once so every later module can trust it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from layerflow.model.mask import MaskRule

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
FAMILIES = ("hstu", "stu")
OUTPUT_NORMS = ("layer", "group")
N_RULES = ("constant", "batch")


@dataclass(frozen=True)
class HSTUConfig:
    """Shape and options of an HSTU model.

    `family`: the layer math (layerflow.model.family): `hstu` (recsys-examples' inference layer) or `stu`
    (generative-recommenders' STU layer, the DLRMv3 model). `output_norm`: the norm of the attention output, `layer`
    (LayerNorm over H*dv) or `group` (per head: one scalar weight and bias each). `attn_alpha`: the q.k scale inside
    the SiLU, None for 1/sqrt(dqk). Mask options: `target_aware` candidates, a `contextual_len` prefix, a window
    `max_attn_len` (0: none); see layerflow.model.mask.

    `attn_n_rule` picks the N of the attention's 1/N: `constant` uses N = max_seq_len, so cached K/V stay valid as
    the history grows; `batch` is GR's rule, N = the batch's longest cached length + its longest delta. Either way
    `max_seq_len` is the longest sequence (history + candidates) a user may have.

    `item_vocab_size` and `position_table_size` size the item-id model's embedding tables; both 0 for a model whose
    caller brings the token embeddings (GR), which has no tables.
    """

    num_layers: int = 8
    num_heads: int = 4
    dqk: int = 256
    dv: int = 256
    embedding_dim: int = 1024
    max_seq_len: int = 16384 + 512
    dtype: torch.dtype = torch.bfloat16
    item_vocab_size: int = 100_000
    position_table_size: int = 16384 + 512
    layer_norm_eps: float = 1e-6
    family: str = "hstu"
    output_norm: str = "layer"
    attn_alpha: float | None = None
    attn_n_rule: str = "constant"
    target_aware: bool = True
    contextual_len: int = 0
    max_attn_len: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype={self.dtype}: expected one of {sorted(DTYPES)}")
        for name in ("num_layers", "num_heads", "dqk", "dv", "embedding_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        for name in ("item_vocab_size", "position_table_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a non-negative integer")
        if (self.item_vocab_size == 0) != (self.position_table_size == 0):
            raise ValueError(f"item_vocab_size={self.item_vocab_size}, position_table_size="
                             f"{self.position_table_size}: both 0 (no embedding tables) or both positive")
        if self.embedding_tables and self.position_table_size < self.max_seq_len:
            raise ValueError(
                f"position_table_size={self.position_table_size} must be >= max_seq_len={self.max_seq_len}"
            )
        if not (isinstance(self.layer_norm_eps, float) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r}: must be a positive float")
        for name, allowed in (("family", FAMILIES), ("output_norm", OUTPUT_NORMS), ("attn_n_rule", N_RULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.attn_alpha is not None and (isinstance(self.attn_alpha, bool)
                                            or not isinstance(self.attn_alpha, (int, float)) or self.attn_alpha <= 0):
            raise ValueError(f"attn_alpha={self.attn_alpha!r}: must be None (1/sqrt(dqk)) or a positive number")
        MaskRule(self.contextual_len, self.max_attn_len, self.target_aware)   # raises on a bad mask option
        if self.contextual_len >= self.max_seq_len:
            raise ValueError(f"contextual_len={self.contextual_len} must be < max_seq_len={self.max_seq_len}")

    @property
    def embedding_tables(self) -> bool:
        """Whether the model owns item and position embedding tables (the item-id path)."""
        return self.item_vocab_size > 0

    @property
    def mask_rule(self) -> MaskRule:
        return MaskRule(self.contextual_len, self.max_attn_len, self.target_aware)

    @property
    def alpha(self) -> float:
        """Scale of q.k inside the SiLU: attn_alpha, else 1/sqrt(dqk)."""
        return float(self.attn_alpha) if self.attn_alpha is not None else 1.0 / math.sqrt(self.dqk)

    @property
    def uvqk_dim(self) -> int:
        """Width of the fused u, v, q, k projection."""
        return self.num_heads * (2 * self.dv + 2 * self.dqk)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["dtype"] = next(k for k, v in DTYPES.items() if v == self.dtype)
        return out


PRESETS: dict[str, HSTUConfig] = {
    # The benchmark model of docs/design.md: 8 layers, 4 heads x 256, embedding 1024, bf16.
    "hstu-bench": HSTUConfig(),
    # A model small enough for the CPU path and CI.
    "tiny": HSTUConfig(num_layers=2, num_heads=2, dqk=32, dv=32, embedding_dim=64, max_seq_len=2048,
                       dtype=torch.float32, item_vocab_size=10_000, position_table_size=2048),
    # MLPerf DLRMv3's sequence encoder (GR's STU stack): the caller brings token embeddings; up to 16K history
    # tokens and 2048 candidates per user.
    "dlrmv3": HSTUConfig(num_layers=5, num_heads=4, dqk=128, dv=128, embedding_dim=512, max_seq_len=16384 + 2048,
                         dtype=torch.bfloat16, item_vocab_size=0, position_table_size=0, family="stu"),
}
