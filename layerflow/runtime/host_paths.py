"""The engine's selectable host paths around a batch with an onboarding, each a mode (env var or constructor), the
proven path the default until the H200 says otherwise (docs/performance.md):

- `issue`: who issues an in-process onboarding's copies: "inline" in prepare, or a "thread" of their own while the
  engine's thread packs, fills and launches the batch (runtime/issuer.py; not with `event` signals; the in-process
  tier a failover falls back to issues inline);
- `fetch`: how collect waits for the device: the fetch's stream synchronisation ("sync"), or a native "spin" on an
  event recorded after the launch (runtime/completion.py);
- `finish`: when collect releases an in-process onboarding (its host pins and signal counter): "after" the block, in
  `KVManager.commit`, or "early", as soon as its copies landed, while the last layer still runs (no batch acquires a
  counter while collect holds the engine's lock, and the block has ended when collect returns), so that commit only
  unpins.

The modes are attributes: a benchmark may switch them between batches of one engine.
"""

from __future__ import annotations

import os

import torch

from layerflow.config import SignalMode
from layerflow.runtime.completion import FETCH_MODES, EventSpin
from layerflow.runtime.issuer import IssueWorker
from layerflow.runtime.kv_manager import BatchPlan, KVManager
from layerflow.tier.in_process import InProcessTier

ISSUE_MODES, ISSUE_ENV = ("inline", "thread"), "LAYERFLOW_ONBOARD_ISSUE"
FETCH_ENV = "LAYERFLOW_FETCH"
FINISH_MODES, FINISH_ENV = ("after", "early"), "LAYERFLOW_ONBOARD_FINISH"


def choose_mode(name: str, value: str | None, env: str, modes: tuple[str, ...]) -> str:
    """`value`, else $`env`, else the first of `modes`; ValueError naming a value that is not one of them."""
    chosen = value or os.environ.get(env, modes[0])
    if chosen not in modes:
        raise ValueError(f"{name}={chosen!r} ({env}): expected one of {list(modes)}")
    return chosen


class HostPaths:
    """The three modes of one engine (see the module docstring) and what they need: the issue thread and the event
    spin, made on first use and closed with the engine."""

    def __init__(self, kv: KVManager, device: torch.device, timeout_s: float, issue: str | None = None,
                 fetch: str | None = None, finish: str | None = None) -> None:
        self.kv, self.device, self.timeout_s = kv, device, timeout_s
        self._issuer: IssueWorker | None = None
        self._spin: EventSpin | None = None
        self.issue, self.fetch, self.finish = issue, fetch, finish

    @property
    def issue(self) -> str:
        return self._issue

    @issue.setter
    def issue(self, mode: str | None) -> None:
        chosen = choose_mode("issue", mode, ISSUE_ENV, ISSUE_MODES)
        if chosen == "thread" and self.kv.below.signals.mode is SignalMode.EVENT:
            raise ValueError("issue='thread' with signal 'event': a replay launched before its copies are issued "
                             "would wait on the previous onboarding's events; use 'waitvalue' or 'eventfd'")
        if chosen == "thread" and self._issuer is None:
            self._issuer = IssueWorker()
        self._issue = chosen
        if isinstance(self.kv.below, InProcessTier):   # a transfer server issues its own copies
            self.kv.below.issue = self._issuer.submit if chosen == "thread" else None

    @property
    def fetch(self) -> str:
        """Without CUDA both modes are the same (the block ran eagerly)."""
        return self._fetch

    @fetch.setter
    def fetch(self, mode: str | None) -> None:
        self._fetch = choose_mode("fetch", mode, FETCH_ENV, FETCH_MODES)
        if self._fetch == "spin" and self._spin is None and self.device.type == "cuda":
            self._spin = EventSpin(self.timeout_s)

    @property
    def finish(self) -> str:
        return self._finish

    @finish.setter
    def finish(self, mode: str | None) -> None:
        self._finish = choose_mode("finish", mode, FINISH_ENV, FINISH_MODES)

    def launched(self, stream: torch.cuda.Stream | None) -> bool:
        """Right after a block was queued on `stream`: True when collect is to spin on its end (an event recorded)."""
        if self._fetch != "spin" or self._spin is None or stream is None:
            return False
        self._spin.record(stream.cuda_stream)
        return True

    def before_fetch(self, plan: BatchPlan, spin: bool) -> None:
        """In collect, before the results are fetched: the early finish, then the spin on the block's end."""
        if self._finish == "early" and plan.onboarding is not None and isinstance(self.kv.below, InProcessTier):
            plan.onboarding.finish(wait=True)
            plan.onboarding = None   # commit skips it
        if spin:
            self._spin.wait()

    def close(self) -> None:
        """Stop the issue thread (after the jobs already submitted) and free the spin's event."""
        if self._issuer is not None:
            self._issuer.close()
            self._issuer = None
        if self._spin is not None:
            self._spin.close()
            self._spin = None
