"""SSD tier: a user's host blocks spilled to one file, checksummed, indexed, LRU-evicted.

One file per user keeps a user's blocks sequential on disk (reads at the disk's streaming
rate) and makes eviction an unlink. Block b of a file sits at `b * slot_bytes`, where
`slot_bytes` rounds one block (all layers of all groups) up to 4 KiB so O_DIRECT reads land
directly in the page-aligned host pool. Every block carries a CRC32 in the index; a short
read (torn or truncated file) or a CRC mismatch is a Miss and the entry is dropped: corrupt
data is never served. The index is rewritten atomically (tmp + fsync + rename) after the
data is durable, so a crash leaves at worst an orphan file that the next start deletes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ALIGN = 4096
INDEX_FILE = "index.json"
INDEX_VERSION = 1
DEFAULT_GROUP_BLOCKS = 16

HostBlocks = Callable[[int], list[memoryview]]
"""Maps a host block index to the byte views of that block (one per layer group)."""


class Miss(KeyError):
    """The user is not on SSD, or its data failed a length or checksum check."""


@dataclass
class _Entry:
    file: str
    dir_index: int
    num_blocks: int
    crcs: list[int]


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def tensor_block_views(tensors: Sequence[torch.Tensor]) -> HostBlocks:
    """Block views over per-group host tensors shaped `[num_blocks, ...]` (CPU, contiguous)."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"host tensor {tuple(t.shape)} on {t.device}: must be a contiguous CPU tensor")
    flat = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
    return lambda b: [memoryview(f[b].numpy()) for f in flat]


