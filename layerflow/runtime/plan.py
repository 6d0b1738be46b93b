"""What the KV manager keeps per user (`UserEntry`) and per batch (`BatchPlan`): plain records, no policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerflow.model.batch import BatchShape
from layerflow.runtime.history import History
from layerflow.runtime.request import Request
from layerflow.tier.base import Onboarding, Tier
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.signals.base import SignalHandle


@dataclass
class UserEntry:
    """What the manager remembers of a user: its history (to recompute a miss) and its last offload."""

    history: History
    offload: Transfer | None = None
    gpu_first_page: int = 0   # its GPU pages hold valid K/V from this page on (a windowed onboarding skipped others)

    def offloading(self) -> bool:
        return self.offload is not None and not self.offload.done()


@dataclass
class BatchPlan:
    """One batch's placement: the validated batch, each user's GPU pages, its tier, and the onboarding."""

    requests: list[Request]
    batch: BatchShape | None   # a JaggedBatch or a packer's; None only while `KVManager.prepare` builds the plan
    tiers: list[Tier]
    page_rows: list[tuple[int, ...]]
    appended: list = field(default_factory=list)   # per user the ids (or rows) the batch appends to its history
    onboarding: Onboarding | None = None
    recorded: dict[int, int] = field(default_factory=dict)   # batch index -> history length before this batch
    first_pages: dict[int, int] = field(default_factory=dict)   # batch index -> first GPU page onboarded
    reuse_fences: list[Transfer] = field(default_factory=list)   # offloads still reading pages it was given
    aborted: bool = False

    @property
    def handle(self) -> SignalHandle | None:
        """The signal handle the batch's layers wait on (None: every user is a GPU hit or a miss)."""
        return None if self.onboarding is None else self.onboarding.handle
