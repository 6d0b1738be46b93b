"""The fp8 Gluon kernel's q.k on fp8 MMAs (Fp8Tiling.qk "fp8x2") on an H200: the kernel's e4m3 query terms are
fp8.query_terms' bit for bit, and its attention agrees with the torch reference of the same numerics
(paged_attention_reference's q_terms) on ragged batches and BS=1 16K."""

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from layerflow.kernels import paged_attention_reference
from layerflow.kernels.fp8 import query_terms
from layerflow.kernels.gluon_fp8_tiling import QK_ENV, QK_TERMS, Fp8Tiling
from layerflow.kernels.gluon_fp8_qk import _store_query_terms
from layerflow.kernels.gluon_fp8_tiles import _code_layout, _code_smem_layout
from tests.kernels.test_gluon_fp8_gpu import E4M3, MAX_SEQ_LEN, SMALL, attention, fp8_batch, relative_error, run

pytestmark = pytest.mark.gpu

BLOCK, D = 128, 256


@gluon.jit
def _terms_of(q_ptr, codes_ptr, scales_ptr, rows, TERMS: gl.constexpr, BLOCK_M: gl.constexpr, D_: gl.constexpr,
              num_warps: gl.constexpr):
    """Block program_id's query rows ([rows, D_], one head) as the kernel's e4m3 terms: codes and row scales out."""
    layout: gl.constexpr = _code_layout(D_, num_warps)
    terms = gl.allocate_shared_memory(gl.float8e4nv, [TERMS, BLOCK_M, D_], _code_smem_layout(D_))
    scales = gl.allocate_shared_memory(gl.float32, [TERMS, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    row0 = gl.program_id(0) * BLOCK_M
    _store_query_terms(terms, scales, q_ptr, D_, 0, row0, rows, 0, D_, BLOCK_M, TERMS, layout)
    gl.thread_barrier()
    r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D_, layout=gl.SliceLayout(0, layout))
    for t in gl.static_range(TERMS):
        at = (t * rows + r)[:, None] * D_ + cols[None, :]
        gl.store(codes_ptr + at, terms.index(t).load(layout).to(gl.uint8, bitcast=True), mask=(r < rows)[:, None])
        gl.store(scales_ptr + t * rows + r, scales.index(t).load(gl.SliceLayout(1, layout)), mask=r < rows)


@pytest.mark.parametrize("terms", [1, 2])
def test_the_kernels_query_terms_are_the_references_bit_for_bit(terms):
    """Rows of very different magnitudes (2^-100 .. 2^100, a zero row) and a ragged last block."""
    rows = 3 * BLOCK - 5
    gen = torch.Generator().manual_seed(3)
    magnitude = torch.randint(-100, 100, (rows, 1), generator=gen).float().exp2()
    q = (torch.randn(rows, D, generator=gen) * magnitude).to(torch.bfloat16)
    q[7] = 0
    codes = torch.zeros(terms, rows, D, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(terms, rows, dtype=torch.float32, device="cuda")
    _terms_of[(3,)](q.cuda(), codes, scales, rows, TERMS=terms, BLOCK_M=BLOCK, D_=D, num_warps=8)
    kernel_terms = codes.cpu().view(E4M3).float() * scales.cpu()[..., None]
    for t, expected in enumerate(query_terms(q, terms)):
        assert torch.equal(kernel_terms[t], expected), f"term {t}"


def check_qk(batch, qk: str, tiling: Fp8Tiling | None = None) -> None:
    """Within bf16 rounding of the fp32 reference of the same q.k numerics over the same fp8 pages."""
    f32 = [t.float() for t in (batch.q, batch.k, batch.v)]
    kwargs = dict(alpha=D ** -0.5, max_seq_len=MAX_SEQ_LEN, kv_dtype=E4M3)

    def reference(terms: int) -> torch.Tensor:
        return paged_attention_reference(*f32, batch.kv_cache, *batch.lengths, torch.zeros_like(f32[0]),
                                         q_terms=terms, **kwargs)

    tiling = tiling or attention(batch, "gluon", D, E4M3).gluon.tiling
    out = run(batch, "gluon", D, E4M3, Fp8Tiling(**{**tiling.__dict__, "qk": qk}))
    total = batch.total_tokens
    own = relative_error(out, reference(QK_TERMS[qk]), total)
    assert own < 1e-2, own


@pytest.mark.parametrize("qk", ["fp8x2"])
def test_small_ragged_batch_matches_its_reference(qk):
    check_qk(fp8_batch(*SMALL, D, E4M3), qk, Fp8Tiling(block_n=64, code_stages=1, decode="bits"))


@pytest.mark.parametrize("qk", ["fp8x2"])
@pytest.mark.parametrize("candidates", [256, 0])
def test_bs1_16k_matches_its_reference(qk, candidates):
    check_qk(fp8_batch([16384 + 64], [64], [candidates], D, E4M3), qk)


def test_the_environment_selects_fp8_qk(monkeypatch):
    monkeypatch.setenv(QK_ENV, "fp8x2")
    batch = fp8_batch([2048 + 64], [64], [256], D, E4M3)
    assert attention(batch, "gluon", D, E4M3).gluon.tiling.qk == "fp8x2"
