"""The offload gate (transfer/offload_gate.py): selected by the environment; on the GPU an offload issued while the
gate is closed stays on the device until it opens (by `release_offloads`, or by a host wait on it), then lands byte
exact; an offload issued while it is open is not held."""

import time

import pytest
import torch

from layerflow.transfer.offload_gate import GATE_ENV, configured_gate
from tests.transfer.pages import check_offloaded, make_tensors


def test_the_gate_comes_from_the_environment_and_a_bad_setting_is_named(monkeypatch):
    monkeypatch.delenv(GATE_ENV, raising=False)
    assert configured_gate() is False
    monkeypatch.setenv(GATE_ENV, " ON")
    assert configured_gate() is True
    monkeypatch.setenv(GATE_ENV, "yes")
    with pytest.raises(ValueError, match="LAYERFLOW_OFFLOAD_GATE='yes'"):
        configured_gate()


def _gated_engine(monkeypatch):
    from layerflow.transfer.cuda_copy import CudaCopyEngine

    monkeypatch.setenv(GATE_ENV, "on")
    return CudaCopyEngine()


def _offload(engine, seed):
    gpu, host = make_tensors("cuda", seed=seed)
    for layer in gpu:
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(seed)))
    before = host.clone()
    return gpu, host, before, engine.offload(gpu, host, [1, 2, 5], [4, 5, 9])


@pytest.mark.gpu
def test_a_held_offload_lands_only_once_the_gate_opens(monkeypatch):
    engine = _gated_engine(monkeypatch)
    try:
        engine.hold_offloads()
        gpu, host, before, transfer = _offload(engine, seed=1)
        time.sleep(0.05)
        assert not transfer.done() and torch.equal(host, before)
        engine.release_offloads()
        deadline = time.monotonic() + 5
        while not transfer.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert transfer.done() and transfer.error is None
        check_offloaded(gpu, host, before, [1, 2, 5], [4, 5, 9])
        gpu, host, before, transfer = _offload(engine, seed=2)   # the gate is open: not held
        transfer.wait(5)
        check_offloaded(gpu, host, before, [1, 2, 5], [4, 5, 9])
    finally:
        engine.close()


@pytest.mark.gpu
def test_waiting_for_a_held_offload_opens_the_gate(monkeypatch):
    engine = _gated_engine(monkeypatch)
    try:
        for seed in (3, 4):   # a second epoch after the first one was opened by the wait
            engine.hold_offloads()
            gpu, host, before, transfer = _offload(engine, seed)
            transfer.wait(5)
            check_offloaded(gpu, host, before, [1, 2, 5], [4, 5, 9])
    finally:
        engine.close()
