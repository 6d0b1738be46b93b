"""What the engine's collect does on the host before it fetches a batch's scores.

- The onboarding is released early: an in-process onboarding (its host pins and signal counter) goes back as soon as
  its copies landed, while the last layer still runs, so its cost leaves the request's tail and commit only unpins.
  That is safe because no batch acquires a counter while collect holds the engine's lock, and the block has ended
  when collect returns. A transfer server's onboarding is released by commit, after the block.
- `fetch` is how collect waits for the device: the fetch's stream synchronisation ("sync", the proven default), or a
  native "spin" on an event recorded after the launch (runtime/completion.py), chosen by the constructor or
  $LAYERFLOW_FETCH.
"""

from __future__ import annotations

import os

import torch

from layerflow.runtime.completion import FETCH_MODES, EventSpin
from layerflow.runtime.kv_manager import BatchPlan, KVManager
from layerflow.tier.in_process import InProcessTier

FETCH_ENV = "LAYERFLOW_FETCH"


def choose_mode(name: str, value: str | None, env: str, modes: tuple[str, ...]) -> str:
    """`value`, else $`env`, else the first of `modes`; ValueError naming a value that is not one of them."""
    chosen = value or os.environ.get(env, modes[0])
    if chosen not in modes:
        raise ValueError(f"{name}={chosen!r} ({env}): expected one of {list(modes)}")
    return chosen


class HostPaths:
    """One engine's collect-side host paths (see the module docstring); the spin's event is made at set-up and
    closed with the engine."""

    def __init__(self, kv: KVManager, device: torch.device, timeout_s: float, fetch: str | None = None) -> None:
        self.kv = kv
        self.fetch = choose_mode("fetch", fetch, FETCH_ENV, FETCH_MODES)
        self._spin = EventSpin(timeout_s) if self.fetch == "spin" and device.type == "cuda" else None

    def launched(self, stream: torch.cuda.Stream | None) -> bool:
        """Right after a block was queued on `stream`: True when collect is to spin on its end (an event recorded)."""
        if self._spin is None or stream is None:
            return False
        self._spin.record(stream.cuda_stream)
        return True

    def release_onboarding(self, plan: BatchPlan) -> None:
        """The early release of an in-process onboarding (waits for its copies); commit then skips it."""
        if plan.onboarding is not None and isinstance(self.kv.below, InProcessTier):
            plan.onboarding.finish(wait=True)
            plan.onboarding = None

    def before_fetch(self, plan: BatchPlan, spin: bool) -> None:
        """In collect, before the results are fetched: the onboarding's release, then the spin on the block's end
        (`spin`: what `launched` answered)."""
        self.release_onboarding(plan)
        if spin:
            self._spin.wait()

    def close(self) -> None:
        """Free the spin's event."""
        if self._spin is not None:
            self._spin.close()
            self._spin = None
