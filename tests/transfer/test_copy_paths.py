"""The copy paths of the CUDA engine: the 3D batch's op layout (against cuda.bindings' own struct), the path chosen by
$LAYERFLOW_COPY_PATH, and on the GPU every path byte-exact on fragmented placements, signals after their layer."""

import ctypes

import numpy as np
import pytest
import torch
from cuda.bindings import runtime as rt

from layerflow.config import SignalMode
from layerflow.transfer import cudart
from layerflow.transfer.copy_plan import plan_runs
from layerflow.transfer.cuda_copy import (COPY_PATH_ENV, CopyPath, configured_path,
                                         resolved_path)
from layerflow.transfer.signals import make_signals
from tests.transfer.pages import check_offload_of_new_contents, check_onboarded, make_tensors


def test_an_op_record_has_the_runtime_struct_layout():
    """Fields set through cuda.bindings' cudaMemcpy3DBatchOp read back from its raw bytes through BATCH_OP_3D."""
    op = rt.cudaMemcpy3DBatchOp()
    op.src.type = rt.cudaMemcpy3DOperandType.cudaMemcpyOperandTypePointer
    op.src.op.ptr.ptr, op.src.op.ptr.rowLength, op.src.op.ptr.layerHeight = 0x1234_5678_9ABC, 4096, 7
    op.dst.op.ptr.ptr, op.dst.op.ptr.rowLength = 0xDEAD_BEEF, 512
    op.dst.op.ptr.locHint.id = 3
    op.extent.width, op.extent.height, op.extent.depth = 512, 16, 1
    op.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    op.flags = 5
    raw = ctypes.string_at(op.getPtr(), ctypes.sizeof(cudart.Memcpy3DBatchOp))
    record = np.frombuffer(raw, dtype=cudart.BATCH_OP_3D)[0]
    assert cudart.BATCH_OP_3D.itemsize == 112
    assert record["src"]["type"] == cudart.OPERAND_POINTER
    assert (record["src"]["ptr"], record["src"]["rowLength"], record["src"]["layerHeight"]) == (0x1234_5678_9ABC,
                                                                                               4096, 7)
    assert (record["dst"]["ptr"], record["dst"]["rowLength"], record["dst"]["locHint"]["id"]) == (0xDEAD_BEEF, 512, 3)
    assert tuple(record["extent"]) == (512, 16, 1)
    assert (record["srcAccessOrder"], record["flags"]) == (cudart.SRC_ORDER_STREAM, 5)


def test_pitched_ops_describe_each_run_as_rows_of_one_page():
    dsts = np.array([[1000, 2000], [3000, 4000]], dtype=np.uint64)
    srcs = dsts + np.uint64(10**6)
    rows = np.broadcast_to(np.array([3, 1], dtype=np.uint64), dsts.shape)
    ops = cudart.pitched_ops(dsts, 64, srcs, 256, 64, rows)
    assert ops.shape == (2, 2)
    assert ops["dst"]["ptr"].tolist() == dsts.tolist() and ops["src"]["ptr"].tolist() == srcs.tolist()
    assert (ops["dst"]["rowLength"] == 64).all() and (ops["src"]["rowLength"] == 256).all()
    assert ops["extent"]["height"].tolist() == [[3, 1], [3, 1]]
    assert (ops["extent"]["width"] == 64).all() and (ops["extent"]["depth"] == 1).all()
    assert (ops["src"]["type"] == cudart.OPERAND_POINTER).all() and (ops["dst"]["type"] == cudart.OPERAND_POINTER).all()
    assert (ops["srcAccessOrder"] == cudart.SRC_ORDER_STREAM).all()


def test_a_pitched_table_refilled_holds_what_a_fresh_table_would():
    """Refilled for a second transfer of the same shape, every field equals `pitched_ops`' for that transfer."""
    table = cudart.PitchedTable((2, 3), 64, 256, 64)
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        dsts = rng.integers(1, 2**40, (2, 3), dtype=np.uint64)
        srcs = rng.integers(1, 2**40, (2, 3), dtype=np.uint64)
        run_len = rng.integers(1, 9, 3).astype(np.int64)
        got = table.fill(dsts, srcs, run_len)
        want = cudart.pitched_ops(dsts, 64, srcs, 256, 64, np.broadcast_to(run_len.astype(np.uint64), (2, 3)))
        assert got.tobytes() == want.tobytes(), seed


@pytest.mark.parametrize("value,path", [(None, CopyPath.AUTO), ("run_batch", CopyPath.RUN_BATCH),
                                        (" PAGES ", CopyPath.PAGES), ("runs", CopyPath.RUNS)])
