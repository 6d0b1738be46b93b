"""Which attention kernel a PagedAttention runs: the Gluon kernel's shape rules, the argument and the environment
variable, and the `tl` fallback wherever Gluon cannot run (this CPU)."""

import pytest
import torch

from layerflow.kernels import PagedAttention
from layerflow.kernels.gluon_attention import (GLUON_VARIANTS, KERNEL_ENV, GluonAttention, GluonTiling,
                                               default_gluon_tiling, select_kernel, shared_memory_bytes,
                                               tiling_reason, unsupported_reason)

CPU = torch.device("cpu")


def attention(**kwargs) -> PagedAttention:
    return PagedAttention(2, 64, 4, 2, 64, 16, torch.float32, "cpu", 0.125, 128, **kwargs)


@pytest.mark.parametrize("dtype, kv_dtype, head_dim, block_m, window, contextual, tiling, words", [
    (torch.float32, None, 128, 64, 0, 0, GluonTiling(), "bf16/fp16"),
    (torch.bfloat16, torch.float8_e4m3fn, 128, 64, 0, 0, GluonTiling(), "bf16/fp16"),
    (torch.bfloat16, None, 128, 64, 512, 0, GluonTiling(), "default mask"),
    (torch.float16, None, 128, 64, 0, 3, GluonTiling(), "default mask"),
    (torch.bfloat16, None, 128, 32, 0, 0, GluonTiling(), "block_m=32"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(block_n=16), "block_n"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(stages=1), "stages"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(variant="pingpong"), "variant"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(variant="async"), "variant"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(block_m=32), "block_m must be"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(variant="ws"), "variant"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(variant="pv", loader="dma"), "loader one of"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(unmasked_whole_tiles=True), "need variant 'pv'"),
    (torch.bfloat16, None, 128, 64, 0, 0, GluonTiling(loader="tma"), "need variant 'pv'"),
    (torch.bfloat16, None, 256, 128, 0, 0, GluonTiling(block_n=64, stages=3), "shared memory"),
    (torch.bfloat16, None, 256, 64, 0, 0, GluonTiling(block_n=64, stages=3, block_m=128), "shared memory"),
    (torch.bfloat16, None, 256, 128, 0, 0, GluonTiling(block_n=32, stages=3), "sm_90"),
    (torch.bfloat16, None, 256, 64, 0, 0, GluonTiling(64, 3, "pv", loader="tma"), "sm_90"),
    (torch.bfloat16, None, 256, 128, 0, 0, GluonTiling(32, 4, "pv", loader="tma", tanh_silu=True), "sm_90"),
    (torch.bfloat16, None, 256, 128, 0, 0, GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True,
                                                       unmasked_whole_tiles=True), "sm_90"),
    (torch.bfloat16, None, 256, 128, 0, 0, GluonTiling(64, 3, "pv", loader="tma"), "shared memory"),
])
def test_unsupported_reason_names_the_first_rule_broken(dtype, kv_dtype, head_dim, block_m, window, contextual,
                                                        tiling, words):
    reason = unsupported_reason(CPU, dtype, kv_dtype, head_dim, block_m, window, contextual, tiling)
    assert reason is not None and words in reason


def test_shared_memory_counts_the_query_block_and_the_ring():
    assert shared_memory_bytes(128, 256, GluonTiling(block_n=32, stages=3)) == (128 + 192) * 512 + 2048


