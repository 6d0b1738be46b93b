"""SSD tier: a user's host blocks spilled to one file, checksummed, LRU-evicted, in directories this store owns.

One file per user keeps a user's blocks sequential on disk (reads at the disk's streaming rate) and makes eviction an
unlink. Block b of a file sits at `b * slot_bytes`, where `slot_bytes` rounds one block (all layers of all groups) up
to 4 KiB so O_DIRECT reads land directly in the page-aligned host pool. Every block carries an xxh3-64 checksum (about
8x the rate of zlib.crc32); a short read (torn or truncated file) or a mismatch is a Miss and the copy is dropped:
corrupt data is never served.

Nothing outlives the store. Its owner (an engine or a transfer server) keeps no user history across a restart, so no
copy could be served again: there is no index on disk, the copies a previous owner left are deleted at start (regular
`.kv` files of this uid; links and other files are left alone) so they take no capacity, and dropping a copy is one
unlink, which needs no free space.

Each directory is an `SsdDirectory` (ours, private, locked for this store); every file is opened relative to its
descriptor with O_NOFOLLOW, and a copy is created with O_EXCL under a fresh random name, mode 0600.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from layerflow.tier.ssd_directory import COPY_SUFFIX, SsdDirectory, take_directories

log = logging.getLogger(__name__)

ALIGN = 4096
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
    checksums: list[int]


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


def _checksum(views: list[memoryview]) -> int:
    digest = xxhash.xxh3_64()
    for v in views:
        digest.update(v)
    return digest.intdigest()


def odirect_supported(directory: str | os.PathLike) -> bool:
    """Whether the filesystem under `directory` accepts O_DIRECT (tmpfs, for one, does not)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _odirect_probe(fd)
    finally:
        os.close(fd)


def _odirect_probe(dir_fd: int) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    name = f".odirect-probe-{secrets.token_hex(8)}"
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name, dir_fd=dir_fd)
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
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.slot_bytes = self.slot_size(block_bytes)
        self.group_blocks = group_blocks
        self._dirs = take_directories(self.dirs)
        self.odirect = [_odirect_probe(d.fd) for d in self._dirs]
        for d, ok in zip(self.dirs, self.odirect):
            if not ok:
                log.info("SSD tier: %s does not support O_DIRECT, using buffered I/O", d)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="layerflow-ssd")
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU first, MRU last

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
        dir_index = int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(self._dirs)
        name = f"{secrets.token_hex(10)}{COPY_SUFFIX}"
        views = [host(b) for b in blocks]
        checksums = self._write(self._dirs[dir_index], name, views, self._direct(dir_index, views))
        with self._lock:
            old = self._entries.pop(key, None)
            evicted = []
            used = sum(e.num_blocks for e in self._entries.values()) * self.slot_bytes
            while used + need > self.capacity_bytes:
                victim, entry = self._entries.popitem(last=False)
                used -= entry.num_blocks * self.slot_bytes
                evicted.append((victim, entry))
            self._entries[key] = _Entry(name, dir_index, len(blocks), checksums)
        for entry in ([old] if old else []) + [e for _, e in evicted]:
            self._unlink(entry)
        return [victim for victim, _ in evicted]

    def load(self, user: str | int, host: HostBlocks, blocks: Sequence[int],
             on_group: Callable[[list[int]], None] | None = None) -> None:
        """Read the first len(`blocks`) of `user`'s blocks into host `blocks`; raise Miss (and drop the copy) on
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
        directory = self._dirs[entry.dir_index]
        views = [host(b) for b in blocks]
        direct = self._direct(entry.dir_index, views)
        try:
            fd = directory.open(entry.file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError as e:
            self._drop(key, entry, f"cannot open its file: {e.strerror}")
            raise Miss(f"user {key!r}: SSD file {directory.path / entry.file} cannot be opened: {e.strerror}") \
                from None
        starts = range(0, len(blocks), self.group_blocks)
        futures = [self._pool.submit(self._read_group, fd, views, entry.checksums, s, s + self.group_blocks)
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
        """Remove `user` from SSD (one unlink: no free space needed); False if it was not there."""
        with self._lock:
            entry = self._entries.pop(str(user), None)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def close(self) -> None:
        """Stop the I/O threads and release the directories (their locks go; the copies stay until the next owner
        deletes them)."""
        self._pool.shutdown(wait=True)
        for d in self._dirs:
            d.close()

    # ---- I/O --------------------------------------------------------------------------------

    def _direct(self, dir_index: int, views: list[list[memoryview]]) -> bool:
        return self.odirect[dir_index] and all(_views_aligned(v) for v in views)

    def _write(self, directory: SsdDirectory, name: str, views: list[list[memoryview]], direct: bool) -> list[int]:
        """A new file `name` (created exclusively: nothing that was there is followed or overwritten) holding `views`;
        returns their checksums. A failed write leaves no file."""
        fd = directory.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0))
        try:
            os.ftruncate(fd, len(views) * self.slot_bytes)
            starts = range(0, len(views), self.group_blocks)
            futures = [self._pool.submit(self._write_group, fd, views, s, s + self.group_blocks) for s in starts]
            try:
                checksums = [c for fut in futures for c in fut.result()]
            finally:
                wait(futures)  # a failed group must not close the fd under a write still in flight
            if not direct:
                os.fdatasync(fd)  # written back, so the advice below can drop the pages from the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            directory.unlink(name)
            raise
        os.close(fd)
        return checksums

    def _write_group(self, fd: int, views: list[list[memoryview]], start: int, stop: int) -> list[int]:
        checksums = []
        for i in range(start, min(stop, len(views))):
            checksums.append(_checksum(views[i]))
            written = os.pwritev(fd, views[i], i * self.slot_bytes)
            if written != self.block_bytes:
                raise OSError(f"short write of block {i}: {written} of {self.block_bytes} bytes")
        return checksums

    def _read_group(self, fd: int, views: list[list[memoryview]], checksums: list[int],
                    start: int, stop: int) -> str | None:
        try:
            return self._read_checked(fd, views, checksums, start, min(stop, len(views)))
        except OSError as e:
            return f"read error at block {start}: {e}"

    def _read_checked(self, fd: int, views: list[list[memoryview]], checksums: list[int], start: int,
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
            if _checksum(views[i]) != checksums[i]:
                return f"checksum mismatch in block {i}"
        return None

    def _drop(self, key: str, entry: _Entry, why: str) -> None:
        log.warning("SSD tier: dropping user %r: %s", key, why)
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
        self._unlink(entry)

    def _unlink(self, entry: _Entry) -> None:
        self._dirs[entry.dir_index].unlink(entry.file)
