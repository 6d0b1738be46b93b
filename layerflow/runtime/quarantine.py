"""GPU pages a failed onboarding's producer may still write (a transfer server that has not answered): held apart
under keys of their own, never reused until the producer is done, so they can never corrupt another user's KV."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

from layerflow.tier.base import Onboarding
from layerflow.tier.gpu_pool import GpuKVPool

log = logging.getLogger(__name__)


class Quarantine:
    """The pool's quarantined pages, each failed onboarding's under pinned keys ("quarantine", n)."""

    def __init__(self, gpu: GpuKVPool) -> None:
        self.gpu = gpu
        self._held: list[tuple[Onboarding, list[Hashable]]] = []
        self._count = 0

    def hold(self, onboarding: Onboarding, users: Sequence[Hashable]) -> None:
        """Move the GPU pages of `users` (those resident) under keys of their own until `onboarding` is fenced;
        the users no longer hold any."""
        keys = []
        for user in users:
            if user not in self.gpu:
                continue
            self._count += 1
            key = ("quarantine", self._count)
            self.gpu.rename(user, key)
            self.gpu.pin(key)
            keys.append(key)
        self._held.append((onboarding, keys))

    def reap(self) -> None:
        """Give quarantined pages back once their producer is done with them."""
        for entry in [e for e in self._held if e[0].fenced()]:
            self._held.remove(entry)
            for key in entry[1]:
                self.gpu.unpin(key)
                self.gpu.free(key)
            log.info("a stalled onboarding ended; %d users' GPU pages are free again", len(entry[1]))

    @property
    def pages(self) -> int:
        return sum(len(self.gpu.pages(key)) for _, keys in self._held for key in keys)
