"""Which kernel serves an fp8 cache: the fp8 Gluon kernel's shape rules, `auto` taking it only where it can run,
`gluon` insisting (with the reason it cannot run here), the tiling checks, and the scale-copy ("async" where pages
allow), scale-site, SiLU, whole-tile and decode switches."""

import pytest
import torch

from layerflow.kernels import PagedAttention
from layerflow.kernels.gluon_attention import KERNEL_ENV, select_kernel
from layerflow.kernels.gluon_fp8 import GluonFp8Attention, fill_rows, select_fp8_kernel
from layerflow.kernels.gluon_fp8_tiling import (DECODE_ENV, DEFAULT_DECODE, DEFAULT_QK, DEFAULT_SCALE_SITE,
                                                DEFAULT_SILU, DEFAULT_UNMASKED_WHOLE_TILES, E4M3_QK, QK_ENV,
                                                SCALE_COPY_ENV, SCALE_SITE_ENV, SILU_ENV, WHOLE_TILES_ENV, Fp8Tiling,
                                                default_fp8_tiling, fp8_shared_memory_bytes, fp8_unsupported_reason)

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@pytest.mark.parametrize("dtype, kv_dtype, head_dim, block_m, window, contextual, tiling, words", [
    (torch.float32, E4M3, 256, 128, 0, 0, Fp8Tiling(), "bf16/fp16 model over fp8 pages"),
    (torch.bfloat16, None, 256, 128, 0, 0, Fp8Tiling(), "bf16/fp16 model over fp8 pages"),
    (torch.bfloat16, E4M3, 256, 128, 512, 0, Fp8Tiling(), "default mask"),
    (torch.float16, torch.float8_e5m2, 128, 64, 0, 3, Fp8Tiling(), "default mask"),
    (torch.bfloat16, E4M3, 256, 32, 0, 0, Fp8Tiling(), "block_m=32"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(block_n=16), "block_n"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(code_stages=0), "code_stages >= 1"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(code_stages=2, scale_copy="load"), "code_stages < 3 needs"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(scale_copy="bytes"), "scale_copy"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(producer_registers=100), "producer_registers"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(producer_warps=6), "producer_warps"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(producer_warps=8), "over 12 warps"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(block_n=64), "shared memory"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(scale_site="loader"), "scale_site"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(silu="sigmoid"), "silu"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(unmasked_whole_tiles=1), "unmasked_whole_tiles"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(decode="lut"), "decode must be one of"),
    (torch.float16, E4M3, 256, 128, 0, 0, Fp8Tiling(decode="bits"), "decode='bits' writes bf16 tiles"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(qk="fp16"), "qk must be one of"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(qk="fp8x2", scale_site="dots"), "scale_site 'decode' only"),
    (torch.bfloat16, torch.float8_e5m2, 256, 128, 0, 0, Fp8Tiling(qk="fp8x2"), "e4m3 pages only"),
    (torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(), "sm_90"),
])
def test_unsupported_reason_names_the_first_rule_broken(dtype, kv_dtype, head_dim, block_m, window, contextual,
                                                        tiling, words):
    reason = fp8_unsupported_reason(CPU, dtype, kv_dtype, head_dim, block_m, window, contextual, tiling)
    assert reason is not None and words in reason


def test_shared_memory_counts_the_query_block_both_rings_and_the_scales():
    # 128 x 256 bf16 queries, 2 bf16 K/V slots of 32 x 256, 4 code slots of 32 x 256 bytes with 2 x 32 fp32 scales
    assert fp8_shared_memory_bytes(128, 256, Fp8Tiling()) == 65536 + 65536 + 4 * (16384 + 256) + 2048
    # 3 bf16 slots, 6 code slots; the scale words of "async" take the fp32 scales' room
    expected = 65536 + 3 * 32768 + 6 * (16384 + 256) + 2048
    assert fp8_shared_memory_bytes(128, 256, Fp8Tiling(stages=3, code_stages=6, scale_copy="async")) == expected
    # "dots": each bf16 slot keeps its 32 keys' K and V scales (fp32) for the block's warps
    expected = 65536 + 2 * (32768 + 256) + 4 * (16384 + 256) + 2048
    assert fp8_shared_memory_bytes(128, 256, Fp8Tiling(scale_site="dots")) == expected
    # one code slot of 64 keys beside two bf16 slots of 64 keys
    expected = 65536 + 2 * 65536 + (32768 + 512) + 2048
    assert fp8_shared_memory_bytes(128, 256, Fp8Tiling(block_n=64, code_stages=1)) == expected


