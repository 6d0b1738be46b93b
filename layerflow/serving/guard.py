"""What a batch prepared ahead may evict from the GPU pool (prefetch policy "guarded").

A prefetch places its batch while the queue is deep, and the LRU eviction that makes room for it may take a resident
user whose request is queued: that request then onboards from the host, which costs the copy engine the bytes a GPU
hit would not. "guarded" keeps the users of the requests the next two batches would take (the oldest 2 x max batch
queued: a user queued further back may be evicted by those batches anyway, and keeping every queued user would keep
nearly every resident one under load; keeping every resident user, the removed policy "free", lost on the H200;
plain LRU eviction, the removed policy "mixed", served as much within noise but may evict what the next batch needs).
They are kept by pinning them while the batch is placed, so a prefetch that needs their pages fails with
PoolExhausted and is deferred to the collect of the batch in flight, as any prefetch the pool cannot hold.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from layerflow.serving.queue import Pending, RequestQueue
from layerflow.tier.user_pages import UserPages


def pin_guarded(gpu: UserPages, queue: RequestQueue, batch: Sequence[Pending]) -> list[Hashable]:
    """Pin the resident users a batch prepared ahead may not evict, except `batch`'s own (whose placement the engine
    handles); returns them for the caller to unpin once the batch is placed."""
    kept = queue.users(oldest=2 * queue.max_batch)
    own = {p.user for p in batch}
    pinned = [u for u in kept if u in gpu and u not in own]
    for user in pinned:
        gpu.pin(user)
    return pinned
