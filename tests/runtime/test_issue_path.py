"""runtime.tiers.issue_path: the in-process tier's copy engine on a copy thread where `copy_thread` applies, else on
the caller's thread with a lead of layers (a CUDA engine: `lead_bytes`); the engine asks the tier below for the
deferred layers right after each launch and after a prepare made while a batch is in flight, and lets the tier issue
inline for score's own batches only."""

import random

import torch

from layerflow.config import Config
from layerflow.runtime import tiers
from layerflow.runtime.request import Request
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.issue_thread import IssueThreadCopyEngine
from layerflow.transfer.thread_copy import ThreadCopyEngine
from tests.runtime.test_engine import items, make_engine, weights  # noqa: F401 - the module's weights fixture

CPU = torch.device("cpu")


class LeadEngine(ThreadCopyEngine):
    """A CPU engine with the attribute a CUDA engine's lead lives in."""

    lead_bytes = None


def test_the_copy_thread_wraps_the_engine_with_its_lead_for_inline_onboardings():
    inner = LeadEngine()
    engine = tiers.issue_path(inner, Config(copy_thread=True), CPU)
    try:
        assert isinstance(engine, IssueThreadCopyEngine) and engine.inner is inner
        assert inner.lead_bytes == tiers.LEAD_BYTES and engine.inline is False
    finally:
        engine.close()


def test_without_the_copy_thread_an_engine_with_a_lead_gets_the_tiers_lead():
    inner = LeadEngine()
    try:
        assert tiers.issue_path(inner, Config(copy_thread=False), CPU) is inner
        assert inner.lead_bytes == tiers.LEAD_BYTES
        plain = ThreadCopyEngine()
        assert tiers.issue_path(plain, Config(copy_thread=False), CPU) is plain   # no lead to set: unchanged
        plain.close()
    finally:
        inner.close()


def test_a_copy_engine_defers_nothing_by_default():
    engine = ThreadCopyEngine()
    try:
        assert type(engine).issue_deferred is CopyEngine.issue_deferred and engine.issue_deferred() is None
    finally:
        engine.close()


def test_the_engine_asks_for_the_deferred_layers_after_every_launch_and_a_prepare_beside_a_flight(weights):  # noqa: F811
    rng = random.Random(0)
    with make_engine(weights) as engine:
        calls = []
        below = engine.kv.below
        below.issue_deferred = lambda: calls.append("deferred")
        below.issue_inline = lambda allowed: calls.append(f"inline={allowed}")
        engine.score([Request(1, items(rng, 40), items(rng, 3))])   # score's own batch: inline
        assert calls == ["inline=True", "deferred"]
        engine.kv.evict_from_gpu(1)
        # A scheduler's (serving's) batches keep the copy thread; one prepared beside a flight is issued at once.
        flight = engine.launch(engine.prepare([Request(1, items(rng, 4), items(rng, 3))]))
        ahead = engine.prepare([Request(2, items(rng, 30), items(rng, 3))])
        assert calls[2:] == ["inline=False", "deferred", "inline=False", "deferred"]
        engine.collect(flight)
        engine.collect(engine.launch(ahead))
        assert calls[6:] == ["deferred"]
