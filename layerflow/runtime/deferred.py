"""When a committed batch's in-process onboarding is given back: before the fetch (`early`) or later (`deferred`).

Giving an onboarding back (its copies' events queried, the signal counter released, the host pins dropped) is host
work. `early` (the engine's collect, before the score fetch) overlaps it with the last layer's compute, but where that
layer is short (a 2K history) the host reaches the fetch after the GPU has finished. `deferred` keeps the committed
onboarding and gives it back after the NEXT batch's launch, when the host waits for the device anyway, so the release
leaves the request's tail; or earlier, before anything that needs its pins or counter (the user dropped or evicted
from the host, a read-back that needs host room, a ring short of counters, the engine's close). `wait_offloads` keeps
it: a benchmark's untimed wait between requests must not pay for it. Safe: a committed batch's copies have
landed (its last layer waited for them), so nothing writes its GPU pages; only its host pins and counter stay taken a
little longer. Only onboardings whose copies are this process's are kept (`Onboarding.local`).
"""

from __future__ import annotations

import os

from collections.abc import Sequence

from layerflow.tier.base import Load, Onboarding, Tier

RELEASE_ENV = "LAYERFLOW_ONBOARD_RELEASE"
RELEASES = ("early", "deferred")


def configured_release() -> str:
    """$LAYERFLOW_ONBOARD_RELEASE (one of RELEASES, any case), else "early"; ValueError naming any other value."""
    value = os.environ.get(RELEASE_ENV, "early").strip().lower()
    if value not in RELEASES:
        raise ValueError(f"{RELEASE_ENV}={value!r}: expected one of {list(RELEASES)}")
    return value


class DeferredReleases:
    """The committed onboardings not given back yet; `enabled` (the `deferred` path) may change between batches."""

    def __init__(self, release: str | None = None) -> None:
        release = configured_release() if release is None else release
        if release not in RELEASES:
            raise ValueError(f"release={release!r}: expected one of {list(RELEASES)}")
        self.enabled = release == "deferred"
        self._held: list[Onboarding] = []

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, onboarding: Onboarding) -> bool:
        """Keep a committed onboarding for a later `release` (True), or refuse it (False: the caller finishes it now)."""
        if not (self.enabled and onboarding.local):
            return False
        self._held.append(onboarding)
        return True

    def release(self) -> None:
        """Give every kept onboarding back (its copies landed: nothing is waited for)."""
        held, self._held = self._held, []
        for onboarding in held:
            onboarding.finish(wait=True)

    def before_onboard(self, loads: Sequence[Load], num_counters: int) -> None:
        """Give the kept onboardings back before a new one where it needs host room (a user read back from SSD or the
        remote store gets host blocks) or where their counters, with a batch in flight and the new one, could take
        the signal ring's next (its acquisition would wait for them)."""
        if self._held and (any(load.tier is not Tier.HOST for load in loads) or len(self._held) + 2 > num_counters):
            self.release()
