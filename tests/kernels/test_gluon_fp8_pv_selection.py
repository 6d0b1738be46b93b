"""The fp8 Gluon kernel's schedule switch (Fp8Tiling.schedule, $LAYERFLOW_FP8_SCHEDULE): the pv tiling it picks, what
the pv schedule refuses by name, and the shared memory it takes."""

import pytest
import torch

from layerflow.kernels.gluon_fp8 import select_fp8_kernel
from layerflow.kernels.gluon_fp8_tiling import (DEFAULT_SCHEDULE, PV_TILES, SCHEDULE_ENV, Fp8Tiling,
                                                default_fp8_tiling, fp8_shared_memory_bytes, fp8_unsupported_reason)

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_the_schedule_defaults_to_ws_and_pv_takes_its_own_tiles(monkeypatch):
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    assert default_fp8_tiling(256, 128, 32, torch.bfloat16, E4M3).schedule == DEFAULT_SCHEDULE == "ws"
    monkeypatch.setenv(SCHEDULE_ENV, "pv")
    for head_dim, block_m in ((256, 128), (256, 64), (128, 128), (64, 64)):
        tiling = default_fp8_tiling(head_dim, block_m, 32, torch.bfloat16, E4M3)
        assert tiling.schedule == "pv" and tiling.qk == "fp8x2" and tiling.decode == "bits"
        assert (tiling.block_n, tiling.stages, tiling.code_stages) == PV_TILES[head_dim > 128]
        # only the device is missing here
        reason = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, head_dim, block_m, 0, 0, tiling, 32)
        assert reason is not None and "sm_90" in reason, reason


def test_a_bad_schedule_and_pv_over_e5m2_pages_are_named(monkeypatch):
    monkeypatch.setenv(SCHEDULE_ENV, "pipelined")
    with pytest.raises(ValueError, match=f"{SCHEDULE_ENV}='pipelined'"):
        select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)
    monkeypatch.setenv(SCHEDULE_ENV, "pv")
    with pytest.raises(ValueError, match=f"{SCHEDULE_ENV}='pv' with qk='bf16'"):
        default_fp8_tiling(256, 128, 32, torch.bfloat16, E5M2)


@pytest.mark.parametrize("tiling, words", [
    (Fp8Tiling(32, 2, 4, schedule="pv"), "qk 'fp8x2' and scale_copy 'async' only"),
    (Fp8Tiling(32, 2, 4, schedule="pv", qk="fp8x2", scale_copy="load"), "qk 'fp8x2' and scale_copy 'async' only"),
    (Fp8Tiling(32, 2, 4, schedule="later", qk="fp8x2"), "schedule must be one of"),
])
def test_the_pv_schedule_refuses_what_it_does_not_run(tiling, words):
    reason = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, 256, 128, 0, 0, tiling, 32)
    assert reason is not None and words in reason, reason


def test_pv_shared_memory_counts_the_query_terms_k_and_v_slots_and_value_code_slots():
    # two e4m3 query terms of 128 x 256 with their row scales; per slot 32 x 256 e4m3 keys, bf16 values and 32 scale
    # words; 4 value code slots of 32 x 256 bytes with 32 scale words
    tiling = Fp8Tiling(32, 2, 4, schedule="pv", qk="fp8x2")
    expected = 2 * 128 * 260 + 2 * (8192 + 16384 + 128) + 4 * (8192 + 128) + 2048
    assert fp8_shared_memory_bytes(128, 256, tiling) == expected
