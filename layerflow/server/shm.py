"""Shared memory for the server's host pool and for a CPU client's KV pool.

A memfd has no name in the filesystem: it is shared only by passing its fd over the
authenticated socket (SCM_RIGHTS), so no other process can open it by path. Every memfd is
sealed against shrinking and growing once sized, and one received from another process is
mapped only if it carries those seals: whoever holds the fd can then no longer truncate it
under a mapping, which would turn the next access into a SIGBUS.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import torch

from layerflow.tier.layout import KVLayout


SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def check_sealed(fd: int, size: int) -> None:
    """Refuse (ValueError) an fd that is not a memfd sealed against resizing, or that holds fewer than `size` bytes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise ValueError(f"shared memory fd {fd} is not a sealable memfd ({e.strerror})") from None
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise ValueError(f"shared memory fd {fd} is not sealed against shrinking and growing (seals {seals:#x}): "
                         f"create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK | F_SEAL_GROW")
    held = os.fstat(fd).st_size
    if held < size:
        raise ValueError(f"shared memory fd {fd} holds {held} bytes < size={size}")


class SharedMemory:
    """A memfd of `size` bytes mapped read-write; `tensor` is a flat uint8 view of it.

    Without `fd`, a new memfd sized and sealed here; with one, it must be sealed and hold `size` bytes (taken over:
    `close` closes it)."""

    def __init__(self, size: int, name: str = "layerflow-kv", fd: int | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size={size!r}: must be a positive integer")
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
            except BaseException:
                os.close(fd)
                raise
        else:
            check_sealed(fd, size)
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        """Close the fd; the mapping lives as long as tensors view it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pool_bytes(layout: KVLayout, num_pages: int) -> int:
    """Bytes of a GPU-layout pool (one `[num_pages, 2, page, H, D]` tensor per layer) laid end to end."""
    return sum(num_pages * layout.layer_page_bytes(g) for g, _ in layout.layer_map)


def pool_layers(layout: KVLayout, num_pages: int, flat: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer `[num_pages, 2, page, H, D]` tensors laid end to end over a flat uint8 buffer."""
    layers, offset = [], 0
    for g, _ in layout.layer_map:
        nbytes = num_pages * layout.layer_page_bytes(g)
        shape = (num_pages, *layout.gpu_page_shape(g))
        layers.append(flat[offset:offset + nbytes].view(layout.groups[g].dtype).view(shape))
        offset += nbytes
    return layers


def shared_cpu_pool(layout: KVLayout, num_pages: int) -> tuple[SharedMemory, list[torch.Tensor]]:
    """A CPU client's KV pool in shared memory, so the server can copy into it directly."""
    shm = SharedMemory(pool_bytes(layout, num_pages), name="layerflow-client-kv")
    return shm, pool_layers(layout, num_pages, shm.tensor)
