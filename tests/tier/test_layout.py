import pytest
import torch

from layerflow.model.config import HSTUConfig
from layerflow.tier.layout import KVLayout, LayerGroup


def test_hstu_benchmark_model_sizes():
    layout = KVLayout.for_hstu(HSTUConfig(), page_size=32)
    assert layout.num_layers == 8
    assert len(layout.groups) == 1
    assert layout.gpu_page_shape(0) == (2, 32, 4, 256)
    assert layout.host_block_shape(0) == (8, 2, 32, 4, 256)
    # 4 KiB per token per layer (design.md), 32 tokens per page.
    assert layout.layer_page_bytes(0) == 32 * 4096
    assert layout.block_bytes(0) == 8 * 32 * 4096
    assert layout.host_pitch(0) == 8 * 32 * 4096
    assert layout.page_bytes == 8 * 32 * 4096
    # A 16K-token user holds 512 MiB over 8 layers.
    assert layout.pages_for_tokens(16384) * layout.page_bytes == 512 * 2**20


def test_sizes_match_real_tensors():
    layout = KVLayout((LayerGroup(3, 2, 8, torch.float16), LayerGroup(2, 1, 4, torch.float32)), page_size=4)
    for gi in range(2):
        page = torch.empty(layout.gpu_page_shape(gi), dtype=layout.groups[gi].dtype)
        block = torch.empty(layout.host_block_shape(gi), dtype=layout.groups[gi].dtype)
        assert page.numel() * page.element_size() == layout.layer_page_bytes(gi)
        assert block.numel() * block.element_size() == layout.block_bytes(gi)
        host = torch.empty((5, *layout.host_block_shape(gi)), dtype=layout.groups[gi].dtype)
        assert host.stride(0) * host.element_size() == layout.host_pitch(gi)
        assert host.stride(1) * host.element_size() == layout.layer_page_bytes(gi)
    assert layout.page_bytes == layout.block_bytes(0) + layout.block_bytes(1)


def test_multi_group_layer_map():
    layout = KVLayout((LayerGroup(3, 2, 8, "bfloat16"), LayerGroup(2, 1, 4, "float32")), page_size=4)
    assert layout.num_layers == 5
    assert layout.layer_map == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1))
    assert layout.locate(3) == (1, 0)
    assert layout.groups[0].dtype == torch.bfloat16
    for bad in (-1, 5, 1.0, True):
        with pytest.raises(ValueError, match="layer"):
            layout.locate(bad)


def test_pages_for_tokens_and_gb():
    layout = KVLayout((LayerGroup(1, 1, 1, torch.float32),), page_size=4)
    assert [layout.pages_for_tokens(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert layout.page_bytes == 2 * 4 * 4
    assert layout.pages_for_gb(1) == 2**30 // 32
    with pytest.raises(ValueError, match="num_tokens"):
        layout.pages_for_tokens(-1)
    with pytest.raises(ValueError, match="gb"):
        layout.pages_for_gb(-0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_heads=-1), "num_heads"),
        (dict(head_dim=2.0), "head_dim"),
        (dict(num_layers=True), "num_layers"),
        (dict(dtype="int8"), "dtype"),
        (dict(dtype=torch.int32), "dtype"),
    ],
)
def test_group_validation(kwargs, field):
    args = dict(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float16) | kwargs
    with pytest.raises(ValueError, match=field):
        LayerGroup(**args)


def test_layout_validation():
    group = LayerGroup(1, 1, 8, torch.float16)
    with pytest.raises(ValueError, match="page_size"):
        KVLayout((group,), page_size=0)
    with pytest.raises(ValueError, match="groups"):
        KVLayout((), page_size=16)
    with pytest.raises(ValueError, match="groups"):
        KVLayout(("not a group",), page_size=16)
    with pytest.raises(ValueError, match="dqk"):
        KVLayout.for_hstu(HSTUConfig(dqk=128, dv=256), page_size=16)


def test_frozen():
    layout = KVLayout.for_hstu(HSTUConfig(), page_size=32)
    with pytest.raises(AttributeError):
        layout.page_size = 16


def test_group_ranges_cover_the_layers_in_order():
    layout = KVLayout((LayerGroup(3, 2, 8, "bfloat16"), LayerGroup(2, 1, 4, "float32")), page_size=4)
    assert layout.group_ranges == (range(0, 3), range(3, 5))
    assert [layout.locate(l)[0] for r in layout.group_ranges for l in r] == [0, 0, 0, 1, 1]


def test_fp8_layout_of_the_benchmark_model():
    """One scale row per page half: 33 rows of 4 x 256 bytes, 0.52x the bf16 page, with uint8 page tensors."""
    layout = KVLayout.for_hstu(HSTUConfig(), page_size=32, kv_cache_dtype="fp8_e4m3")
    group = layout.groups[0]
    assert group.dtype == torch.float8_e4m3fn and group.quantised and group.fp8_dtype == torch.float8_e4m3fn
    assert group.storage_dtype == torch.uint8
    assert layout.gpu_page_shape(0) == (2, 33, 4, 256)
    assert layout.host_block_shape(0) == (8, 2, 33, 4, 256)
    assert layout.layer_page_bytes(0) == 2 * 33 * 1024
    bf16 = KVLayout.for_hstu(HSTUConfig(), page_size=32)
    assert layout.page_bytes / bf16.page_bytes == 33 / 64
    assert bf16.groups[0].fp8_dtype is None and bf16.groups[0].storage_dtype == torch.bfloat16
    assert KVLayout.for_hstu(HSTUConfig(), 32, "fp8_e5m2").groups[0].dtype == torch.float8_e5m2


def test_fp8_sizes_match_real_tensors_and_names():
    layout = KVLayout((LayerGroup(3, 2, 8, "float8_e4m3fn"), LayerGroup(2, 1, 4, torch.float8_e5m2)), page_size=16)
    assert [layout.groups[g].scale_rows(16) for g in range(2)] == [2, 4]
    for gi in range(2):
        host = torch.empty((5, *layout.host_block_shape(gi)), dtype=layout.groups[gi].storage_dtype)
        assert host[0, 0].numel() * host.element_size() == layout.layer_page_bytes(gi)
        assert host.stride(0) * host.element_size() == layout.host_pitch(gi)
    assert layout != KVLayout((LayerGroup(3, 2, 8, torch.float8_e5m2), LayerGroup(2, 1, 4, torch.float8_e5m2)), 16)
