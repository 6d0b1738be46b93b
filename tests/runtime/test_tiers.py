"""runtime.tiers.resolve_signal: what `signal: auto` stands for on each kind of tier and device."""

import pytest
import torch

from layerflow.config import Config, SignalMode
from layerflow.runtime.tiers import check_config, resolve_signal
from layerflow.transfer.signals import make_signals

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_is_the_default():
    assert Config().signal is SignalMode.AUTO


def test_auto_is_waitvalue_for_an_in_process_tier_on_cuda():
    assert resolve_signal(Config(), CUDA) is SignalMode.WAITVALUE


@pytest.mark.parametrize("config", [Config(spawn_server=True), Config(server_socket="/tmp/layerflow-x.sock")])
def test_auto_is_eventfd_with_a_transfer_server(config):
    assert resolve_signal(config, CUDA) is SignalMode.EVENTFD
    assert resolve_signal(config, CPU) is SignalMode.EVENTFD


def test_auto_is_eventfd_without_a_gpu():
    assert resolve_signal(Config(), CPU) is SignalMode.EVENTFD
    check_config(Config(), CPU)


@pytest.mark.parametrize("mode", [SignalMode.EVENTFD, SignalMode.EVENT, SignalMode.WAITVALUE])
def test_a_named_signal_is_kept(mode):
    assert resolve_signal(Config(signal=mode), CUDA) is mode
    assert resolve_signal(Config(signal=mode, spawn_server=True), CPU) is mode


def test_a_named_gpu_signal_is_still_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="signal='waitvalue' needs CUDA"):
        check_config(Config(signal=SignalMode.WAITVALUE), CPU)
    with pytest.raises(ValueError, match="signal='event' with a transfer server"):
        check_config(Config(signal=SignalMode.EVENT, spawn_server=True), CPU)


def test_auto_is_no_signal_ring():
    with pytest.raises(ValueError, match="mode='auto' is a choice"):
        make_signals(SignalMode.AUTO, 4)
