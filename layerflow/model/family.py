"""Layer families: what differs between HSTU layer variants, behind one small interface chosen once per model.

Both families compute, per layer on jagged tokens x [T, E],

    uvqk = LayerNorm(x) @ W_uvqk + b_uvqk        split into u [H*dv], v [H, dv], q [H, dqk], k [H, dqk]
    attn = sum_j SiLU(alpha q.k_j) / N v_j      over the keys the mask allows (no softmax; see model.reference)
    out  = x + Y @ W_out                         (residual of the raw layer input, no output bias)

and differ in the activations and in Y:

- `hstu` (recsys-examples' inference layer): SiLU on u, v, q and k; Y = u * Norm(attn)           [H*dv]
- `stu` (generative-recommenders' STU layer, DLRMv3): SiLU on u only; Y = [u, attn, u * Norm(attn)]   [3*H*dv]

Norm is the config's output norm: LayerNorm over H*dv, or a group norm with one group (and one scalar weight and
bias) per head. Norms run in fp32 (at least) and round to the model's dtype, as both frameworks do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from layerflow.model.config import HSTUConfig
from layerflow.model.layer import LayerWeights


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, computed in fp32 and rounded to x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def group_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H*d]: each head's d values normalised on their own, then scaled and shifted by that head's scalar."""
    heads = weight.shape[0]
    grouped = x.float().reshape(x.shape[0], heads, -1)
    normed = F.layer_norm(grouped, (grouped.shape[-1],), eps=eps)
    return (normed * weight.float()[:, None] + bias.float()[:, None]).reshape(x.shape).to(x.dtype)


class LayerFamily(ABC):
    """The layer math of one family for one model config; build it once (`layer_family`) and call it per layer."""

    name: str
    output_blocks: int   # Y is this many H*dv blocks wide
    activates_qkv: bool  # the SiLU runs on v, q and k too, not on u alone

    def __init__(self, config: HSTUConfig) -> None:
        self.config = config
        self._norm = layer_norm if config.output_norm == "layer" else group_norm

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every LayerWeights field."""
        c = self.config
        e, a = c.embedding_dim, c.num_heads * c.dv
        norm = (a,) if c.output_norm == "layer" else (c.num_heads,)
        return {
            "ln_in_weight": (e,),
            "ln_in_bias": (e,),
            "uvqk_weight": (e, c.uvqk_dim),
            "uvqk_bias": (c.uvqk_dim,),
            "ln_attn_weight": norm,
            "ln_attn_bias": norm,
            "out_weight": (self.output_blocks * a, e),
        }

    def input_projection(self, layer: LayerWeights,
                         x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, E] -> u [T, H*dv] (activated), v [T, H, dv], q [T, H, dqk], k [T, H, dqk]: views of one tensor."""
        return self.project(layer, layer_norm(x, layer.ln_in_weight, layer.ln_in_bias, self.config.layer_norm_eps))

    def project(self, layer: LayerWeights, normed: torch.Tensor,
                activate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`input_projection` from LayerNorm(x) on: one GEMM with the bias in its epilogue, activated in place unless
        `activate` is False (a caller whose next kernel applies the activation as it reads the rows)."""
        c = self.config
        h, dv, dqk = c.num_heads, c.dv, c.dqk
        uvqk = torch.addmm(layer.uvqk_bias, normed, layer.uvqk_weight)
        if activate:
            self._activate_(uvqk)
        u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        return u, v.view(-1, h, dv), q.view(-1, h, dqk), k.view(-1, h, dqk)

    def output(self, layer: LayerWeights, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x + Y @ W_out (the residual in the GEMM's epilogue), with attn [T, H, dv] (or [T, H*dv]) the attention
        output."""
        return torch.addmm(x, self.output_input(layer, u, attn), layer.out_weight)

    def output_input(self, layer: LayerWeights, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Y, the output projection's input, from u and the attention output."""
        flat = attn.reshape(attn.shape[0], -1).to(u.dtype)
        normed = self._norm(flat, layer.ln_attn_weight, layer.ln_attn_bias, self.config.layer_norm_eps)
        return self._output_input(u, flat, u * normed)

    @abstractmethod
    def _activate_(self, uvqk: torch.Tensor) -> None:
        """The activation of the fused projection [T, uvqk_dim], applied in place."""

    @abstractmethod
    def _output_input(self, u: torch.Tensor, attn: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
        """Y from u, the flat attention output and u * Norm(attn)."""


class HSTULayer(LayerFamily):
    name = "hstu"
    output_blocks = 1
    activates_qkv = True

    def _activate_(self, uvqk: torch.Tensor) -> None:
        F.silu(uvqk, inplace=True)

    def _output_input(self, u: torch.Tensor, attn: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
        return gated


class STULayer(LayerFamily):
    name = "stu"
    output_blocks = 3
    activates_qkv = False

    def _activate_(self, uvqk: torch.Tensor) -> None:
        F.silu(uvqk[:, :self.config.num_heads * self.config.dv], inplace=True)

    def _output_input(self, u: torch.Tensor, attn: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
        return torch.cat([u, attn, gated], dim=1)


# Keyed like config.FAMILIES, the names a config accepts.
LAYER_FAMILIES: dict[str, type[LayerFamily]] = {cls.name: cls for cls in (HSTULayer, STULayer)}


def layer_family(config: HSTUConfig) -> LayerFamily:
    """The family object of `config` (its `family` field), bound to the config."""
    return LAYER_FAMILIES[config.family](config)