def test_auto_and_triton_take_the_tl_kernel_on_the_cpu(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert attention().gluon is None
    assert attention(kernel="triton").gluon is None
    assert select_kernel("auto", CPU, torch.bfloat16, None, 128, 64, 0, 0) is None


def test_forcing_gluon_where_it_cannot_run_says_why(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    with pytest.raises(ValueError, match="kernel='gluon'.*bf16/fp16"):
        attention(kernel="gluon")
    with pytest.raises(ValueError, match="sm_90"):
        select_kernel("gluon", CPU, torch.bfloat16, None, 128, 64, 0, 0)


def test_the_environment_variable_chooses_when_the_argument_does_not(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="kernel='gluon'"):
        attention()
    assert attention(kernel="triton").gluon is None
    monkeypatch.setenv(KERNEL_ENV, "triton")
    assert attention().gluon is None


def test_an_unknown_kernel_name_is_refused(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    with pytest.raises(ValueError, match="kernel='cutlass'"):
        attention(kernel="cutlass")
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="kernel='fast'"):
        attention()


def test_the_gluon_launcher_refuses_the_masks_it_does_not_compute():
    with pytest.raises(ValueError, match="WINDOW=512"):
        GluonAttention(GluonTiling())[(1, 1, 1)](H=1, D=64, PAGE=16, BATCH_P2=2, NUM_SPLITS=1, BLOCK_M=64,
                                                 INV_N_PER_USER=False, ROWS=16, WINDOW=512, CONTEXTUAL=0, FP8=0)


@pytest.mark.parametrize("tiling", [GluonTiling(variant="WS"), GluonTiling(stages=3, variant="async")])
def test_a_launcher_of_a_bad_variant_is_refused(tiling):
    with pytest.raises(ValueError, match="variant"):
        GluonAttention(tiling)


@pytest.mark.parametrize("registers", [20, 100, 264])
def test_a_launcher_of_a_bad_loader_register_count_is_refused(registers):
    with pytest.raises(ValueError, match=f"producer_registers.*{registers}|{registers}.*producer_registers"):
        GluonAttention(GluonTiling(64, 2, "pv", producer_registers=registers))


@pytest.mark.parametrize("variant", GLUON_VARIANTS)
def test_every_variant_is_a_valid_tiling_at_three_stages(variant):
    assert GluonAttention(GluonTiling(32, 3, variant)).tiling.variant == variant


def test_the_default_for_256_wide_heads_is_pv2_64x2_with_tma_where_pages_allow_tanh_silu_and_unmasked_whole_tiles():
    assert default_gluon_tiling(256) == GluonTiling(block_n=64, stages=2, variant="pv2", loader="tma",
                                                    tanh_silu=True, unmasked_whole_tiles=True, self_last=True,
                                                    m64_fill=2 / 3)
    assert default_gluon_tiling(256, page_size=32).loader == "tma"
    assert default_gluon_tiling(256, page_size=16) == GluonTiling(block_n=64, stages=2, variant="pv2", tanh_silu=True,
                                                                  unmasked_whole_tiles=True, self_last=True,
                                                                  m64_fill=2 / 3)
    assert default_gluon_tiling(128) == GluonTiling(block_n=64, stages=3, variant="sync", self_last=True)


def test_the_tma_loader_is_refused_for_pages_shorter_than_half_a_tile():
    tma = GluonTiling(64, 2, "pv", loader="tma")
    reason = unsupported_reason(CPU, torch.bfloat16, None, 256, 64, 0, 0, tma, page_size=16)
    assert reason is not None and "page_size=16" in reason
    assert "sm_90" in unsupported_reason(CPU, torch.bfloat16, None, 256, 64, 0, 0, tma, page_size=32)


def test_the_tanh_silu_is_an_option_of_every_variant():
    for tiling in (GluonTiling(64, 3, tanh_silu=True), GluonTiling(64, 2, "pv", loader="tma", tanh_silu=True)):
        assert tiling_reason(tiling) is None


@pytest.mark.parametrize("fill", [0, -0.5, 1.5])
def test_a_wave_fill_outside_0_1_is_refused(fill):
    with pytest.raises(ValueError, match="m64_fill"):
        GluonAttention(GluonTiling(64, 2, "pv2", m64_fill=fill))


def test_the_wave_fill_applies_to_64_row_blocks_only():
    launcher = GluonAttention(GluonTiling(64, 2, "pv2", m64_fill=0.5))
    assert launcher.wave_fill(64) == 0.5 and launcher.wave_fill(128) == 1.0


def test_the_query_block_is_the_tilings_own_else_the_tl_tilings():
    assert GluonTiling().query_block(64) == 64
    assert GluonTiling(block_m=128).query_block(64) == 128


def test_the_tma_loader_refuses_pages_shorter_than_half_a_tile():
    launcher = GluonAttention(GluonTiling(64, 2, "pv", loader="tma"))
    with pytest.raises(ValueError, match="page_size=16"):
        launcher[(1, 1, 1)](*[None] * 17, H=1, D=64, PAGE=16, BATCH_P2=2, NUM_SPLITS=1, BLOCK_M=64,
                            INV_N_PER_USER=False, ROWS=16, WINDOW=0, CONTEXTUAL=0, FP8=0)