def test_one_code_slot_lets_64_key_tiles_fit_beside_a_128_row_block_at_d256():
    four_slots = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(block_n=64))
    one_slot = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, 256, 128, 0, 0, Fp8Tiling(block_n=64, code_stages=1))
    assert "shared memory" in four_slots and "sm_90" in one_slot, (four_slots, one_slot)


@pytest.mark.parametrize("loader_warps_at_m64", [4, 8])
def test_default_tiling_fits_every_head_dim_at_both_query_blocks(monkeypatch, loader_warps_at_m64):
    monkeypatch.setattr("layerflow.kernels.gluon_fp8_tiling.LOADER_WARPS_AT_M64", loader_warps_at_m64)
    for head_dim in (64, 128, 256):
        for block_m in (64, 128):
            reason = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, head_dim, block_m, 0, 0,
                                            default_fp8_tiling(head_dim, block_m))
            assert "sm_90" in reason, reason


def test_d256_defaults_to_64_key_tiles_in_the_code_slots_that_fit_beside_the_query_block(monkeypatch):
    for name in (SCALE_COPY_ENV, SCALE_SITE_ENV, SILU_ENV):
        monkeypatch.delenv(name, raising=False)
    assert default_fp8_tiling(256, 128) == Fp8Tiling(block_n=64, code_stages=1, silu="tanh")
    assert default_fp8_tiling(256, 64) == Fp8Tiling(block_n=64, code_stages=2, silu="tanh")
    assert default_fp8_tiling(128, 64) == Fp8Tiling(block_n=64, code_stages=4, silu="exact")
    # "load" needs three code slots, and the "dots" scale site's fp32 scales do not fit beside either query block
    assert default_fp8_tiling(256, 64, 2) == Fp8Tiling(block_n=32, scale_copy="load", silu="exact")
    monkeypatch.setenv(SCALE_SITE_ENV, "dots")
    assert default_fp8_tiling(256, 128) == Fp8Tiling(block_n=32, scale_site="dots")
    assert default_fp8_tiling(256, 64) == Fp8Tiling(block_n=32, scale_site="dots")
    monkeypatch.delenv(SCALE_SITE_ENV)
    monkeypatch.setenv(SILU_ENV, "exact")
    assert default_fp8_tiling(256, 64) == Fp8Tiling(block_n=64, code_stages=2, silu="exact")


def test_two_loader_warpgroups_fit_beside_a_64_row_query_block_only(monkeypatch):
    reason = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, 256, 64, 0, 0, Fp8Tiling(producer_warps=8))
    assert "sm_90" in reason, reason
    monkeypatch.setattr("layerflow.kernels.gluon_fp8_tiling.LOADER_WARPS_AT_M64", 8)
    assert default_fp8_tiling(256, 64).producer_warps == 8
    assert default_fp8_tiling(256, 128).producer_warps == 4


def test_fill_rows_bound_the_codes_per_thread():
    assert fill_rows(32, 256, 4) == 16 and fill_rows(32, 256, 8) == 32 and fill_rows(64, 64, 4) == 64


def attention(**kwargs) -> PagedAttention:
    return PagedAttention(2, 64, 4, 2, 64, 16, torch.bfloat16, "cpu", 0.125, 128, kv_dtype=E4M3, **kwargs)


def test_auto_stays_on_tl_where_the_fp8_kernel_cannot_run_and_triton_always_does(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert attention().gluon is None
    assert attention(kernel="triton").gluon is None
    assert select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0) is None


def test_the_scale_copy_is_async_where_pages_hold_whole_scale_words(monkeypatch):
    monkeypatch.delenv(SCALE_COPY_ENV, raising=False)
    assert default_fp8_tiling(256).scale_copy == "async" and default_fp8_tiling(256, 128, 32).scale_copy == "async"
    assert default_fp8_tiling(256, 128, 2).scale_copy == "load"
    monkeypatch.setenv(SCALE_COPY_ENV, "async")
    reason = fp8_unsupported_reason(CPU, torch.bfloat16, E4M3, 256, 128, 0, 0, default_fp8_tiling(256, 128, 2), 2)
    assert "page_size=2" in reason and "multiple of 4" in reason


def test_the_scale_copy_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv(SCALE_COPY_ENV, "load")
    assert default_fp8_tiling(256) == Fp8Tiling(block_n=32, scale_copy="load")
    monkeypatch.setenv(SCALE_COPY_ENV, "async")
    assert default_fp8_tiling(128) == Fp8Tiling(block_n=64, scale_copy="async")
    monkeypatch.setenv(SCALE_COPY_ENV, "bytes")
    with pytest.raises(ValueError, match="LAYERFLOW_FP8_SCALE_COPY='bytes'"):
        select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)


