"""The seam for a KV store below the host that several hosts share, and the protocol every such store follows.

Per user a store keeps one value per host block written under a version, and a manifest (tier/remote_manifest.py)
that names them. A backend (Redis now; Mooncake can follow) gives four primitives: read a manifest, fetch blocks
(pipelined, in order), put blocks under a version (they expire unless a manifest names them) and swap a manifest
atomically (only if the current one is still the one read; the old one's other blocks expire after a grace period,
so its readers still finish). `RemoteStore` builds the rest on them, once:

- Reads (`lookup`, then `load`) never see a torn copy: blocks are written before the manifest that names them, never
  rewritten under a version, and checked against the manifest's checksums as they land. A missing, truncated or
  damaged block is a `Miss`; the damaged copy is then deleted (unless another host replaced it meanwhile).
- Writes are asynchronous: `store`, `truncate` and `evict` queue a job for one writer thread and return at once. Block
  writes are bounded (jobs and bytes held); a full queue refuses the write, and a newer write of a user replaces one
  still queued. A new version uploads only the blocks changed since the version this host's copy mirrors (the one it
  last committed or read), when that one is still current; else every block.
- After `truncate` or `evict` the older copy is never served and a write of the user in flight is not committed.
- Faults (unreachable, timeout, out of memory, refused) are a miss and start an `Outage` (logged once, backed off).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from layerflow.tier.layout import KVLayout
from layerflow.tier.remote_faults import Episode, Outage, RemoteFault
from layerflow.tier.remote_manifest import Manifest, block_checksum, new_manifest
from layerflow.tier.ssd import HostBlocks, Miss

log = logging.getLogger(__name__)

WRITE_THROUGH, ON_EVICT = "write_through", "on_evict"
REMOTE_WRITES = (WRITE_THROUGH, ON_EVICT)
RECENT_MANIFESTS = 64
PUT_BATCH_BYTES = 4 << 20   # blocks per round trip of a write
Landed = tuple[int, list[tuple[int, int] | None]]   # a group of blocks `RemoteStore._fetch` landed


@dataclass(eq=False)
class BlockWrite:
    """A queued write of a user's first `num_blocks` blocks: `read(i)` gives block i's bytes; `release()` runs once
    when the job no longer needs them (it may hold host blocks pinned). `held_bytes`: memory the job holds."""

    user: str
    history: np.ndarray
    num_blocks: int
    read: Callable[[int], bytes]
    release: Callable[[], None]
    held_bytes: int = 0
    epoch: int = 0


@dataclass(eq=False)
class _Cut:
    """A queued truncation of a user's copy to `tokens` (0: delete; `version`: only if that one is current)."""

    user: str
    tokens: int
    epoch: int
    version: str | None = None


@dataclass
class _UserState:
    epoch: int = 0                    # bumped by truncate/evict: writes queued before are not committed
    mirrored: str | None = None       # the version whose blocks [0, dirty) the host's copy equals
    dirty: int = 0
    cap: int | None = None            # a truncate (0: a delete) not yet run: lookups see at most this
    queued: BlockWrite | None = field(default=None, repr=False)


