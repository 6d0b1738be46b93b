"""Ablations of the fp8 Gluon attention kernel, for timing only: the kernel recompiled with one of its tile functions
replaced by one that skips the work (the decode, the two dots, or the code copies), so its time tells what that
work costs on the tile's critical path. Their numbers are wrong by design and are never compared.

The library is not touched: `rebound` copies the kernel and every Gluon function it reaches, each over a copy of its
module's globals in which the named functions are swapped, and `AblatedFp8Attention` launches that copy through the
library's own launch code.
"""

from __future__ import annotations

import types

from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import async_copy
from triton.runtime.jit import JITFunction

from layerflow.kernels import gluon_fp8
from layerflow.kernels.gluon_fp8 import GluonFp8Attention
from layerflow.kernels.gluon_fp8_tiling import Fp8Tiling


@gluon.jit
def _no_decode(dst, codes, scales, ROWS_N, FP8, ASYNC_SCALES, DOT_SCALES, DECODE_BITS, layout):
    """In place of gluon_fp8_tiles._decode_rows: nothing read or written (the slot keeps stale values)."""
    pass


@gluon.jit
def _no_dots(raw, v_tile, k_dot_scales, v_dot_scales, acc, alpha, tile, whole, num_hist, lo, r, self_end, hist_end,
             key_cols, BLOCK_N, K_DOT_SCALES, V_DOT_SCALES, TANH, WHOLE, s_layout, p_layout):
    """In place of gluon_fp8_tiles._tile_dots: no SiLU and no V dot, the accumulator as it was; Q K^T (`raw`, the
    caller's wgmma) is left unused, so the compiler drops it."""
    return acc


@gluon.jit
def _no_copies(k_codes, v_codes, k_words, v_words, tile, page, num_hist, lo, hi, cache_h, scales_h, H, D, PAGE, ROWS,
               BLOCK_N, ASYNC_SCALES, layout):
    """In place of gluon_fp8_tiles._issue_codes: an empty copy group, so the pipeline's group count holds."""
    async_copy.commit_group()


ABLATIONS = {"no-decode": {"_decode_rows": _no_decode}, "no-dots": {"_tile_dots": _no_dots},
             "no-copies": {"_issue_codes": _no_copies}}


def rebound(fn: JITFunction, swaps: dict[str, JITFunction], memo: dict[int, JITFunction] | None = None,
            found: set[str] | None = None) -> JITFunction:
    """A copy of Gluon function `fn` whose calls reach `swaps[name]` wherever they reached a function called `name`,
    through every Gluon function `fn` calls; `found` collects the swapped names met."""
    memo = {} if memo is None else memo
    found = set() if found is None else found
    if id(fn) in memo:
        return memo[id(fn)]
    scope = dict(fn.__globals__)
    for name in fn.fn.__code__.co_names:
        if name in swaps:
            scope[name] = swaps[name]
            found.add(name)
        elif isinstance(scope.get(name), JITFunction):
            scope[name] = rebound(scope[name], swaps, memo, found)
    raw = fn.fn
    copy = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    copy.__annotations__ = dict(raw.__annotations__)    # the gl.constexpr marks (else launched as runtime ints)
    copy.__kwdefaults__ = raw.__kwdefaults__
    copy.__qualname__ = raw.__qualname__
    memo[id(fn)] = gluon.jit(copy)
    return memo[id(fn)]


class AblatedFp8Attention(GluonFp8Attention):
    """The fp8 Gluon launcher running the kernel with ABLATIONS[`ablation`]'s functions swapped in."""

    def __init__(self, tiling: Fp8Tiling, ablation: str) -> None:
        super().__init__(tiling)
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation={ablation!r}: expected one of {sorted(ABLATIONS)}")
        found: set[str] = set()
        self.kernel = rebound(gluon_fp8._gluon_fp8_kernel, ABLATIONS[ablation], found=found)
        missing = set(ABLATIONS[ablation]) - found
        if missing:
            raise ValueError(f"ablation={ablation!r}: the kernel no longer calls {sorted(missing)}")

    def _launch(self, grid: tuple[int, int, int], *args, **constexprs) -> None:
        library_kernel = gluon_fp8._gluon_fp8_kernel
        gluon_fp8._gluon_fp8_kernel = self.kernel
        try:
            super()._launch(grid, *args, **constexprs)
        finally:
            gluon_fp8._gluon_fp8_kernel = library_kernel
