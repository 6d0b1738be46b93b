"""The issue worker (runtime/issuer.py) with a real eventfd signal ring: `submit` returns once the first layer is
posted, while the rest of the issue still runs on the worker; jobs run in submission order; a failure is kept."""

import threading

import pytest

from layerflow.config import SignalMode
from layerflow.runtime.issuer import IssueWorker
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals import make_signals

LAYERS = 3


@pytest.fixture
def ring():
    signals = make_signals(SignalMode.EVENTFD, LAYERS, num_counters=2, timeout_s=2.0)
    yield signals
    signals.close()


@pytest.fixture
def worker():
    issuer = IssueWorker()
    yield issuer
    issuer.close()


def test_submit_returns_after_the_first_layer_while_the_rest_is_still_issued(ring, worker):
    handle, go_on, order = ring.acquire(), threading.Event(), []

    def issue():
        handle.complete_layer(0)
        order.append(("posted", 0, threading.current_thread().name))
        go_on.wait(2.0)
        for layer in range(1, LAYERS):
            handle.complete_layer(layer)

    job = worker.submit(issue, handle)
    order.append(("returned",))
    assert not job.done() and order[0][:2] == ("posted", 0) and order[0][2] == "layerflow-onboard-issue"
    go_on.set()
    job.wait()
    handle.wait(1.0)
    assert job.done() and job.error is None
    handle.release()


def test_a_failed_issue_returns_at_once_and_keeps_its_error(ring, worker):
    handle = ring.acquire()

    def issue():
        error = TransferError("no host copy")
        handle.fail(error)
        raise error

    job = worker.submit(issue, handle)
    job.wait()
    assert isinstance(job.error, TransferError) and handle.error is job.error
    handle.release()


def test_an_issue_that_ends_without_posting_does_not_hang_submit(ring, worker):
    handle = ring.acquire()
    job = worker.submit(lambda: None, handle)
    assert job.done() and job.error is None
    handle.fail(TransferError("never issued"))
    handle.release()


def test_jobs_run_in_submission_order(ring, worker):
    handles, ran = [ring.acquire(), ring.acquire()], []

    def issue(index):
        def run():
            ran.append(index)
            for layer in range(LAYERS):
                handles[index].complete_layer(layer)
        return run

    jobs = [worker.submit(issue(i), handles[i]) for i in range(2)]
    for job in jobs:
        job.wait()
    assert ran == [0, 1]
    for h in handles:
        h.release()
