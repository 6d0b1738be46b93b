"""SplitWorkspace: attentions built with one share its buffer; a larger need gets a new buffer and leaves the views
already handed out (and the graphs captured with them) on the old one."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.kernels import PagedAttention  # noqa: E402
from layerflow.kernels.attention import AttentionTiling  # noqa: E402
from layerflow.kernels.workspace import SplitWorkspace  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_views_share_the_buffer_and_growth_keeps_old_views():
    workspace = SplitWorkspace(DEVICE)
    small = workspace.view((2, 3))
    smaller = workspace.view((5,))
    assert small.data_ptr() == smaller.data_ptr() and workspace.nbytes == 6 * 4
    small.fill_(1.0)
    large = workspace.view((4, 4))
    assert large.data_ptr() != small.data_ptr() and workspace.nbytes == 16 * 4
    assert torch.equal(small, torch.ones(2, 3, device=DEVICE))     # the old buffer lives on in its views
    assert workspace.view((13,)).data_ptr() == large.data_ptr()
    assert workspace.view((17,)).numel() == 17 and workspace.nbytes == 32 * 4   # at least doubled


def test_a_buffer_sized_up_front_serves_views_up_to_it():
    workspace = SplitWorkspace(DEVICE, 12)
    assert workspace.nbytes == 12 * 4
    assert workspace.view((3, 4)).data_ptr() == workspace.view((5,)).data_ptr() and workspace.nbytes == 12 * 4


@pytest.mark.parametrize("numel", [-1, 2.0, True])
def test_bad_size_is_named(numel):
    with pytest.raises(ValueError, match="numel="):
        SplitWorkspace(DEVICE, numel)


@pytest.mark.parametrize("shape", [(0, 2), (2, -1), (1.5,), (True, 2)])
def test_bad_shape_is_named(shape):
    with pytest.raises(ValueError, match="shape="):
        SplitWorkspace(DEVICE).view(shape)


def test_attentions_of_two_buckets_put_their_partials_in_one_buffer():
    workspace = SplitWorkspace(DEVICE)
    tiling = AttentionTiling(16, 16, 4, 1, num_splits=3)
    big, small = (PagedAttention(b, t, 4, 2, 64, 16, torch.float32, DEVICE, 0.125, 256, tiling=tiling,
                                 workspace=workspace) for b, t in ((4, 256), (1, 64)))
    assert big.partials.shape == (3, 256, 2, 64) and small.partials.shape == (3, 64, 2, 64)
    assert big.partials.data_ptr() == small.partials.data_ptr() and workspace.nbytes == big.partials.nbytes
    own = PagedAttention(1, 64, 4, 2, 64, 16, torch.float32, DEVICE, 0.125, 256, tiling=tiling)
    assert own.partials.data_ptr() != small.partials.data_ptr()
