"""The split reduction folded into the Gluon attention launch (GluonTiling.fold_splits): the launch's output is final,
with no split-sum kernel after it and no partials for the output gate to read.

Every program of a (query block, head) tile stores its fp32 partial as before, then meets the tile's other splits at
a barrier in global memory, then sums its share of the tile's rows over every split (in split order, a tree fixed at
compile time: the same bits on every run) and stores them in the output's dtype. The barrier is one int64 word per
tile, a generation (high 32 bits) and the arrivals (low 32): a program's arrival returns the generation it waits to
see pass, and the last to arrive resets the arrivals and bumps the generation in one atomic add, so a graph replay
finds every barrier ready without a reset of its own (two round trips to L2 on the last arrival's path).

A program waits for programs of its own launch, so this is only correct when every program of a launch is resident
at once: PagedAttention folds only where every launch its split rule can make fits one program per SM.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Splits loaded at once per unit of rows (each thread holds SPLIT_GROUP x 4 fp32 of them); more in groups, unrolled.
SPLIT_GROUP = gl.constexpr(16)
ARRIVALS = gl.constexpr(0xFFFFFFFF)
GENERATION = gl.constexpr(1 << 32)


@gluon.jit
def _tile_barrier(barrier_ptr, parties):
    """Return once `parties` programs (this one included) have called this on barrier_ptr (an int64 word: generation
    << 32 | arrivals). The block's warps' earlier stores are visible GPU-wide to every program that returns."""
    gl.thread_barrier()
    ticket = gl.atomic_add(barrier_ptr, 1, sem="acq_rel", scope="gpu")
    if (ticket & ARRIVALS) == parties - 1:
        gl.atomic_add(barrier_ptr, GENERATION - parties.to(gl.int64), sem="release", scope="gpu")
    else:
        while (gl.atomic_add(barrier_ptr, 0, sem="acquire", scope="gpu") >> 32) == (ticket >> 32):
            pass
    gl.thread_barrier()


@gluon.jit
def _unit_sum(partial_ptr, unit, units, num_splits, split_stride, q_start, row0, tile_rows, head, H: gl.constexpr,
              D: gl.constexpr, UNIT: gl.constexpr, GROUPS: gl.constexpr, layout: gl.constexpr):
    """The sum over the splits of the tile's rows unit * UNIT .. (UNIT rows, the layout's), GROUPS groups of
    SPLIT_GROUP splits loaded in straight-line code; zero for a unit past `units`."""
    splits = gl.arange(0, SPLIT_GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    rows = unit * UNIT + gl.arange(0, UNIT, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    at = (q_start + row0 + rows).to(gl.int64)[None, :, None] * (H * D) + head * D + cols[None, None, :]
    row_ok = ((rows < tile_rows) & (unit < units))[None, :, None]
    total = gl.zeros([UNIT, D], gl.float32, gl.SliceLayout(0, layout))
    for group in gl.static_range(GROUPS):
        s = group * SPLIT_GROUP + splits
        parts = gl.load(partial_ptr + s.to(gl.int64)[:, None, None] * split_stride + at,
                        mask=(s < num_splits)[:, None, None] & row_ok, other=0.0, cache_modifier=".cg")
        total += gl.sum(parts, axis=0)
    return total


@gluon.jit
def _store_unit(total, out_ptr, unit, units, q_start, row0, tile_rows, head, H: gl.constexpr, D: gl.constexpr,
                UNIT: gl.constexpr, layout: gl.constexpr):
    """Rows unit * UNIT .. of the tile's output: `total` in out_ptr's dtype (nothing for a unit past `units`)."""
    rows = unit * UNIT + gl.arange(0, UNIT, layout=gl.SliceLayout(1, gl.SliceLayout(0, layout)))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
    token = (q_start + row0 + rows).to(gl.int64)
    gl.store(out_ptr + token[:, None] * (H * D) + head * D + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=((rows < tile_rows) & (unit < units))[:, None])


@gluon.jit
def _fold_partials(partial_ptr, out_ptr, barrier_ptr, split, num_splits, split_stride, q_start, row0, q_len, head,
                   H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, GROUPS: gl.constexpr):
    """After this program stored its partial of the tile (rows row0 .. of head `head`, split `split` of num_splits,
    at most GROUPS * SPLIT_GROUP): wait for the tile's other splits (_tile_barrier), then out = the sum of the
    partials over the program's units of rows (units split, split + num_splits, ...; a unit: the rows one 16-byte
    load per thread covers), two units loaded before either is stored."""
    _tile_barrier(barrier_ptr, num_splits)
    num_warps: gl.constexpr = gl.num_warps()
    cols_per_warp: gl.constexpr = 32 if D // 4 >= 32 else D // 4
    rows_per_warp: gl.constexpr = 32 // cols_per_warp
    col_warps: gl.constexpr = D // (4 * cols_per_warp)
    row_warps: gl.constexpr = num_warps // col_warps
    UNIT: gl.constexpr = rows_per_warp * row_warps
    layout: gl.constexpr = gl.BlockedLayout([SPLIT_GROUP, 1, 4], [1, rows_per_warp, cols_per_warp],
                                            [1, row_warps, col_warps], [2, 1, 0])
    tile_rows = gl.minimum(q_len - row0, BLOCK_M)
    units = gl.cdiv(tile_rows, UNIT)
    for unit in range(split, units, 2 * num_splits):
        first = _unit_sum(partial_ptr, unit, units, num_splits, split_stride, q_start, row0, tile_rows, head, H, D,
                          UNIT, GROUPS, layout)
        second = _unit_sum(partial_ptr, unit + num_splits, units, num_splits, split_stride, q_start, row0,
                           tile_rows, head, H, D, UNIT, GROUPS, layout)
        _store_unit(first, out_ptr, unit, units, q_start, row0, tile_rows, head, H, D, UNIT, layout)
        _store_unit(second, out_ptr, unit + num_splits, units, q_start, row0, tile_rows, head, H, D, UNIT, layout)
