"""The layer's normalisations as one pass each: LayerNorm of the input, and the output gate u * Norm(a).

Norm is a LayerNorm over the row or a group norm with one group (and one scalar weight and bias) per head; both in
fp32, rounded to a's dtype like the model (layerflow.model.family). The gate can also write the stu family's whole
output-projection input [u, a, u * Norm(a)], so neither a concatenation nor a separate multiply reads the rows again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NORM, _GATED, _CONCAT = 0, 1, 2   # what the kernel writes: Norm(a), u * Norm(a), [u, a, u * Norm(a)]


@triton.jit
def _norm_kernel(a_ptr, w_ptr, b_ptr, u_ptr, out_ptr, u_stride, out_stride, split_stride, eps, active_splits_ptr,
                 GROUPS: tl.constexpr,
                 G: tl.constexpr, GROUPS_P2: tl.constexpr, G_P2: tl.constexpr, PER_GROUP: tl.constexpr,
                 WRITE: tl.constexpr, SPLITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_P2)[:, None]
    d = tl.arange(0, G_P2)[None, :]
    ok = (g < GROUPS) & (d < G)
    e = g * G + d
    if SPLITS == 0:
        raw = tl.load(a_ptr + token * (GROUPS * G) + e, mask=ok, other=0.0)
    else:
        # The attention's fp32 split partials, added in split order (unrolled: every load is in flight at once);
        # where the launch wrote fewer (active_splits_ptr), the others load as +0.0, which leaves the sum's bits.
        total = tl.zeros([GROUPS_P2, G_P2], dtype=tl.float32)
        if active_splits_ptr is None:
            for split in tl.static_range(SPLITS):
                total += tl.load(a_ptr + split * split_stride + token * (GROUPS * G) + e, mask=ok, other=0.0)
        else:
            active = tl.load(active_splits_ptr)
            for split in tl.static_range(SPLITS):
                live = tl.full([GROUPS_P2, G_P2], split, tl.int32) < active
                total += tl.load(a_ptr + split * split_stride + token * (GROUPS * G) + e, mask=ok & live, other=0.0)
        raw = total.to(out_ptr.dtype.element_ty)
    a = raw.to(tl.float32)
    mean = tl.sum(a, axis=1) / G
    centered = tl.where(ok, a - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / G + eps)
    if PER_GROUP:
        affine = g + d * 0
    else:
        affine = e
    w = tl.load(w_ptr + affine, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + affine, mask=ok, other=0.0).to(tl.float32)
    normed = (centered * rstd[:, None] * w + b).to(out_ptr.dtype.element_ty)
    row = out_ptr + token * out_stride
    if WRITE == 0:
        tl.store(row + e, normed, mask=ok)
    else:
        u = tl.load(u_ptr + token * u_stride + e, mask=ok, other=0.0)
        gated = (u.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if WRITE == 1:
            tl.store(row + e, gated, mask=ok)
        else:
            tl.store(row + e, u, mask=ok)
            tl.store(row + GROUPS * G + e, raw, mask=ok)
            tl.store(row + 2 * GROUPS * G + e, gated, mask=ok)


def _launch(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, groups: int,
            u: torch.Tensor | None, write: int, out: torch.Tensor | None, splits: int = 0,
            active_splits: torch.Tensor | None = None) -> torch.Tensor:
    tokens, width = a.shape[-2:]
    dtype = a.dtype if u is None else u.dtype
    if groups < 1 or width % groups:
        raise ValueError(f"groups={groups}: must be >= 1 and divide the row width {width}")
    affine = (width,) if groups == 1 else (groups,)
    if weight.shape != affine or bias.shape != affine:
        raise ValueError(f"weight/bias shapes {tuple(weight.shape)}/{tuple(bias.shape)}: expected {list(affine)}")
    blocks = 3 if write == _CONCAT else 1
    if out is None:
        out = torch.empty(tokens, blocks * width, dtype=dtype, device=a.device)
    elif out.shape != (tokens, blocks * width) or out.stride(1) != 1 or out.dtype != dtype:
        raise ValueError(f"out {out.dtype} shape {tuple(out.shape)}: expected {dtype} [{tokens}, {blocks * width}] "
                         f"rows with unit column stride")
    if tokens:
        g = width // groups
        _norm_kernel[(tokens,)](a, weight, bias, a if u is None else u, out, 0 if u is None else u.stride(0),
                                out.stride(0), a.stride(0) if splits else 0, eps, active_splits, GROUPS=groups, G=g,
                                GROUPS_P2=triton.next_power_of_2(groups), G_P2=triton.next_power_of_2(g),
                                PER_GROUP=groups > 1, WRITE=write, SPLITS=splits, num_warps=4)
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim of a contiguous [T, E] x, in fp32, rounded to x's dtype: one kernel instead of the
    dtype casts around torch's."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x shape {tuple(x.shape)} strides {x.stride()}: expected a contiguous [T, E]")
    return _launch(x, weight, bias, eps, 1, None, _NORM, out)


def gated_layer_norm(u: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None, *, groups: int = 1, concat: bool = False) -> torch.Tensor:
    """u * Norm(a) over [T, E] tensors; with `concat`, the [T, 3E] rows [u, a, u * Norm(a)].

    Norm: LayerNorm (groups=1, weight and bias [E]) or a norm of each of `groups` equal column groups, scaled and
    shifted by that group's scalar (weight and bias [groups]). `u` may be a column slice of a wider tensor (the u part
    of the fused uvqk projection): rows of any stride.
    """
    if u.shape != a.shape or u.dim() != 2 or u.stride(1) != 1 or not a.is_contiguous() or u.dtype != a.dtype:
        raise ValueError(f"u/a {u.dtype}/{a.dtype} shapes {tuple(u.shape)}/{tuple(a.shape)}: expected one dtype, "
                         f"[T, E], a contiguous, u rows with unit column stride")
    return _launch(a, weight, bias, eps, groups, u, _CONCAT if concat else _GATED, out)


def gated_split_norm(u: torch.Tensor, partials: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None, *, groups: int = 1, concat: bool = False,
                     active_splits: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_layer_norm` of a = the sum of the attention's fp32 split partials [S, T, E], added in split order and
    rounded to u's dtype as the attention's own reduction would round them: the partials are read once, by the gate,
    instead of by a reduction kernel whose output the gate reads again. `active_splits`: a device int32 [1] holding
    how many of the S partials the launch wrote (the "rows" split rule, layerflow.kernels.splits); None: all S."""
    if partials.dim() != 3 or partials.shape[1:] != u.shape or partials.dtype != torch.float32 or \
            not partials.is_contiguous() or u.stride(1) != 1:
        raise ValueError(f"u {u.dtype} {tuple(u.shape)}, partials {partials.dtype} {tuple(partials.shape)}: expected "
                         f"contiguous float32 [S, T, E] partials of u's [T, E] rows (unit column stride)")
    if active_splits is not None and (active_splits.dtype != torch.int32 or active_splits.shape != (1,)):
        raise ValueError(f"active_splits {active_splits.dtype} shape {tuple(active_splits.shape)}: expected int32 [1]")
    return _launch(partials, weight, bias, eps, groups, u, _CONCAT if concat else _GATED, out, partials.shape[0],
                   active_splits)


def gated_layer_norm_reference(u: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               eps: float) -> torch.Tensor:
    """The model's math: LayerNorm in fp32, rounded to a's dtype, times u."""
    normed = torch.nn.functional.layer_norm(a.float(), (a.shape[-1],), weight.float(), bias.float(), eps)
    return u * normed.to(a.dtype)
