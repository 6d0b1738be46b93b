"""The native event spin (runtime/completion.py): it answers with the query's status, never before it stops
answering 'not ready', and gives up at its timeout. The query here is a C callback standing in for cudaEventQuery."""

import ctypes
import time

import pytest

from layerflow.runtime.completion import NOT_READY, spin_event

QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def scripted(answers):
    """A query answering `answers` in turn (the last one from then on), recording the events it was asked about."""
    asked = []

    @QUERY
    def query(event):
        asked.append(event)
        return answers[min(len(asked), len(answers)) - 1]

    return query, asked


def address(query) -> int:
    return ctypes.cast(query, ctypes.c_void_p).value


def test_the_spin_returns_once_the_event_completed():
    query, asked = scripted([NOT_READY, NOT_READY, NOT_READY, 0])
    assert spin_event(address(query), 0x1234, 5.0) == 0
    assert asked == [0x1234] * 4


def test_a_failed_query_ends_the_spin_with_its_status():
    query, asked = scripted([NOT_READY, 700])
    assert spin_event(address(query), 8, 5.0) == 700
    assert len(asked) == 2


def test_the_spin_gives_up_at_its_timeout():
    query, asked = scripted([NOT_READY])
    start = time.monotonic()
    assert spin_event(address(query), 8, 0.02) == NOT_READY
    assert len(asked) > 1 and time.monotonic() - start >= 0.02


@pytest.mark.parametrize("query_address,timeout,match", [(0, 1.0, "query_address=0"), (1, -1.0, "timeout_s=-1.0")])
def test_bad_arguments_are_named(query_address, timeout, match):
    with pytest.raises(ValueError, match=match):
        spin_event(query_address, 8, timeout)
