"""Block-first KV in host memory: `[num_blocks, layers, 2, rows, H, D]` per layer group, LRU by user (`rows`: the page
size, plus the scale rows of an fp8 cache; layerflow.tier.layout).

Pinned when CUDA is present, so copies run at the PCIe rate. The pool can also be laid over a buffer it did not
allocate (a shared-memory mmap of the transfer server): blocks then live where the other process can see them.
"""

from __future__ import annotations

import torch

from layerflow.tier.layout import KVLayout
from layerflow.tier.user_pages import UserPages


class HostKVPool(UserPages):
    """`blocks[group]` is `[num_blocks, layers, 2, rows, H, D]`; a block index means the same tokens everywhere.

    The host is the last in-memory tier, so a full pool evicts LRU unpinned users on `allocate` by default (pass
    `can_drop` to veto, e.g. users not yet written to SSD).
    """

    drop_by_default = True
    unit = "block"

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_blocks: int | None = None,
        cpu_cache_gb: float | None = None,
        pin_memory: bool | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """Size the pool by `num_blocks` or `cpu_cache_gb` (GiB), or by `buffer` (flat uint8) when neither is given.

        `pin_memory=None` pins when CUDA is available. A given `buffer` is used as is (registering it with CUDA is
        its owner's job), so it excludes `pin_memory=True`.
        """
        if num_blocks is not None and cpu_cache_gb is not None:
            raise ValueError(f"num_blocks={num_blocks!r} and cpu_cache_gb={cpu_cache_gb!r}: give one, not both")
        if cpu_cache_gb is not None:
            num_blocks = layout.pages_for_gb(cpu_cache_gb)
        if buffer is not None:
            num_blocks = self._check_buffer(layout, buffer, num_blocks, pin_memory)
        elif num_blocks is None:
            raise ValueError("num_blocks=None, cpu_cache_gb=None, buffer=None: one of them must size the pool")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available() and buffer is None
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True: CUDA is not available to pin host memory")
        super().__init__(num_blocks, layout.page_size)
        self.layout = layout
        self.pinned = bool(pin_memory)
        self.blocks: list[torch.Tensor] = []
        offset = 0
        for g, group in enumerate(layout.groups):
            shape = (num_blocks, *layout.host_block_shape(g))
            if buffer is None:
                self.blocks.append(torch.empty(shape, dtype=group.storage_dtype, pin_memory=self.pinned))
            else:
                nbytes = num_blocks * layout.block_bytes(g)
                self.blocks.append(buffer[offset:offset + nbytes].view(group.storage_dtype).view(shape))
                offset += nbytes

    @staticmethod
    def _check_buffer(layout: KVLayout, buffer: torch.Tensor, num_blocks: int | None, pin_memory: bool | None) -> int:
        if pin_memory:
            raise ValueError("pin_memory=True with a given buffer: register the buffer with CUDA instead")
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.is_cuda:
            raise ValueError(
                f"buffer: expected a contiguous 1-D uint8 host tensor, got {buffer.dtype} {tuple(buffer.shape)} "
                f"on {buffer.device}"
            )
        fits = buffer.numel() // layout.page_bytes
        if num_blocks is None:
            num_blocks = fits
        if num_blocks > fits:
            raise ValueError(
                f"buffer of {buffer.numel()} bytes holds {fits} blocks of {layout.page_bytes} bytes < "
                f"num_blocks={num_blocks}"
            )
        return num_blocks
