"""What the serving tests share: a tiny model, engines with small pools, sequential reference scores, and an Engine
whose launch and collect a test can hold at their entry (to stop the scheduler at a known step), and one whose
collect of chosen users' batches fails."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.tier.layout import KVLayout
from layerflow.transfer.errors import TransferError

MODEL = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                   dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
PAGE = 16
PAGE_GB = KVLayout.for_hstu(MODEL, PAGE).page_bytes / 2**30
TOL = 1e-5
WAIT_S = 20.0   # how long a test waits for something that must happen (it fails, not hangs, if it never does)


def config(gpu_pages: int = 200, **overrides) -> Config:
    """Small pools; prefetch on (policy "guarded" for an AsyncEngine given no policy), whose rules most tests check."""
    values = dict(cpu_cache_gb=400 * PAGE_GB, gpu_cache_gb=gpu_pages * PAGE_GB, page_size=PAGE,
                  transfer_timeout_s=5.0, serve_deadline_ms=0.0, serve_max_wait_ms=1.0, serve_prefetch=True)
    values.update(overrides)
    return Config(**values)


class Gate:
    """Open by default; while closed, `pass_through` blocks (up to WAIT_S) until `open`. `entered` is set by the
    first caller after each `close`."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.entered = threading.Event()

    def close(self) -> None:
        self.entered.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        self.entered.set()
        if not self._open.wait(WAIT_S):
            raise RuntimeError("a test gate was never opened")


class HeldEngine(Engine):
    """An Engine whose `launch` and `collect` wait at their entry while their gate is closed; `launched` lists the
    requests of every batch launched, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.launch_gate, self.collect_gate = Gate(), Gate()
        self.launched: list[list[Request]] = []

    def launch(self, plan):
        self.launch_gate.pass_through()
        self.launched.append(list(plan.requests))
        return super().launch(plan)

    def collect(self, flight):
        self.collect_gate.pass_through()
        return super().collect(flight)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def visits(seed: int, users: list[int], rounds: int) -> list[Request]:
    """`rounds` visits per user (a first one with a history, then returns), in a fixed interleaved order."""
    rng = random.Random(seed)
    out = []
    for k in range(rounds):
        for u in users:
            n = rng.randrange(20, 60) if k == 0 else rng.randrange(1, 4)
            out.append(Request(u, [rng.randrange(MODEL.item_vocab_size) for _ in range(n)],
                               [rng.randrange(MODEL.item_vocab_size) for _ in range(rng.randrange(1, 5))]))
    return out


def sequential_scores(weights: HSTUWeights, requests: list[Request], **overrides) -> list[torch.Tensor]:
    """Each request scored alone by a fresh Engine, in list order (the per-user order the server must keep)."""
    with Engine(weights, config(**overrides)) as engine:
        return [engine.score([r])[0] for r in requests]


class FailedCheck:
    """Stands in for a flight's layer wait at its collect: reports a transfer failure, as a captured graph's wait
    does only after the block (on the CPU path the eager block would raise at the launch instead)."""

    def check(self) -> None:
        raise TransferError("injected failure found at the collect")


class FailingCollect(HeldEngine):
    """A HeldEngine whose collect of a batch holding a user of `failing` finds its transfer failed (the engine
    rolls the batch back as for any failed batch)."""

    failing: set[int] = set()

    def collect(self, flight):
        if any(r.user_id in self.failing for r in flight.plan.requests):
            flight.wait = FailedCheck()
        return super().collect(flight)
