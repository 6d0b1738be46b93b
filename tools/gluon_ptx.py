"""Compile the Gluon attention kernels for sm_90 on a machine without a GPU and print a hash of each variant's
instructions (the PTX without its DWARF debug data), so a change to GPU-only code can be checked to compile and, for a
refactor, to emit the same instructions as before (run it on both sides of the change and compare).

Needs the GPU image's Triton (3.6) importable from --triton, e.g. `pip install --target /tmp/t36 triton==3.6.0`:

    python -m tools.gluon_ptx --triton /tmp/t36
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys

DEBUG_DATA = re.compile(r"^\s*(\.b(8|16|32|64)\s|\.section|\.file|\.loc|//|\$L__|\}\s*$)")
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "cache_ptr", "page_table_ptr", "q_offsets_ptr", "history_lens_ptr",
            "appended_lens_ptr", "inv_n_ptr", "dst_ptr")
STRIDES = ("q_stride", "k_stride", "v_stride", "page_table_stride", "split_stride")


def instructions_hash(fn, types: dict[str, str], constexprs: dict, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = dict(constexprs, num_warps=num_warps)
    signature = {**types, **{"max_batch": "i32", "alpha": "fp32"}, **{n: "i32" for n in STRIDES},
                 **{n: "constexpr" for n in constexprs}}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in POINTERS + STRIDES}
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    code = "\n".join(line for line in kernel.asm["ptx"].splitlines() if line.strip() and not DEBUG_DATA.match(line))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton", required=True, help="a directory holding Triton 3.6 (prepended to sys.path)")
    args = parser.parse_args()
    sys.path.insert(0, args.triton)
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from layerflow.kernels import gluon_attention, gluon_fp8
    from layerflow.tier.layout import fp8_scale_rows

    bf16 = dict(zip(POINTERS, ["*bf16"] * 4 + ["*i32"] * 4 + ["*fp32"] * 2), num_splits="i32")
    pool = torch.zeros(4, 2, 32, 4, 256, dtype=torch.bfloat16)
    desc = TensorDescriptor(pool, [pool.numel() // 1024, 1024], [1024, 1], [32, 256],
                            gluon_attention.SMEM_LAYOUT.value)
    shape = dict(H=4, D=256, PAGE=32, BATCH_P2=2, INV_N_PER_USER=False)
    variants = {
        "64x3:sync m64": (dict(BLOCK_N=64, STAGES=3, WARP_SPECIALIZE=False, TMA=False, TANH=False), 64),
        "64x2:pv:tma:tanh:wt:sl:rows m128": (dict(BLOCK_N=64, STAGES=2, WARP_SPECIALIZE=True, TMA=True, TANH=True,
                                                  WHOLE=True, SELF_LAST=True, table=True), 128),
        "64x2:pv:tma:tanh:r96 m128": (dict(BLOCK_N=64, STAGES=2, WARP_SPECIALIZE=True, TMA=True, TANH=True,
                                           PRODUCER_REGISTERS=96), 128),
        "64x2:pv m128": (dict(BLOCK_N=64, STAGES=2, WARP_SPECIALIZE=True, TMA=False, TANH=False), 128),
        "64x2:pv2:tma:tanh:wt:sl:rows m128": (dict(BLOCK_N=64, STAGES=2, WARP_SPECIALIZE=True, TMA=True, TANH=True,
                                                   WHOLE=True, SELF_LAST=True, HALVES=2, table=True), 128),
    }
    for name, (tiling, block_m) in variants.items():
        tiling = dict(tiling)
        table = tiling.pop("table", False)
        types = dict(bf16, cache_desc=mangle_type(desc)) if tiling["TMA"] else bf16
        if table:
            types = dict(types, split_table_ptr="*i32", active_splits_ptr="*i32")
        constexprs = dict(shape, ROWS=32, BLOCK_M=block_m,
                          **{"PRODUCER_REGISTERS": 64, "WHOLE": False, "SELF_LAST": False, "HALVES": 1, **tiling},
                          **({} if tiling["TMA"] else {"cache_desc": None}))
        code = instructions_hash(gluon_attention._gluon_attention_kernel, types, constexprs,
                                 block_m // 16 // constexprs["HALVES"])
        print(f"bf16 {name}: {code}")
    fp8_types = dict(zip(POINTERS, ["*bf16"] * 3 + ["*u8"] + ["*i32"] * 4 + ["*fp32"] * 2))
    no_table = dict(split_table_ptr=None, active_splits_ptr=None)
    fp8_variants = {"32x2:c4:load:w4 m128": dict(ASYNC_SCALES=False), "32x2:c4:async:w4 m128": {},
                    "32x2:c4:async:wt:w4 m128": dict(WHOLE=True),
                    "32x2:c4:async:dots:tanh:wt:w4 m128": dict(DOT_SCALES=True, TANH=True, WHOLE=True),
                    "64x2:c1:async:wt:rows:last:w4 m128": dict(BLOCK_N=64, CODE_STAGES=1, WHOLE=True, table=True),
                    "64x2:c1:async:wt:rows:last:bits:w4 m128": dict(BLOCK_N=64, CODE_STAGES=1, WHOLE=True,
                                                                    DECODE_BITS=True, table=True),
                    "64x2:c2:async:tanh:wt:rows:last:bits:w4 m64": dict(BLOCK_N=64, CODE_STAGES=2, BLOCK_M=64,
                                                                        TANH=True, WHOLE=True, DECODE_BITS=True,
                                                                        table=True),
                    "64x2:c1:async:wt:rows:last:bits:qk2:w4 m128": dict(BLOCK_N=64, CODE_STAGES=1, WHOLE=True,
                                                                        DECODE_BITS=True, QK_TERMS=2, table=True)}
    for label, knobs in fp8_variants.items():
        knobs = {"BLOCK_M": 128, "BLOCK_N": 32, "CODE_STAGES": 4, "ASYNC_SCALES": True, "DOT_SCALES": False,
                 "TANH": False, "WHOLE": False, "DECODE_BITS": False, "QK_TERMS": 0, **knobs}
        table = knobs.pop("table", False)
        types = dict(fp8_types, split_table_ptr="*i32", active_splits_ptr="*i32") if table else fp8_types
        constexprs = dict(shape, NUM_SPLITS=11, STAGES=2, ROWS=32 + fp8_scale_rows(32, 256), FP8=1,
                          FILL_ROWS=gluon_fp8.fill_rows(knobs["BLOCK_N"], 256, 4), PRODUCER_WARPS=4,
                          PRODUCER_REGISTERS=96, **knobs, **({} if table else no_table))
        code = instructions_hash(gluon_fp8._gluon_fp8_kernel, types, constexprs, knobs["BLOCK_M"] // 16)
        print(f"fp8 {label}: {code}")

if __name__ == "__main__":
    main()
