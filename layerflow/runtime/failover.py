"""Keeping a transfer server's tier when it dies and comes back: fall back to an in-process tier, retry, switch back.

The engine asks `check(kv)` before each batch (while no batch is in flight). A server that is gone and does not
answer at once is replaced by an in-process tier; from then on the server is retried with growing pauses and, once it
answers, serves again. Both switches are logged. Users still on the GPU stay hits across a switch; the others' next
visit recomputes them (the KV the old tier held is not carried over).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from layerflow.runtime.kv_manager import KVManager
from layerflow.tier.base import KVTier

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 30.0)   # first and longest pause between attempts to reach the server again


class ServerFailover:
    """`remote` is the server's tier; `fallback()` builds an in-process tier when it is needed."""

    def __init__(self, remote: KVTier, fallback: Callable[[], KVTier]) -> None:
        self.remote, self._fallback = remote, fallback
        self._retry_at, self._backoff = 0.0, BACKOFF_S[0]

    def check(self, kv: KVManager) -> None:
        if kv.below is self.remote:
            if not self.remote.alive():
                log.warning("the transfer server is gone; serving from an in-process host tier (the KV it held is "
                            "lost) and trying to reach it again")
                kv.replace_below(self._fallback())
                self._backoff = BACKOFF_S[0]
                self._retry_at = time.monotonic() + self._backoff
            return
        if time.monotonic() < self._retry_at:
            return
        if not self.remote.alive():
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])
            self._retry_at = time.monotonic() + self._backoff
            return
        log.warning("the transfer server is back; its host tier serves again (the in-process one is dropped)")
        fallback = kv.below
        kv.replace_below(self.remote)
        fallback.close()

    def close(self, kv: KVManager) -> None:
        """Close the server's tier if it is not the one in use (the engine closes that one)."""
        if kv.below is not self.remote:
            self.remote.close()
