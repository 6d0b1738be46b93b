"""The done word's wait (runtime/done_word.py): the spin sees a word another thread sets, natively and in the Python
fallback, and gives up after its spins on a word nobody sets; on the GPU a stream that went idle without setting the
word fails the wait instead of hanging."""

import threading
import time

import pytest
import torch

from layerflow.runtime import done_word
from layerflow.runtime.done_word import spin_word


def _set_later(word: torch.Tensor, delay_s: float) -> threading.Thread:
    def set_it() -> None:
        time.sleep(delay_s)
        word[0] = 1

    thread = threading.Thread(target=set_it)
    thread.start()
    return thread


@pytest.mark.parametrize("native", [True, False])
def test_the_spin_sees_a_word_set_by_another_thread_and_gives_up_on_one_never_set(native, monkeypatch):
    if native:
        assert done_word.native_spin() is not None   # this machine has a C compiler
    else:
        monkeypatch.setattr(done_word, "native_spin", lambda: None)
    word = torch.zeros(1, dtype=torch.int32)
    assert not spin_word(word.data_ptr(), 1000)
    thread = _set_later(word, 0.02)
    start = time.monotonic()
    while not spin_word(word.data_ptr(), 1 << 16):   # the native spin drops the GIL: the setter runs meanwhile
        assert time.monotonic() - start < 5
    thread.join()
    assert word[0] == 1


@pytest.mark.gpu
def test_a_stream_idle_without_the_word_fails_the_wait():
    from layerflow.transfer.errors import TransferError

    stream = torch.cuda.Stream()
    word = done_word.DoneWord(stream.cuda_stream)
    word.clear()
    with pytest.raises(TransferError, match="went idle without setting"):
        word.wait()
    word.set_on(stream.cuda_stream)
    stream.synchronize()
    word.wait()