def test_the_copy_path_comes_from_the_environment(monkeypatch, value, path):
    if value is None:
        monkeypatch.delenv(COPY_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(COPY_PATH_ENV, value)
    assert configured_path() is path


def test_a_bad_copy_path_is_named(monkeypatch):
    monkeypatch.setenv(COPY_PATH_ENV, "3d")
    with pytest.raises(ValueError, match=r"LAYERFLOW_COPY_PATH='3d': expected one of .*'run_batch'"):
        configured_path()


def test_run_batch_is_taken_for_every_placement():
    assert all(resolved_path(CopyPath.RUN_BATCH, n) is CopyPath.RUN_BATCH for n in (0, 1, 2, 200))


def runs_of(n: int, run: int, gap: int, start: int = 0) -> np.ndarray:
    i = np.arange(n)
    return start + i + (i // run) * gap


# 4K-user-like placements (in pages) at test size: runs of 1, 4, 16 and 32 pages, and runs of differing lengths whose GPU and host runs break at different pages.
FRAGMENTED = {
    "runs1": (runs_of(64, 1, 1), runs_of(64, 1, 1, start=3)),
    "runs4": (runs_of(64, 4, 3), runs_of(64, 4, 1, start=5)),
    "runs16": (runs_of(64, 16, 5), runs_of(64, 16, 2)),
    "runs32": (runs_of(64, 32, 2), runs_of(64, 32, 7, start=1)),
    "mixed": (np.r_[40:41, 0:30, 100:133], np.r_[0:20, 150:161, 60:93]),
}


def test_the_placements_are_fragmented_as_named():
    assert [plan_runs(*FRAGMENTED[name]).num_runs for name in ("runs1", "runs4", "runs16", "runs32")] == [64, 16, 4,
                                                                                                         2]
    assert plan_runs(*FRAGMENTED["mixed"]).run_len.tolist() == [1, 19, 11, 33]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["RUN_BATCH", "PAGES", "RUNS"])
@pytest.mark.parametrize("placement", FRAGMENTED)
def test_a_fragmented_placement_moves_byte_exact_with_each_layer_signalled_after_its_copies(placement, path):
    """Onboarded with an eventfd counter, each layer's pages hold the host bytes once its signal fired (every layer
    is checked as soon as it is released, later layers possibly still in flight); then offloaded back, byte-exact."""
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    pages, blocks = (a.tolist() for a in FRAGMENTED[placement])
    engine = CudaCopyEngine(path=CopyPath[path])
    ring = make_signals(SignalMode.EVENTFD, 6, num_counters=2)
    try:
        gpu, host = make_tensors("cuda", pages=160, blocks=170, layers=6, page=32, heads=4, dim=64,
                                 dtype=torch.bfloat16)
        handle = ring.acquire()
        transfer = engine.onboard(gpu, host, pages, blocks, handle)
        for layer in range(6):
            handle.wait_layer(layer)
            got = gpu[layer].cpu()
            assert all(torch.equal(got[p], host[b, layer]) for p, b in zip(pages, blocks)), (layer, path)
        transfer.wait(10)
        handle.release()
        check_onboarded(gpu, host, pages, blocks)
        check_offload_of_new_contents(engine, gpu, host, pages, blocks)
    finally:
        ring.close()
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["runs1", "mixed"])
def test_run_batch_transfers_refilling_one_op_table_are_byte_exact(placement):
    """RUN_BATCH's offloads of one placement, twice on one engine (the second refills the first's op table), after
    its onboarding: byte-exact each time."""
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    pages, blocks = (a.tolist() for a in FRAGMENTED[placement])
    engine = CudaCopyEngine(path=CopyPath.RUN_BATCH)
    try:
        gpu, host = make_tensors("cuda", pages=160, blocks=170, layers=4, page=32, heads=2, dim=64,
                                 dtype=torch.bfloat16, seed=7)
        engine.onboard(gpu, host, pages, blocks).wait(10)
        check_onboarded(gpu, host, pages, blocks)
        for _ in range(2):
            check_offload_of_new_contents(engine, gpu, host, pages, blocks)
    finally:
        engine.close()


@pytest.mark.gpu
def test_run_batch_writes_the_same_bytes_as_the_page_batch():
    """Both paths onboard one placement into their own pools and offload it into their own host copies: equal."""
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    pages, blocks = (a.tolist() for a in FRAGMENTED["mixed"])
    results = []
    for path in (CopyPath.PAGES, CopyPath.RUN_BATCH):
        engine = CudaCopyEngine(path=path)
        try:
            gpu, host = make_tensors("cuda", pages=160, blocks=170, layers=3, page=32, heads=2, dim=64,
                                     dtype=torch.bfloat16, seed=4)
            engine.onboard(gpu, host, pages, blocks).wait(10)
            torch.manual_seed(5)
            for layer in gpu:
                layer[pages[0]].copy_(torch.randn(layer[0].shape, device="cuda"))
            engine.offload(gpu, host, pages, blocks).wait(10)
            results.append(([layer.cpu() for layer in gpu], host.clone()))
        finally:
            engine.close()
    (gpu_a, host_a), (gpu_b, host_b) = results
    assert all(torch.equal(a, b) for a, b in zip(gpu_a, gpu_b)) and torch.equal(host_a, host_b)
