"""Fused `u * LayerNorm(a)`: the HSTU output gate, one read of u and a and one write instead of three kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_layer_norm_kernel(u_ptr, a_ptr, w_ptr, b_ptr, out_ptr, u_stride, eps, E: tl.constexpr,
                             E_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = token * E
    e = tl.arange(0, E_P2)
    ok = e < E
    a = tl.load(a_ptr + row + e, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(a, axis=0) / E
    centered = tl.where(ok, a - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / E + eps)
    w = tl.load(w_ptr + e, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + e, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + token * u_stride + e, mask=ok, other=0.0).to(tl.float32)
    normed = (centered * rstd * w + b).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row + e, (u * normed).to(out_ptr.dtype.element_ty), mask=ok)


def gated_layer_norm(u: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """u * LayerNorm(a) over the last dim of [T, E] tensors; LayerNorm in fp32, rounded to a's dtype like the model.

    `u` may be a column slice of a wider tensor (the u part of the fused uvqk projection): rows of any stride.
    """
    if u.shape != a.shape or u.dim() != 2 or u.stride(1) != 1 or not a.is_contiguous():
        raise ValueError(f"u/a shapes {tuple(u.shape)}/{tuple(a.shape)}: expected [T, E], a contiguous, u rows "
                         f"with unit column stride")
    if weight.shape != (a.shape[1],) or bias.shape != (a.shape[1],):
        raise ValueError(f"weight/bias shapes {tuple(weight.shape)}/{tuple(bias.shape)}: expected [{a.shape[1]}]")
    out = torch.empty_like(a) if out is None else out
    if a.shape[0]:
        _gated_layer_norm_kernel[(a.shape[0],)](u, a, weight, bias, out, u.stride(0), eps, E=a.shape[1],
                                                E_P2=triton.next_power_of_2(a.shape[1]), num_warps=4)
    return out


def gated_layer_norm_reference(u: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               eps: float) -> torch.Tensor:
    """The model's math: LayerNorm in fp32, rounded to a's dtype, times u."""
    normed = torch.nn.functional.layer_norm(a.float(), (a.shape[-1],), weight.float(), bias.float(), eps)
    return u * normed.to(a.dtype)
