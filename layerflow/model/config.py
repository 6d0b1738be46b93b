"""The HSTU model's shape, validated once so every later module can trust it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class HSTUConfig:
    """Shape of an HSTU model.

    `max_seq_len` is the constant N of the 1/N attention scaling and the longest
    sequence (history + candidates) a user may have; because it is a constant,
    cached K/V stay valid as the history grows.
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

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype={self.dtype}: expected one of {sorted(DTYPES)}")
        for name in ("num_layers", "num_heads", "dqk", "dv", "embedding_dim", "max_seq_len",
                     "item_vocab_size", "position_table_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if self.position_table_size < self.max_seq_len:
            raise ValueError(
                f"position_table_size={self.position_table_size} must be >= max_seq_len={self.max_seq_len}"
            )
        if not (isinstance(self.layer_norm_eps, float) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r}: must be a positive float")

    @property
    def alpha(self) -> float:
        """Scale of q.k inside the SiLU: 1/sqrt(dqk)."""
        return 1.0 / math.sqrt(self.dqk)

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
}
