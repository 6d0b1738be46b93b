"""One Gluon API per test, each as the attention kernel uses it, so a failure of the big kernel on a new Triton says
which piece broke: the slot -> (user, block) scan, async copies into a multi-stage NVMMA ring, wgmma with both
operands in shared memory (B a transposed view), and wgmma with A in registers converted from another MMA layout."""

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma

from layerflow.kernels.gluon_tiles import _user_block

pytestmark = pytest.mark.gpu

SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
ROWS_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _user_block_kernel(q_offsets_ptr, out_ptr, max_batch, BATCH_P2: gl.constexpr, BLOCK_M: gl.constexpr):
    slot = gl.program_id(0)
    user, block = _user_block(q_offsets_ptr, slot, max_batch, BATCH_P2, BLOCK_M, 4)
    gl.store(out_ptr + 2 * slot, user)
    gl.store(out_ptr + 2 * slot + 1, block)


def test_user_block_numbers_query_blocks_across_users():
    lens = [130, 0, 64, 1]
    offsets = torch.tensor([0, 130, 130, 194, 195], dtype=torch.int32, device="cuda")
    slots = 6
    out = torch.full((slots, 2), -1, dtype=torch.int32, device="cuda")
    _user_block_kernel[(slots,)](offsets, out, len(lens), BATCH_P2=4, BLOCK_M=64, num_warps=4)
    assert out.tolist()[:5] == [[0, 0], [0, 1], [0, 2], [2, 0], [3, 0]]
    assert out[5, 0].item() == len(lens)


@gluon.jit
def _ring_copy_kernel(src_ptr, dst_ptr, STAGES: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, N, D], SMEM)
    rows = gl.arange(0, N, layout=gl.SliceLayout(1, ROWS_LAYOUT))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS_LAYOUT))
    offs = rows[:, None] * D + cols[None, :]
    for stage in gl.static_range(STAGES):
        async_copy.async_copy_global_to_shared(ring.index(stage), src_ptr + stage * N * D + offs,
                                               mask=(rows < N - stage)[:, None])
        async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    for stage in gl.static_range(STAGES):
        gl.store(dst_ptr + stage * N * D + offs, ring.index(stage).load(ROWS_LAYOUT))


def test_async_copies_fill_a_ring_and_zero_masked_rows():
    stages, n, d = 3, 32, 64
    src = torch.randn(stages, n, d, device="cuda", dtype=torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    _ring_copy_kernel[(1,)](src, dst, STAGES=stages, N=n, D=d, num_warps=4)
    expected = src.clone()
    for stage in range(stages):
        expected[stage, n - stage:] = 0
    assert torch.equal(dst, expected)


@gluon.jit
def _qk_kernel(q_ptr, k_ptr, out_ptr, M: gl.constexpr, N: gl.constexpr, D: gl.constexpr,
               num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, N, 16])
    load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    qr = gl.arange(0, M, layout=gl.SliceLayout(1, load))
    kr = gl.arange(0, N, layout=gl.SliceLayout(1, load))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, load))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [M, D], SMEM, gl.load(q_ptr + qr[:, None] * D + c[None, :]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [N, D], SMEM, gl.load(k_ptr + kr[:, None] * D + c[None, :]))
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([M, N], gl.float32, s_layout), use_acc=False)
    r = gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
    gl.store(out_ptr + r[:, None] * N + n[None, :], s)


@pytest.mark.parametrize("m, num_warps", [(64, 4), (128, 8)])
def test_wgmma_of_two_shared_tiles_with_a_transposed_view(m, num_warps):
    n, d = 32, 64
    q = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda")
    _qk_kernel[(1,)](q, k, out, M=m, N=n, D=d, num_warps=num_warps)
    torch.testing.assert_close(out, q.float() @ k.float().T, atol=1e-2, rtol=1e-2)


@gluon.jit
def _pv_kernel(p_ptr, v_ptr, out_ptr, M: gl.constexpr, N: gl.constexpr, D: gl.constexpr,
               num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
    p = gl.load(p_ptr + r[:, None] * N + n[None, :])
    p = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    vr = gl.arange(0, N, layout=gl.SliceLayout(1, load))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, load))
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [N, D], SMEM, gl.load(v_ptr + vr[:, None] * D + c[None, :]))
    fence_async_shared()
    o = warpgroup_mma(p, v_smem, gl.zeros([M, D], gl.float32, o_layout))
    orow = gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + orow[:, None] * D + ocol[None, :], o)


@pytest.mark.parametrize("m, num_warps, d", [(64, 4, 256), (128, 8, 128)])
def test_wgmma_with_a_register_operand_converted_from_an_mma_layout(m, num_warps, d):
    n = 32
    p = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, d, device="cuda")
    _pv_kernel[(1,)](p, v, out, M=m, N=n, D=d, num_warps=num_warps)
    torch.testing.assert_close(out, p.float() @ v.float(), atol=1e-2, rtol=1e-2)