class RemoteStore(ABC):
    """A shared block store below the host (see the module docstring); thread-safe."""

    def __init__(self, layout: KVLayout, fingerprint: str, name: str, queue_jobs: int = 32,
                 queue_bytes: int = 1 << 30) -> None:
        for key, value in (("queue_jobs", queue_jobs), ("queue_bytes", queue_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}={value!r}: must be a positive integer")
        self.layout, self.fingerprint, self.name = layout, fingerprint, name
        self.page_size, self.block_bytes = layout.page_size, layout.page_bytes
        self.queue_jobs, self.queue_bytes = queue_jobs, queue_bytes
        self.outage = Outage(f"remote store {name}")
        self._evicting = Episode(f"remote store {name} is losing blocks (evicted or expired)")
        self._full = Episode(f"remote store {name}: write queue full, writes dropped")
        self._host_id = secrets.token_hex(4)
        self._versions = itertools.count(1)
        self._cond = threading.Condition()
        self._jobs: deque[BlockWrite | _Cut] = deque()
        self._held = 0
        self._puts = 0
        self._busy = False
        self._closed = False
        self._users: dict[str, _UserState] = {}
        self._recent: OrderedDict[str, Manifest] = OrderedDict()   # the last lookups, for the load that follows
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name=f"layerflow-{name}-writer")
        self._writer.start()

    # ---- the backend's primitives ---------------------------------------------------------------

    @abstractmethod
    def _read_manifest(self, user: str) -> Manifest | None:
        """The user's current manifest (None: none, or one this store may not use). Raises RemoteFault."""

    @abstractmethod
    def _fetch(self, user: str, manifest: Manifest, host: HostBlocks, blocks: list[int]) -> Iterator[Landed]:
        """The first len(`blocks`) blocks into host `blocks`, fetched ahead, as groups in block order: the first index
        and per block (its value's length, the `block_hasher` digest of what landed) or None (no such value); a value
        not one block long is not landed. Closing the iterator early abandons the rest. Raises RemoteFault."""

    @abstractmethod
    def _put_blocks(self, user: str, version: str, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Write `(index, bytes)` blocks under `version`, unnamed (they expire unless a manifest names them)."""

    @abstractmethod
    def _swap_manifest(self, user: str, old: Manifest | None, new: Manifest | None) -> str:
        """Atomically replace `old` (None: no manifest) by `new` (None: delete): 'ok'; 'moved' when the current
        manifest is not `old`; 'missing' when a block `new` names is gone. Raises RemoteFault."""

    @abstractmethod
    def _close_backend(self) -> None:
        """Release connections and threads of the backend."""

    # ---- reads -----------------------------------------------------------------------------

    def lookup(self, user: object) -> Manifest | None:
        """The user's copy as this store may serve it now (None: none, unreachable, hidden by a pending delete)."""
        key = str(user)
        with self._cond:
            hidden = self._state(key).cap == 0
        if hidden or not self.outage.ready():
            return None
        manifest = self._capped(key, self._attempt(self._read_manifest, key))
        if manifest is None:
            return None
        with self._cond:
            self._recent[key] = manifest
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_MANIFESTS:
                self._recent.popitem(last=False)
        return manifest

    def _capped(self, key: str, manifest: Manifest | None) -> Manifest | None:
        """`manifest` as a pending truncate or delete of the user lets this store serve it."""
        with self._cond:
            cap = self._state(key).cap
        if manifest is None or cap is None or manifest.tokens <= cap:
            return manifest
        return manifest.truncated(cap, manifest.version) if cap > 0 else None

    def load(self, user: object, host: HostBlocks, blocks: Sequence[int],
             on_group: Callable[[list[int]], None] | None = None) -> None:
        """The first len(`blocks`) blocks of the copy `lookup` last returned (else the current one) into host
        `blocks`, each checked; `on_group(host_blocks)` as each checked group lands, in order. Raises Miss when the
        store is unreachable or a block is missing, short or damaged (the damaged copy is then deleted; the host
        blocks may hold part of it, and the caller frees them)."""
        key, blocks = str(user), list(blocks)
        with self._cond:
            manifest = self._recent.pop(key, None)
        manifest = self._capped(key, manifest) if manifest is not None else self.lookup(user)
        with self._cond:
            self._recent.pop(key, None)
        if manifest is None:
            raise Miss(f"user {key!r} has no usable copy in the remote store")
        if len(blocks) > manifest.num_blocks:
            raise Miss(f"user {key!r}: {len(blocks)} blocks asked, {manifest.num_blocks} in the remote store")
        problem = None
        try:
            groups = self._fetch(key, manifest, host, blocks)
            try:
                for start, landed in groups:
                    problem = self._check(manifest, start, landed)
                    if problem is not None:
                        break
                    if on_group is not None:
                        on_group(blocks[start:start + len(landed)])
            finally:
                groups.close()
        except RemoteFault as e:
            self.outage.failed(e.reason)
            raise Miss(f"user {key!r}: the remote store failed mid-read ({e.reason})") from None
        self.outage.succeeded()
        if problem is not None:
            self._discard(key, manifest, problem)
            raise Miss(f"user {key!r}: {problem}")
        self._evicting.end()
        with self._cond:
            state = self._state(key)
            state.mirrored, state.dirty = manifest.version, len(blocks)

    def _check(self, manifest: Manifest, start: int, landed: list[tuple[int, int] | None]) -> str | None:
        """What is wrong with a group of landed blocks (None: nothing)."""
        for i, block in enumerate(landed, start):
            if block is None:
                return f"block {i} is missing (evicted or expired)"
            length, checksum = block
            if length != self.block_bytes:
                return f"block {i} has {length} bytes, expected {self.block_bytes} (truncated)"
            if checksum != int(manifest.checksums[i]):
                return f"block {i} fails its checksum"
        return None

    def _discard(self, key: str, manifest: Manifest, problem: str) -> None:
        if "missing" in problem:
            self._evicting.start(f"user {key!r}: {problem}")
        else:
            log.warning("%s: user %r has a damaged copy (%s); deleting it", self.name, key, problem)
        with self._cond:
            state = self._state(key)
            state.cap = 0
            self._push(_Cut(key, 0, state.epoch, manifest.version))

    # ---- writes ----------------------------------------------------------------------------

    def store(self, user: object, history: np.ndarray, num_blocks: int, read: Callable[[int], bytes],
              release: Callable[[], None], first: int, held_bytes: int = 0) -> bool:
        """Queue a write of the user's copy: `num_blocks` blocks holding `history` (one item id per token), of which
        blocks from `first` on changed since the last write. True: queued, `release` is the store's to call; False:
        refused (queue full, store closed), the caller keeps what `read` reads."""
        key = str(user)
        if -(-len(history) // self.page_size) != num_blocks or num_blocks <= 0:
            raise ValueError(f"user {key!r}: {len(history)} history items do not fill {num_blocks} blocks")
        replaced = None
        with self._cond:
            state = self._state(key)
            state.dirty = min(state.dirty, first)
            old = state.queued
            held = self._held - (old.held_bytes if old else 0) + held_bytes
            full = held > self.queue_bytes or (old is None and self._puts >= self.queue_jobs)
            if not (self._closed or full):
                job = BlockWrite(key, history, num_blocks, read, release, held_bytes, state.epoch)
                if old is not None:
                    self._jobs[self._jobs.index(old)] = job
                    replaced = old
                else:
                    self._jobs.append(job)
                    self._puts += 1
                state.queued, self._held = job, held
                self._cond.notify_all()
            queued = not (self._closed or full)
        if full:
            self._full.start(f"{self._puts} writes queued, {self._held} bytes held")
        elif queued:
            self._full.end()
        if replaced is not None:
            replaced.release()
        return queued

    def truncate(self, user: object, tokens: int) -> None:
        """Only the first `tokens` tokens of the user's copy stay (0: the copy is deleted), from now on."""
        key = str(user)
        with self._cond:
            state = self._state(key)
            state.epoch += 1
            cancelled, state.queued = state.queued, None
            if cancelled is not None:
                self._jobs.remove(cancelled)
                self._puts -= 1
                self._held -= cancelled.held_bytes
            state.dirty = min(state.dirty, tokens // self.page_size)
            state.cap = tokens if state.cap is None else min(state.cap, tokens)
            self._push(_Cut(key, tokens, state.epoch))
        if cancelled is not None:
            cancelled.release()

    def evict(self, user: object) -> None:
        """Delete the user's copy (asynchronously; never served from now on)."""
        self.truncate(user, 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        """Run the queued jobs, stop the writer, close the backend."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        self._close_backend()

    def _state(self, key: str) -> _UserState:
        return self._users.setdefault(key, _UserState())

    def _push(self, job: _Cut) -> None:
        self._jobs.append(job)
        self._cond.notify_all()

    def _new_version(self) -> str:
        return f"{self._host_id}.{next(self._versions)}"

    def _attempt(self, call: Callable, *args):
        """`call(*args)`, its fault ending in None and the outage."""
        try:
            result = call(*args)
        except RemoteFault as e:
            self.outage.failed(e.reason)
            return None
        self.outage.succeeded()
        return result

    # ---- the writer thread -----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                if isinstance(job, BlockWrite):
                    self._state(job.user).queued = None
                    self._puts -= 1
                    self._held -= job.held_bytes
                self._busy = True
            try:
                if self.outage.ready():
                    self._attempt(self._write if isinstance(job, BlockWrite) else self._cut, job)
            except Exception:   # noqa: BLE001 - the writer must outlive one bad job
                log.exception("%s: a write job of user %r failed", self.name, job.user)
            finally:
                if isinstance(job, BlockWrite):
                    job.release()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: BlockWrite) -> None:
        with self._cond:
            state = self._state(job.user)
            first, mirrored = state.dirty, state.mirrored
            state.dirty = job.num_blocks
        outcome = "not run"
        try:
            current = self._read_manifest(job.user)
            keep = 0
            if current is not None and current.version == mirrored:
                keep = min(first, current.num_blocks, job.num_blocks)
            outcome = self._upload(job, current, keep)
            if outcome == "missing" and keep:
                outcome = self._upload(job, current, 0)
        finally:
            if outcome != "ok":
                with self._cond:
                    state.dirty = min(state.dirty, first)

    def _upload(self, job: BlockWrite, current: Manifest | None, keep: int) -> str:
        """Blocks [keep, n) under a new version, then the manifest: 'ok', 'abandoned' (truncated or evicted
        meanwhile: the blocks expire unnamed) or the swap's refusal."""
        version = self._new_version()
        checksums = [int(c) for c in current.checksums[:keep]] if keep else []
        batch, batch_bytes = [], 0
        for i in range(keep, job.num_blocks):
            data = job.read(i)
            checksums.append(block_checksum(data))
            batch.append((i, data))
            batch_bytes += len(data)
            if batch_bytes >= PUT_BATCH_BYTES or i == job.num_blocks - 1:
                self._put_blocks(job.user, version, batch)
                batch, batch_bytes = [], 0
        runs = (current.prefix_runs(keep) if keep else []) + [(version, job.num_blocks - keep)]
        manifest = new_manifest(self.fingerprint, self.layout, version, job.history, checksums, runs)
        with self._cond:
            if self._state(job.user).epoch != job.epoch:
                return "abandoned"
        outcome = self._swap_manifest(job.user, current, manifest)
        if outcome != "ok":
            log.info("%s: write of user %r not committed (%s)", self.name, job.user, outcome)
            return outcome
        with self._cond:
            state = self._state(job.user)
            state.mirrored = version
            if state.epoch == job.epoch:
                state.cap = None
        return outcome

    def _cut(self, job: _Cut) -> None:
        current = self._read_manifest(job.user)
        outcome = "ok"
        if current is not None and (job.version is None or job.version == current.version) \
                and current.tokens > job.tokens:
            new = current.truncated(job.tokens, self._new_version()) if job.tokens else None
            outcome = self._swap_manifest(job.user, current, new)
            with self._cond:
                state = self._state(job.user)
                if outcome == "ok" and state.mirrored == current.version:
                    state.mirrored = None if new is None else new.version
        with self._cond:
            state = self._state(job.user)
            if state.epoch == job.epoch and outcome != "missing":
                state.cap = None
