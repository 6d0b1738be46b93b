"""Who answers: jobs run in post order, inline or on the answering thread; an AsyncEngine answering on that thread
gives the sequential scores, keeps each user's answers in arrival order, fails only the failing request and answers
everything queued before `close` returns."""

import threading

import pytest
import torch

from layerflow.runtime.request import Request
from layerflow.serving.answers import ANSWERS_ENV, Answers, answer_mode
from layerflow.serving.async_engine import AsyncEngine
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine
from tests.serving.helpers import TOL, WAIT_S, HeldEngine, config, sequential_scores, visits


def test_a_threaded_answerer_runs_jobs_in_post_order_off_the_posting_thread_and_drains_at_close():
    answers = Answers("thread")
    gate = threading.Event()
    ran: list[tuple[int, str]] = []
    answers.post(gate.wait)
    for i in range(50):
        answers.post(lambda i=i: ran.append((i, threading.current_thread().name)))
    answers.post(lambda: 1 / 0)          # a broken job is logged; the next ones still run
    answers.post(lambda: ran.append((50, threading.current_thread().name)))
    assert ran == []                     # held behind the gate: nothing ran on the posting thread
    gate.set()
    answers.close()
    assert [i for i, _ in ran] == list(range(51))
    assert {name for _, name in ran} == {"layerflow-answers"}
    answers.post(lambda: ran.append((51, threading.current_thread().name)))   # after close: at once, here
    assert ran[-1] == (51, threading.current_thread().name)


def test_an_inline_answerer_runs_each_job_at_once():
    ran = []
    answers = Answers("inline")
    answers.post(ran.append, 1)
    assert ran == [1]
    answers.close()


def test_the_answer_mode_comes_from_the_argument_then_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv(ANSWERS_ENV, raising=False)
    assert answer_mode(None) == "inline"
    monkeypatch.setenv(ANSWERS_ENV, "thread")
    assert answer_mode(None) == "thread"
    assert answer_mode("inline") == "inline"
    monkeypatch.setenv(ANSWERS_ENV, "later")
    with pytest.raises(ValueError, match="LAYERFLOW_SERVE_ANSWERS='later'"):
        answer_mode(None)
    with pytest.raises(ValueError, match="answers='sideways'"):
        answer_mode("sideways")
    with pytest.raises(ValueError, match="mode='sideways'"):
        Answers("sideways")


def test_answers_on_their_thread_give_the_sequential_scores_in_each_users_arrival_order(weights):
    hot = [Request(7, [i, i + 1], [i + 2, 3]) for i in range(8)]
    others = visits(seed=5, users=[1, 2, 3], rounds=4)
    stream = [r for pair in zip(hot, others) for r in pair] + others[len(hot):]
    expected = sequential_scores(weights, stream)
    answered: list[tuple[Request, str]] = []
    with HeldEngine(weights, config(serve_max_batch_size=4)) as engine, \
            AsyncEngine(engine, answers="thread") as serving:
        engine.launch_gate.close()
        futures = [serving.submit(r) for r in stream]
        for r, f in zip(stream, futures):
            f.add_done_callback(lambda _, r=r: answered.append((r, threading.current_thread().name)))
        assert engine.launch_gate.entered.wait(WAIT_S)
        engine.launch_gate.open()
        scores = [f.result(WAIT_S).scores for f in futures]
    assert all(torch.allclose(s, e, atol=TOL, rtol=TOL) for s, e in zip(scores, expected))
    assert [r for r, _ in answered if r.user_id == 7] == hot
    assert {name for _, name in answered} == {"layerflow-answers"}


def test_answers_on_their_thread_fail_only_the_request_that_fails_alone_again(weights):
    copies = FaultyThreadCopyEngine()
    with HeldEngine(weights, config(serve_max_batch_size=3), copy_engine=copies) as engine, \
            AsyncEngine(engine, answers="thread") as serving:
        engine.score([Request(1, list(range(40)), [])])
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(1)
        copies.fail_at_layer = 1
        engine.launch_gate.close()
        blocker = serving.submit(Request(99, [1], [2]))
        assert engine.launch_gate.entered.wait(WAIT_S)
        futures = [serving.submit(Request(u, [u], [u + 1])) for u in (1, 2, 3)]
        engine.launch_gate.open()
        blocker.result(WAIT_S)
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            futures[0].result(WAIT_S)
        assert all(f.result(WAIT_S).scores.numel() == 1 for f in futures[1:])
        assert serving.metrics.failed_batches._value.get() == 1


def test_close_returns_once_the_answering_thread_answered_every_queued_request(weights):
    requests = visits(seed=6, users=list(range(5)), rounds=3)
    with HeldEngine(weights, config()) as engine:
        serving = AsyncEngine(engine, answers="thread")
        futures = [serving.submit(r) for r in requests]
        serving.close()
        assert all(f.done() for f in futures)
        scores = [f.result(0).scores for f in futures]
    expected = sequential_scores(weights, requests)
    assert all(torch.allclose(s, e, atol=TOL, rtol=TOL) for s, e in zip(scores, expected))
