"""Shared memory for the server's host pool and for a CPU client's KV pool.

A memfd has no name in the filesystem: it is shared only by passing its fd over the
authenticated socket (SCM_RIGHTS), so no other process can open it by path.
"""

from __future__ import annotations

import mmap
import os

import torch

from layerflow.tier.layout import KVLayout


class SharedMemory:
    """A memfd of `size` bytes mapped read-write; `tensor` is a flat uint8 view of it."""

    def __init__(self, size: int, name: str = "layerflow-kv", fd: int | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size={size!r}: must be a positive integer")
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise ValueError(f"shared memory fd {fd} holds {os.fstat(fd).st_size} bytes < size={size}")
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