def _views_aligned(views: list[memoryview]) -> bool:
    return all(len(v) % ALIGN == 0 and _address(v) % ALIGN == 0 for v in views)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _crc(views: list[memoryview]) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def odirect_supported(directory: str | os.PathLike) -> bool:
    """Whether the filesystem under `directory` accepts O_DIRECT (tmpfs, for one, does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


class SsdStore:
    """Per-user block files under one or more directories, capped at `capacity_bytes` (LRU)."""

    def __init__(self, dirs: Sequence[str | os.PathLike], capacity_bytes: int, block_bytes: int,
                 io_threads: int = 4, group_blocks: int = DEFAULT_GROUP_BLOCKS) -> None:
        if not dirs:
            raise ValueError("dirs=(): need at least one SSD directory")
        for name, value in (("capacity_bytes", capacity_bytes), ("block_bytes", block_bytes),
                            ("io_threads", io_threads), ("group_blocks", group_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        self.dirs = [Path(d) for d in dirs]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.slot_bytes = self.slot_size(block_bytes)
        self.group_blocks = group_blocks
        self.odirect = [odirect_supported(d) for d in self.dirs]
        for d, ok in zip(self.dirs, self.odirect):
            if not ok:
                log.info("SSD tier: %s does not support O_DIRECT, using buffered I/O", d)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="layerflow-ssd")
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU first, MRU last
        self._generation = 0
        self._recover()

    @staticmethod
    def slot_size(block_bytes: int) -> int:
        """Bytes one block occupies on SSD (rounded up to the O_DIRECT alignment)."""
        return round_up(block_bytes)

    # ---- public API -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.num_blocks for e in self._entries.values()) * self.slot_bytes

    def users(self) -> list[str]:
        """Users on SSD, least recently used first."""
        with self._lock:
            return list(self._entries)

    def contains(self, user: str | int) -> bool:
        with self._lock:
            return str(user) in self._entries

    def num_blocks(self, user: str | int) -> int:
        with self._lock:
            entry = self._entries.get(str(user))
        if entry is None:
            raise Miss(str(user))
        return entry.num_blocks

    def store(self, user: str | int, host: HostBlocks, blocks: Sequence[int]) -> list[str]:
        """Write `blocks` of `user` from host memory; returns the users evicted to make room."""
        key, blocks = str(user), list(blocks)
        need = len(blocks) * self.slot_bytes
        if not blocks:
            raise ValueError(f"blocks=[] for user {key!r}: nothing to store")
        if need > self.capacity_bytes:
            raise ValueError(f"user {key!r} needs {need} bytes, more than ssd capacity {self.capacity_bytes}")
        with self._lock:
            self._generation += 1
            dir_index = int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(self.dirs)
            name = f"{hashlib.sha1(key.encode()).hexdigest()[:20]}-{self._generation}.kv"
        path = self.dirs[dir_index] / name
        views = [host(b) for b in blocks]
        crcs = self._write(path, views, self._direct(dir_index, views))
        with self._lock:
            old = self._entries.pop(key, None)
            evicted = []
            used = sum(e.num_blocks for e in self._entries.values()) * self.slot_bytes
            while used + need > self.capacity_bytes:
                victim, entry = self._entries.popitem(last=False)
                used -= entry.num_blocks * self.slot_bytes
                evicted.append((victim, entry))
            self._entries[key] = _Entry(name, dir_index, len(blocks), crcs)
            self._save_index()
        for entry in ([old] if old else []) + [e for _, e in evicted]:
            self._unlink(entry)
        return [victim for victim, _ in evicted]

    def load(self, user: str | int, host: HostBlocks, blocks: Sequence[int],
             on_group: Callable[[list[int]], None] | None = None) -> None:
        """Read the first len(`blocks`) of `user`'s blocks into host `blocks`; raise Miss (and drop the entry) on
        any damage, or when fewer blocks are stored than asked.

        Reads go out in groups of `group_blocks` on the I/O threads; `on_group(host_blocks)`
        runs as each verified group lands, in file order, so a caller can start copying it on.
        """
        key, blocks = str(user), list(blocks)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            raise Miss(f"user {key!r} is not on SSD")
        if len(blocks) > entry.num_blocks:
            raise Miss(f"user {key!r}: {len(blocks)} blocks asked, {entry.num_blocks} on SSD")
        path = self.dirs[entry.dir_index] / entry.file
        views = [host(b) for b in blocks]
        direct = self._direct(entry.dir_index, views)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            self._drop(key, entry, "file is missing")
            raise Miss(f"user {key!r}: SSD file {path} is missing") from None
        starts = range(0, len(blocks), self.group_blocks)
        futures = [self._pool.submit(self._read_group, fd, views, entry.crcs, s, s + self.group_blocks)
                   for s in starts]
        problems = []
        try:
            for s, fut in zip(starts, futures):
                problem = fut.result()
                if problem is not None:
                    problems.append(problem)
                elif not problems and on_group is not None:
                    on_group(blocks[s:s + self.group_blocks])
        finally:
            wait(futures)  # an on_group error must not close the fd under a read still in flight
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the host pool is the cache, not the page cache
            os.close(fd)
        if problems:
            self._drop(key, entry, problems[0])
            raise Miss(f"user {key!r}: {problems[0]}")

    def evict(self, user: str | int) -> bool:
        """Remove `user` from SSD; False if it was not there."""
        key = str(user)
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._save_index()
        self._unlink(entry)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- I/O --------------------------------------------------------------------------------

    def _direct(self, dir_index: int, views: list[list[memoryview]]) -> bool:
        return self.odirect[dir_index] and all(_views_aligned(v) for v in views)

    def _write(self, path: Path, views: list[list[memoryview]], direct: bool) -> list[int]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
        try:
            os.ftruncate(fd, len(views) * self.slot_bytes)
            starts = range(0, len(views), self.group_blocks)
            futures = [self._pool.submit(self._write_group, fd, views, s, s + self.group_blocks) for s in starts]
            crcs = [crc for fut in futures for crc in fut.result()]
            os.fsync(fd)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return crcs

    def _write_group(self, fd: int, views: list[list[memoryview]], start: int, stop: int) -> list[int]:
        crcs = []
        for i in range(start, min(stop, len(views))):
            crcs.append(_crc(views[i]))
            written = os.pwritev(fd, views[i], i * self.slot_bytes)
            if written != self.block_bytes:
                raise OSError(f"short write of block {i}: {written} of {self.block_bytes} bytes")
        return crcs

    def _read_group(self, fd: int, views: list[list[memoryview]], crcs: list[int],
                    start: int, stop: int) -> str | None:
        try:
            return self._read_checked(fd, views, crcs, start, min(stop, len(views)))
        except OSError as e:
            return f"read error at block {start}: {e}"

    def _read_checked(self, fd: int, views: list[list[memoryview]], crcs: list[int], start: int,
                      stop: int) -> str | None:
        if self.slot_bytes == self.block_bytes:
            iov = [v for i in range(start, stop) for v in views[i]]
            got = os.preadv(fd, iov, start * self.slot_bytes)
            if got != (stop - start) * self.slot_bytes:
                return f"short read at block {start}: torn or truncated file"
        else:
            for i in range(start, stop):
                got = os.preadv(fd, views[i], i * self.slot_bytes)
                if got != self.block_bytes:
                    return f"short read of block {i}: torn or truncated file"
        for i in range(start, stop):
            if _crc(views[i]) != crcs[i]:
                return f"checksum mismatch in block {i}"
        return None

    # ---- index ------------------------------------------------------------------------------

    def _drop(self, key: str, entry: _Entry, why: str) -> None:
        log.warning("SSD tier: dropping user %r: %s", key, why)
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._save_index()
        self._unlink(entry)

    def _unlink(self, entry: _Entry) -> None:
        (self.dirs[entry.dir_index] / entry.file).unlink(missing_ok=True)

    def _index_path(self) -> Path:
        return self.dirs[0] / INDEX_FILE

    def _save_index(self) -> None:
        doc = {
            "version": INDEX_VERSION,
            "block_bytes": self.block_bytes,
            "slot_bytes": self.slot_bytes,
            "dirs": [str(d) for d in self.dirs],
            "generation": self._generation,
            "entries": [[key, e.file, e.dir_index, e.num_blocks, e.crcs] for key, e in self._entries.items()],
        }
        tmp = self._index_path().with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._index_path())
        dir_fd = os.open(self.dirs[0], os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _recover(self) -> None:
        """Load the index and delete files it does not name (orphans of a crash mid-store)."""
        path = self._index_path()
        doc = None
        if path.exists():
            try:
                doc = json.loads(path.read_text())
            except ValueError as e:
                log.warning("SSD tier: unreadable index %s (%s); starting empty", path, e)
        if doc is not None:
            same = (doc.get("version"), doc.get("block_bytes"), doc.get("dirs")) == (
                INDEX_VERSION, self.block_bytes, [str(d) for d in self.dirs])
            if not same:
                log.warning("SSD tier: index %s is for another layout or directory set; starting empty", path)
            else:
                self._generation = int(doc["generation"])
                for key, name, dir_index, num_blocks, crcs in doc["entries"]:
                    self._entries[key] = _Entry(name, dir_index, num_blocks, crcs)
        known = {(e.dir_index, e.file) for e in self._entries.values()}
        for i, d in enumerate(self.dirs):
            for f in d.glob("*.kv"):
                if (i, f.name) not in known:
                    f.unlink(missing_ok=True)
        for key, entry in list(self._entries.items()):
            file = self.dirs[entry.dir_index] / entry.file
            size = file.stat().st_size if file.exists() else -1
            if size < entry.num_blocks * self.slot_bytes:
                log.warning("SSD tier: user %r has a missing or short file; dropped", key)
                del self._entries[key]
        self._save_index()
