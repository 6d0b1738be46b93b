"""When a committed batch's in-process onboarding is given back: after the NEXT batch's launch.

Giving an onboarding back (its copies' events queried, the signal counter released, the host pins dropped) is host
work. Done before the score fetch it sits on the request's tail where the last layer is short (a 2K history: the host
reaches the fetch after the GPU has finished). So commit keeps the onboarding and the next batch's launch gives it
back, when the host waits for the device anyway; or earlier, before anything that needs its pins or counter (the user
dropped or evicted from the host, a read-back that needs host room, a ring short of counters, the engine's close).
`wait_offloads` keeps it: a benchmark's untimed wait between requests must not pay for it. Safe: a committed batch's
copies have landed (its last layer waited for them), so nothing writes its GPU pages; only its host pins and counter
stay taken a little longer. Only onboardings whose copies are this process's are kept (`Onboarding.local`). On the
H200 (2K layerwise, against the release before the fetch): bf16 1.440 -> 1.431 ms, fp8 0.873 -> 0.847, 16K within
0.02 ms, scores bitwise equal (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from layerflow.tier.base import Load, Onboarding, Tier


class DeferredReleases:
    """The committed onboardings not given back yet."""

    def __init__(self) -> None:
        self._held: list[Onboarding] = []

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, onboarding: Onboarding) -> bool:
        """Keep a committed onboarding for a later `release` (True), or refuse it (False: the caller finishes it
        now)."""
        if not onboarding.local:
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