def test_the_scale_site_and_silu_come_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    for name in (SCALE_SITE_ENV, SILU_ENV):
        monkeypatch.delenv(name, raising=False)
    tiling = default_fp8_tiling(256)
    assert tiling.scale_site == DEFAULT_SCALE_SITE and tiling.silu == "tanh"      # 64-key tiles at D=256
    assert default_fp8_tiling(128).silu == DEFAULT_SILU
    monkeypatch.setenv(SILU_ENV, "exact")
    assert default_fp8_tiling(256).silu == "exact"
    monkeypatch.setenv(SCALE_SITE_ENV, "dots")
    monkeypatch.setenv(SILU_ENV, "tanh")
    assert default_fp8_tiling(256) == Fp8Tiling(block_n=32, scale_site="dots", silu="tanh")
    monkeypatch.setenv(SILU_ENV, "fast")
    with pytest.raises(ValueError, match="LAYERFLOW_FP8_SILU='fast'"):
        default_fp8_tiling(256)
    monkeypatch.delenv(SILU_ENV)
    monkeypatch.setenv(SCALE_SITE_ENV, "mma")
    with pytest.raises(ValueError, match="LAYERFLOW_FP8_SCALE_SITE='mma'"):
        select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)


def test_the_whole_tile_mask_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv(WHOLE_TILES_ENV, raising=False)
    assert default_fp8_tiling(256).unmasked_whole_tiles == DEFAULT_UNMASKED_WHOLE_TILES
    monkeypatch.setenv(WHOLE_TILES_ENV, "1")
    assert default_fp8_tiling(256).unmasked_whole_tiles
    monkeypatch.setenv(WHOLE_TILES_ENV, "0")
    assert not default_fp8_tiling(256).unmasked_whole_tiles
    monkeypatch.setenv(WHOLE_TILES_ENV, "yes")
    with pytest.raises(ValueError, match="LAYERFLOW_FP8_UNMASKED_WHOLE_TILES='yes'"):
        select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)


def test_forcing_gluon_over_fp8_pages_says_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    with pytest.raises(ValueError, match="kernel='gluon'.*fp8 Gluon kernel needs a CUDA sm_90"):
        attention(kernel="gluon")
    with pytest.raises(ValueError, match="kernel='gluon'.*default mask"):
        select_kernel("gluon", CPU, torch.bfloat16, E4M3, 256, 128, 512, 0)
    monkeypatch.setenv(KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="kernel='gluon'.*sm_90"):
        attention()


def test_select_fp8_kernel_takes_only_the_gluon_choices():
    with pytest.raises(ValueError, match="kernel='triton'"):
        select_fp8_kernel("triton", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)


def test_the_launcher_rejects_a_bad_tiling_and_tl_only_masks():
    with pytest.raises(ValueError, match="scale_copy"):
        GluonFp8Attention(Fp8Tiling(scale_copy="pingpong"))
    with pytest.raises(ValueError, match="PAGE=30"):
        GluonFp8Attention(Fp8Tiling(scale_copy="async"))[(1, 1, 1)](
            H=4, D=256, PAGE=30, BATCH_P2=2, NUM_SPLITS=1, BLOCK_M=128, INV_N_PER_USER=False, ROWS=31, WINDOW=0,
            CONTEXTUAL=0, FP8=1)
    launch = GluonFp8Attention(Fp8Tiling())[(1, 1, 1)]
    with pytest.raises(ValueError, match="WINDOW=512"):
        launch(H=4, D=256, PAGE=32, BATCH_P2=2, NUM_SPLITS=1, BLOCK_M=128, INV_N_PER_USER=False, ROWS=33,
               WINDOW=512, CONTEXTUAL=0, FP8=1)
    with pytest.raises(ValueError, match="FP8=0"):
        launch(H=4, D=256, PAGE=32, BATCH_P2=2, NUM_SPLITS=1, BLOCK_M=128, INV_N_PER_USER=False, ROWS=33,
               WINDOW=0, CONTEXTUAL=0, FP8=0)


def test_the_fp8_tiling_takes_the_query_block_of_the_tl_tiling():
    """PagedAttention sizes its grid from the launcher's `tiling.query_block`: the fp8 kernel keeps the tl block."""
    assert Fp8Tiling().query_block(128) == 128 and Fp8Tiling().query_block(64) == 64


