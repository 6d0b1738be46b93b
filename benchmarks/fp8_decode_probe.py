"""Probes of the fp8 Gluon kernel (layerflow.kernels.gluon_fp8) for the H200: its loader's decode of a history tile
replaced, the rest of the kernel unchanged, to tell what the fp8 tile waits on. The numbers they give are wrong; only
their time means something:
- "widen": each code's byte zero-extended to 16 bits and stored as a bf16 bit pattern (the decode's shared-memory
  loads and stores, none of its conversions or scale multiplies);
- "skip": nothing decoded (the bf16 slots keep what they held: the code pipeline and the slots' handshakes alone).
If "widen" times like the real kernel, the decode's ALU is not what it waits on; if "skip" times like bf16's kernel,
the loader's pass over shared memory is.

The probe kernel is the library's, recompiled with its decode rebound (`_rebound`): the same source, so nothing of
the kernel is repeated here, and nothing in layerflow/ exists for the probe.
"""

from __future__ import annotations

import functools
import types

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from layerflow.kernels import gluon_fp8, gluon_fp8_tiles
from layerflow.kernels.gluon_fp8 import Fp8Tiling, GluonFp8Attention


@gluon.jit
def _widened_rows(dst, codes, scales, ROWS_N: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr,
                  DOT_SCALES: gl.constexpr, layout: gl.constexpr):
    """The codes' bytes as the low bytes of dst's 16-bit elements: the decode's loads and stores, no conversion."""
    raw = codes.load(layout)
    dst.store(raw.to(gl.int16).to(dst.dtype, bitcast=True))


@gluon.jit
def _skipped_rows(dst, codes, scales, ROWS_N: gl.constexpr, FP8: gl.constexpr, ASYNC_SCALES: gl.constexpr,
                  DOT_SCALES: gl.constexpr, layout: gl.constexpr):
    """Nothing: the slot keeps what it held."""
    gl.static_assert(ROWS_N > 0)


PROBES = {"widen": _widened_rows, "skip": _skipped_rows}


def _rebound(fn, **names):
    """A copy of the function `fn` (a Gluon JIT function, or a plain one) whose global `names` are replaced."""
    plain = fn.fn if hasattr(fn, "fn") else fn
    scope = dict(plain.__globals__, **names)
    copy = types.FunctionType(plain.__code__, scope, plain.__name__, plain.__defaults__)
    return gluon.jit(copy) if hasattr(fn, "fn") else copy


@functools.cache
def _probe_launch(probe: str):
    """GluonFp8Attention._launch over the library kernel whose history-tile decode is PROBES[probe]."""
    fill = _rebound(gluon_fp8_tiles._fill_tile, _decode_rows=PROBES[probe])
    producers = {name: _rebound(getattr(gluon_fp8, name), _fill_tile=fill)
                 for name in ("_fp8_producer", "_fp8_one_slot_producer")}
    kernel = _rebound(gluon_fp8._gluon_fp8_kernel, **producers)
    return _rebound(GluonFp8Attention._launch, _gluon_fp8_kernel=kernel)


class Fp8DecodeProbe(GluonFp8Attention):
    """The fp8 Gluon launcher with the probe `probe` (PROBES) in place of its decode."""

    def __init__(self, tiling: Fp8Tiling, probe: str) -> None:
        if probe not in PROBES:
            raise ValueError(f"probe={probe!r}: expected one of {sorted(PROBES)}")
        super().__init__(tiling)
        self.probe = probe
        self._launch = types.MethodType(_probe_launch(probe), self)
