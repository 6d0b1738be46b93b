"""The launch knobs of the fp8 Gluon attention kernel (layerflow.kernels.gluon_fp8): the Fp8Tiling fields, their
choices and environment variables, the defaults the H200 picked per shape, the shared memory a tiling takes and why a
tiling or a shape cannot run."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from layerflow.kernels.gluon_launcher import device_reason, mask_reason, registers_reason, shape_reason
from layerflow.tier.layout import FP8_DTYPES

KERNEL_NAME = "the fp8 Gluon kernel"   # how its refusals name it
SCALE_COPIES = ("load", "async")
SCALE_COPY_ENV = "LAYERFLOW_FP8_SCALE_COPY"
# The H200 showed "async" correct (16K, 0 and 256 candidates), faster at 2K/0 (13.8 us against 14.6 for "load") and
# even at 16K/256 (100.1 against 99.7); "load" stays for pages of a size that is not a multiple of 4 tokens (the
# scale words would straddle two keys' pages).
DEFAULT_SCALE_COPY = "async"
SCALE_SITES = ("decode", "dots")
SCALE_SITE_ENV = "LAYERFLOW_FP8_SCALE_SITE"
DEFAULT_SCALE_SITE = "decode"
SILUS = ("exact", "tanh")
SILU_ENV = "LAYERFLOW_FP8_SILU"
DEFAULT_SILU = "exact"
WHOLE_TILES_ENV = "LAYERFLOW_FP8_UNMASKED_WHOLE_TILES"
# The mask skipped on whole tiles: the same bits, faster on the H200 (16K/256: 97.1 us against 100.1; a 2K GPU hit's
# attention 193.0 us against 196.6).
DEFAULT_UNMASKED_WHOLE_TILES = True
DECODES = ("cvt", "bits")
DECODE_ENV = "LAYERFLOW_FP8_DECODE"
# "cvt" is the Fp8Tiling field's default (it serves fp16 models too); default_fp8_tiling takes "bits" for bf16 models:
# the H200 showed it exact for every code and, with the split table and self tiles last, a GPU hit's kernels 890.0 us
# against 948.3 at 16K (393.3 against 415.1 at 2K).
DEFAULT_DECODE = "cvt"
BF16_DECODE = "bits"
# Q K^T over decoded keys, or on fp8 MMAs with two e4m3 query terms (gluon_fp8_qk). "bf16" is the field's default (it
# serves e5m2 pages too); default_fp8_tiling takes "fp8x2" over e4m3 pages: the H200 showed it within the quality gate
# and faster (16K/256: 84.0 us against 93.1; a 16K GPU hit 0.91 ms against 1.00). One term misses the gate: not
# offered.
QKS = ("bf16", "fp8x2")
QK_ENV = "LAYERFLOW_FP8_QK"
DEFAULT_QK = "bf16"
E4M3_QK = "fp8x2"
QK_TERMS = {"bf16": 0, "fp8x2": 2}
MODEL_DTYPES = (torch.bfloat16, torch.float16)
SHARED_MEMORY_BYTES = 227 * 1024
LOADER_WARPS = (4, 8)
MAX_WARPS = 12
# One loader warpgroup is the proven path; 8 (two, sharing the decode) only fits beside 64-row query blocks.
LOADER_WARPS_AT_M64 = 4
# Code slots of the default 64-key tiles at D=256 per query block (what fits beside it). H200, attention alone, us,
# against 32-key tiles in four slots: one slot by 128-row blocks 94.0 / 28.1 at 16K / 2K, 256 candidates (95.5 /
# 28.6); two slots with the tanh SiLU by 64-row blocks 32.4 / 14.1 at 16K / 2K, 0 candidates (33.9 / 13.7).
WIDE_CODE_STAGES = {128: 1, 64: 2}
# The SiLU of those 64-key tiles at D=256, beside either query block: one tanh.approx a score (docs/fp8.md).
WIDE_SILU = "tanh"


@dataclass(frozen=True)
class Fp8Tiling:
    """Launch knobs of the fp8 Gluon kernel: keys per tile, bf16 slots the dots read, code slots (`code_stages`:
    >= 2 in a ring, >= 3 with "load", whose scale bytes reach the scale ring an iteration after their tile's copies;
    or 1 with "async": one slot, refilled with the next tile's codes as soon as this tile is decoded, so they travel
    while the loader waits for a free bf16 slot, which lets 64-key tiles fit beside a 128 x 256 query block), how the
    scale bytes travel (SCALE_COPIES), the loader's warps (one or two warpgroups share the decode) and their registers
    each, where the scales are applied (SCALE_SITES), the SiLU (SILUS), whether the block's warps skip the mask
    on the history tiles every row of the block sees whole (gluon_tiles._whole_tiles), how the loader decodes
    (DECODES) and how Q K^T runs (QKS: with "fp8x2" the K slots hold e4m3 codes and only V is decoded)."""

    block_n: int = 32
    stages: int = 2
    code_stages: int = 4
    scale_copy: str = DEFAULT_SCALE_COPY
    producer_registers: int = 96
    producer_warps: int = 4
    scale_site: str = DEFAULT_SCALE_SITE
    silu: str = DEFAULT_SILU
    unmasked_whole_tiles: bool = DEFAULT_UNMASKED_WHOLE_TILES
    decode: str = DEFAULT_DECODE
    qk: str = DEFAULT_QK

    def query_block(self, tl_block_m: int) -> int:
        """The query rows per program: the `tl` tiling's (this kernel has no query block of its own)."""
        return tl_block_m


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """$name if set (ValueError naming it when it is not one of `choices`), else `default`."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise ValueError(f"${name}={value!r}: expected one of {choices}")
    return value


def _env_flag(name: str, default: bool) -> bool:
    """$name as a flag, "0" or "1" (ValueError naming it otherwise), else `default`."""
    return _env_choice(name, ("0", "1"), str(int(default))) == "1"


def default_fp8_tiling(head_dim: int, block_m: int = 128, page_size: int | None = None,
                       dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> Fp8Tiling:
    """64-key tiles: in four code slots at D <= 128, at D=256 in WIDE_CODE_STAGES[block_m] where those fit beside
    the query block (the "async" scale copy, the "decode" scale site), else 32-key tiles in four; the scale copy,
    scale site, SiLU, whole-tile mask and decode of $LAYERFLOW_FP8_SCALE_COPY, $LAYERFLOW_FP8_SCALE_SITE,
    $LAYERFLOW_FP8_SILU, $LAYERFLOW_FP8_DECODE, $LAYERFLOW_FP8_QK and the flag (0 or 1)
    $LAYERFLOW_FP8_UNMASKED_WHOLE_TILES, else the
    defaults: the "async" scale copy where `page_size` is a multiple of 4 (None: assumed to), else "load";
    WIDE_SILU with 64-key tiles at D=256, else DEFAULT_SILU; LOADER_WARPS_AT_M64 loader warps
    beside 64-row blocks; BF16_DECODE for a bf16 model (`dtype`), else DEFAULT_DECODE (the "bits" decode writes bf16
    tiles only; None: the model's dtype not known), E4M3_QK over e4m3 pages (`kv_dtype`), else DEFAULT_QK (None:
    the pages' format not known). ValueError naming $LAYERFLOW_FP8_QK when it asks for e4m3 MMAs over e5m2 pages."""
    qk = _env_choice(QK_ENV, QKS, E4M3_QK if kv_dtype == torch.float8_e4m3fn else DEFAULT_QK)
    if qk != "bf16" and kv_dtype == torch.float8_e5m2:
        raise ValueError(f"${QK_ENV}={qk!r} over {kv_dtype} pages: it feeds the key codes to e4m3 MMAs (e4m3 pages "
                         "only; unset it for e5m2)")
    copy = DEFAULT_SCALE_COPY if page_size is None or page_size % 4 == 0 else "load"
    tiling = Fp8Tiling(block_n=64 if head_dim <= 128 else 32,
                       scale_copy=_env_choice(SCALE_COPY_ENV, SCALE_COPIES, copy),
                       producer_warps=LOADER_WARPS_AT_M64 if block_m == 64 else 4,
                       scale_site=_env_choice(SCALE_SITE_ENV, SCALE_SITES, DEFAULT_SCALE_SITE),
                       unmasked_whole_tiles=_env_flag(WHOLE_TILES_ENV, DEFAULT_UNMASKED_WHOLE_TILES),
                       decode=_env_choice(DECODE_ENV, DECODES,
                                          BF16_DECODE if dtype == torch.bfloat16 else DEFAULT_DECODE),
                       qk=qk)
    wide = replace(tiling, block_n=64, code_stages=WIDE_CODE_STAGES.get(block_m, 4))
    if head_dim > 128 and fp8_tiling_reason(wide) is None and \
            fp8_shared_memory_bytes(block_m, head_dim, wide) <= SHARED_MEMORY_BYTES:
        tiling = wide
    silu = WIDE_SILU if head_dim > 128 and tiling.block_n == 64 else DEFAULT_SILU
    return replace(tiling, silu=_env_choice(SILU_ENV, SILUS, silu))


def fp8_shared_memory_bytes(block_m: int, head_dim: int, tiling: Fp8Tiling, itemsize: int = 2) -> int:
    """Query block (with fp8 q.k its e4m3 terms and their row scales), K/V slots in the dots' dtypes (with the
    "dots" scale site, or fp8 q.k for K, their keys' fp32 scales), K/V code slots and their 4-byte scales, plus 2 KiB
    for the mbarriers and what the compiler adds (the sm_90 build of the default tiling at D=256 asked for 0.3 KiB
    beyond the buffers)."""
    tile_bytes = tiling.block_n * head_dim
    terms = QK_TERMS.get(tiling.qk, 0)
    if terms:
        queries = terms * block_m * (head_dim + 4)
        slot = tile_bytes * (1 + itemsize) + tiling.block_n * 4
    else:
        queries = block_m * head_dim * itemsize
        slot = 2 * tile_bytes * itemsize + (2 * tiling.block_n * 4 if tiling.scale_site == "dots" else 0)
    return (queries + tiling.stages * slot + tiling.code_stages * (2 * tile_bytes + 2 * tiling.block_n * 4)
            + 2 * 1024)


def fp8_tiling_reason(tiling: Fp8Tiling) -> str | None:
    """What is wrong with `tiling` on any shape (None when nothing is)."""
    if tiling.block_n not in (32, 64) or tiling.stages < 2 or tiling.code_stages < 1:
        return f"{tiling}: block_n must be 32 or 64, stages >= 2 and code_stages >= 1"
    if tiling.scale_copy not in SCALE_COPIES:
        return f"{tiling}: scale_copy must be one of {SCALE_COPIES} (field or ${SCALE_COPY_ENV})"
    if tiling.code_stages < 3 and tiling.scale_copy != "async":
        return (f"{tiling}: code_stages < 3 needs scale_copy='async' (with 'load' a tile's scales are stored an "
                "iteration after its copies are issued)")
    reason = registers_reason(tiling)
    if reason is not None:
        return reason
    if tiling.producer_warps not in LOADER_WARPS:
        return f"{tiling}: producer_warps must be one of {LOADER_WARPS}"
    if tiling.scale_site not in SCALE_SITES:
        return f"{tiling}: scale_site must be one of {SCALE_SITES} (field or ${SCALE_SITE_ENV})"
    if tiling.silu not in SILUS:
        return f"{tiling}: silu must be one of {SILUS} (field or ${SILU_ENV})"
    if not isinstance(tiling.unmasked_whole_tiles, bool):
        return f"{tiling}: unmasked_whole_tiles must be a bool (field, or ${WHOLE_TILES_ENV} 0 or 1)"
    if tiling.decode not in DECODES:
        return f"{tiling}: decode must be one of {DECODES} (field or ${DECODE_ENV})"
    if tiling.qk not in QKS:
        return f"{tiling}: qk must be one of {QKS} (field or ${QK_ENV})"
    if tiling.qk != "bf16" and tiling.scale_site == "dots":
        return (f"{tiling}: qk={tiling.qk!r} applies the key scales to S and decodes V with its scales "
                "(scale_site 'decode' only)")
    return None


def fp8_unsupported_reason(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None, head_dim: int,
                           block_m: int, window: int, contextual: int, tiling: Fp8Tiling,
                           page_size: int | None = None) -> str | None:
    """Why the fp8 Gluon kernel cannot serve this attention (None when it can; page_size None: not checked)."""
    if dtype not in MODEL_DTYPES or kv_dtype not in FP8_DTYPES:
        return f"dtype={dtype}, kv_dtype={kv_dtype}: the fp8 Gluon kernel needs a bf16/fp16 model over fp8 pages"
    reason = mask_reason(KERNEL_NAME, window, contextual) or shape_reason(KERNEL_NAME, block_m, head_dim) or \
        fp8_tiling_reason(tiling)
    if reason is not None:
        return reason
    if tiling.decode == "bits" and dtype != torch.bfloat16:
        return f"{tiling} for a {dtype} model: decode='bits' writes bf16 tiles (a bf16 model only)"
    if tiling.qk != "bf16" and kv_dtype != torch.float8_e4m3fn:
        return f"{tiling} over {kv_dtype} pages: qk={tiling.qk!r} feeds the key codes to e4m3 MMAs (e4m3 pages only)"
    if tiling.scale_copy == "async" and page_size is not None and page_size % 4:
        return (f"{tiling} at page_size={page_size}: scale_copy='async' copies 4-byte words of scales, so pages must "
                "hold a multiple of 4 tokens")
    if block_m // 16 + tiling.producer_warps > MAX_WARPS:
        return (f"{tiling} at block_m={block_m}: over {MAX_WARPS} warps (the dots' accumulators would not fit "
                "the registers left per thread)")
    if fp8_shared_memory_bytes(block_m, head_dim, tiling) > SHARED_MEMORY_BYTES:
        return f"{tiling} at block_m={block_m}, head_dim={head_dim}: over {SHARED_MEMORY_BYTES} bytes of shared memory"
    return device_reason(KERNEL_NAME, device)