def test_the_decode_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert default_fp8_tiling(256).decode == DEFAULT_DECODE == "cvt"
    monkeypatch.setenv(DECODE_ENV, "bits")
    assert default_fp8_tiling(256, 128) == Fp8Tiling(block_n=64, code_stages=1, decode="bits", silu="tanh")
    monkeypatch.setenv(DECODE_ENV, "magic")
    with pytest.raises(ValueError, match=f"{DECODE_ENV}='magic'"):
        select_fp8_kernel("auto", CPU, torch.bfloat16, E4M3, 256, 128, 0, 0)


def test_a_bf16_model_decodes_by_bit_moves_and_an_fp16_one_by_the_conversion(monkeypatch):
    """The "bits" decode writes bf16 tiles: it is the default for bf16 models only; $LAYERFLOW_FP8_DECODE wins."""
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert default_fp8_tiling(256, 128, dtype=torch.bfloat16).decode == "bits"
    assert default_fp8_tiling(256, 128, dtype=torch.float16).decode == "cvt"
    assert default_fp8_tiling(256, 128).decode == DEFAULT_DECODE == "cvt"
    for dtype in (torch.bfloat16, torch.float16):     # each default serves its model: only the device is missing here
        reason = fp8_unsupported_reason(CPU, dtype, E4M3, 256, 128, 0, 0, default_fp8_tiling(256, 128, dtype=dtype))
        assert reason is not None and "sm_90" in reason
    monkeypatch.setenv(DECODE_ENV, "cvt")
    assert default_fp8_tiling(256, 128, dtype=torch.bfloat16).decode == "cvt"


def test_fp8_qk_drops_the_bf16_query_block_and_k_slots_for_e4m3_terms_and_codes():
    # qk "fp8x2": two e4m3 terms of 128 x 256 with 128 row scales each; per slot 64 x 256 K codes, bf16 V and 64 key
    # scales
    base = Fp8Tiling(block_n=64, code_stages=1)
    codes = 32768 + 512
    expected = 2 * 128 * 260 + 2 * (16384 + 32768 + 256) + codes + 2048
    assert fp8_shared_memory_bytes(128, 256, Fp8Tiling(**{**base.__dict__, "qk": "fp8x2"})) == expected
    assert fp8_shared_memory_bytes(128, 256, base) == 65536 + 2 * 65536 + codes + 2048


def test_qk_comes_from_the_environment_and_defaults_to_fp8x2_over_e4m3_pages(monkeypatch):
    monkeypatch.delenv(QK_ENV, raising=False)
    assert DEFAULT_QK == "bf16" and default_fp8_tiling(256, 128, 32, torch.bfloat16).qk == "bf16"
    tiling = default_fp8_tiling(256, 128, 32, torch.bfloat16, E4M3)
    assert E4M3_QK == "fp8x2" == tiling.qk and (tiling.block_n, tiling.code_stages) == (64, 1)
    assert default_fp8_tiling(256, 64, 32, torch.bfloat16, E4M3).code_stages == 2
    monkeypatch.setenv(QK_ENV, "bf16")
    assert default_fp8_tiling(256, 128, 32, torch.bfloat16, E4M3).qk == "bf16"
    monkeypatch.setenv(QK_ENV, "fp8x2")
    assert default_fp8_tiling(256, 128, 32, torch.bfloat16).qk == "fp8x2"
    monkeypatch.setenv(QK_ENV, "int8")
    with pytest.raises(ValueError, match="LAYERFLOW_FP8_QK='int8'"):
        default_fp8_tiling(256, 128, 32, torch.bfloat16)


@pytest.mark.parametrize("choice", ["auto", "gluon"])
def test_e5m2_pages_keep_the_bf16_qk_unless_fp8x2_is_asked_for_by_name(monkeypatch, choice):
    monkeypatch.delenv(QK_ENV, raising=False)
    assert default_fp8_tiling(256, 128, 32, torch.bfloat16, E5M2).qk == "bf16"
    reason = fp8_unsupported_reason(CPU, torch.bfloat16, E5M2, 256, 128, 0, 0,
                                    default_fp8_tiling(256, 128, 32, torch.bfloat16, E5M2), 32)
    assert "e4m3" not in reason and "needs a CUDA sm_90 GPU" in reason
    monkeypatch.setenv(QK_ENV, "fp8x2")
    with pytest.raises(ValueError, match=r"\$LAYERFLOW_FP8_QK='fp8x2' over torch.float8_e5m2 pages"):
        select_fp8_kernel(choice, CPU, torch.bfloat16, E5M2, 256, 128, 0, 0, page_size=32)
