"""One layer's tensors: the same seven for every family (the family decides their shapes and their math)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LayerWeights:
    ln_in_weight: torch.Tensor     # [E]
    ln_in_bias: torch.Tensor       # [E]
    uvqk_weight: torch.Tensor      # [E, H*(2dv+2dqk)], columns u, v, q, k
    uvqk_bias: torch.Tensor        # [H*(2dv+2dqk)]
    ln_attn_weight: torch.Tensor   # output norm: [H*dv] (layer norm) or [H] (group norm)
    ln_attn_bias: torch.Tensor
    out_weight: torch.Tensor       # [rows, E]: rows = H*dv (hstu) or 3*H*dv (stu)

    def to(self, device: torch.device | str) -> "LayerWeights":
        return LayerWeights(**{f.name: getattr(self, f.name).to(device) for f in fields(LayerWeights)})
