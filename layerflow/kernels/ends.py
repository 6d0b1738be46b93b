"""The model's two ends as one kernel each: the token rows in (item + position embedding) and the candidate scores
out (the dot of a candidate's final row with its item embedding).

In torch each end is a chain of gathers, casts and elementwise kernels (3 going in, 7 coming out, per request);
here each is one launch over the bucket's rows, graph capturable. The embedding sum rounds once from fp32, as
torch's add does, so the rows are the same bits; the score is an fp32 dot whose summation order is the kernel's
(it matches torch within fp32 rounding, not bit for bit). Ids are validated on the host before they get here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embed_kernel(item_ptr, position_ptr, ids_ptr, positions_ptr, out_ptr, E: tl.constexpr, E_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    ok = e < E
    item = tl.load(ids_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    a = tl.load(item_ptr + item * E + e, mask=ok).to(tl.float32)
    b = tl.load(position_ptr + position * E + e, mask=ok).to(tl.float32)
    tl.store(out_ptr + token * E + e, (a + b).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _scores_kernel(x_ptr, item_ptr, rows_ptr, ids_ptr, out_ptr, x_stride, E: tl.constexpr, E_P2: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    ok = e < E
    row = tl.load(rows_ptr + c).to(tl.int64)
    item = tl.load(ids_ptr + c).to(tl.int64)
    x = tl.load(x_ptr + row * x_stride + e, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(item_ptr + item * E + e, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + c, tl.sum(x * w, axis=0))


def _check_table(name: str, table: torch.Tensor, width: int) -> None:
    if table.dim() != 2 or table.shape[1] != width or not table.is_contiguous():
        raise ValueError(f"{name} shape {tuple(table.shape)}: expected a contiguous [rows, {width}] table")


def embed_rows(item_table: torch.Tensor, position_table: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = item_table[ids[t]] + position_table[positions[t]], summed in fp32 and rounded to the tables' dtype."""
    width = item_table.shape[-1]
    _check_table("item_table", item_table, width)
    _check_table("position_table", position_table, width)
    if ids.shape != positions.shape or ids.dim() != 1 or item_table.dtype != position_table.dtype:
        raise ValueError(f"ids/positions shapes {tuple(ids.shape)}/{tuple(positions.shape)}, tables "
                         f"{item_table.dtype}/{position_table.dtype}: expected one [T] shape and one dtype")
    if out is None:
        out = torch.empty(ids.shape[0], width, dtype=item_table.dtype, device=item_table.device)
    elif out.shape != (ids.shape[0], width) or not out.is_contiguous() or out.dtype != item_table.dtype:
        raise ValueError(f"out {out.dtype} shape {tuple(out.shape)}: expected contiguous {item_table.dtype} "
                         f"[{ids.shape[0]}, {width}]")
    if ids.shape[0]:
        _embed_kernel[(ids.shape[0],)](item_table, position_table, ids, positions, out, E=width,
                                       E_P2=triton.next_power_of_2(width), num_warps=4)
    return out


def candidate_dot(x: torch.Tensor, item_table: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """out[c] = <x[rows[c]], item_table[ids[c]]> in fp32, for every c of `out` (fp32 [C])."""
    width = item_table.shape[-1]
    _check_table("item_table", item_table, width)
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or x.dtype != item_table.dtype:
        raise ValueError(f"x {x.dtype} shape {tuple(x.shape)}: expected {item_table.dtype} [T, {width}] rows with "
                         f"unit column stride")
    if rows.shape != ids.shape or rows.dim() != 1 or out.shape != rows.shape or out.dtype != torch.float32:
        raise ValueError(f"rows/ids/out shapes {tuple(rows.shape)}/{tuple(ids.shape)}/{tuple(out.shape)}, out "
                         f"{out.dtype}: expected one [C] shape and a float32 out")
    if rows.shape[0]:
        _scores_kernel[(rows.shape[0],)](x, item_table, rows, ids, out, x.stride(0), E=width,
                                         E_P2=triton.next_power_of_2(width), num_warps=4)
    return out
