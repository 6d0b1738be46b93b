"""Device-resident inputs and outputs of one shape bucket, at fixed addresses so a captured graph can replay them.

Every per-batch integer (offsets, lengths, page table, token ids and positions, candidate rows) is packed into one
pinned host buffer and reaches the device in a single copy; the scores come back in a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import HSTUConfig
from layerflow.model.reference import batch_n


@dataclass(frozen=True, order=True)
class Bucket:
    """Capacity of one captured graph: users, query tokens (appended + candidates) and candidates."""

    max_batch: int
    max_tokens: int

    def fits(self, batch_size: int, num_tokens: int) -> bool:
        return batch_size <= self.max_batch and num_tokens <= self.max_tokens


class BatchBuffers:
    """Static tensors of one bucket; `fill` writes a batch into them without allocating."""

    def __init__(self, bucket: Bucket, max_pages: int, device: torch.device, model: HSTUConfig):
        b, t = bucket.max_batch, bucket.max_tokens
        self.bucket, self.max_pages, self.device, self.model = bucket, max_pages, device, model
        sizes = {"q_offsets": b + 1, "history_lens": b, "appended_lens": b, "page_table": b * max_pages,
                 "ids": t, "positions": t, "candidate_rows": t, "candidate_ids": t, "inv_n": 1}
        total = sum(sizes.values())
        pin = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(total, dtype=torch.int32, device=device)
        self._slices: dict[str, slice] = {}
        start = 0
        for name, n in sizes.items():
            self._slices[name] = slice(start, start + n)
            start += n
        view = {name: self._device[s] for name, s in self._slices.items()}
        self.q_offsets = view["q_offsets"]
        self.history_lens = view["history_lens"]
        self.appended_lens = view["appended_lens"]
        self.page_table = view["page_table"].view(b, max_pages)
        self.ids = view["ids"]
        self.positions = view["positions"]
        self.candidate_rows = view["candidate_rows"]
        self.candidate_ids = view["candidate_ids"]
        # 1/N of the batch (GR's batch rule) as float32 bits in the int32 slab; None: the kernels' constant N.
        self.inv_n = view["inv_n"].view(torch.float32) if model.attn_n_rule == "batch" else None
        self.scores = torch.zeros(t, dtype=torch.float32, device=device)
        self._scores_host = torch.zeros(t, dtype=torch.float32, pin_memory=pin)
        self.num_candidates = 0
        self.num_tokens = 0
        if not model.embedding_tables:   # the caller's token embeddings in, every query row's output back
            e = model.embedding_dim
            self.x = torch.zeros(t, e, dtype=model.dtype, device=device)
            self._x_host = torch.zeros(t, e, dtype=model.dtype, pin_memory=pin)
            self.outputs = torch.zeros(t, e, dtype=model.dtype, device=device)
            self._outputs_host = torch.zeros(t, e, dtype=model.dtype, pin_memory=pin)

    def _put(self, name: str, values: np.ndarray) -> None:
        s = self._slices[name]
        self._host_np[s.start:s.start + len(values)] = values
        self._host_np[s.start + len(values):s.stop] = 0

    def fill(self, batch: JaggedBatch, page_rows: list[tuple[int, ...]]) -> None:
        """Write a batch (and each user's GPU pages) into the static tensors: one host->device copy."""
        n = batch.batch_size
        q_offsets = batch.query_offsets.numpy()
        self._put("q_offsets", np.concatenate([q_offsets, np.full(self.bucket.max_batch - n, q_offsets[-1])]))
        self._put("history_lens", np.asarray(batch.history_lens))
        self._put("appended_lens", np.asarray(batch.appended_lens))
        table = self._host_np[self._slices["page_table"]].reshape(self.bucket.max_batch, self.max_pages)
        table.fill(0)  # page 0 is valid: a kernel reading past a user's pages cannot fault
        for b, pages in enumerate(page_rows):
            table[b, :len(pages)] = pages
        ids, positions, is_candidate = batch.query_arrays()
        self._put("ids", ids)
        self._put("positions", positions)
        self._put("candidate_rows", np.flatnonzero(is_candidate))
        self._put("candidate_ids", batch.candidate_ids.numpy())
        if self.inv_n is not None:
            n = batch_n(self.model, batch.cached_lens, batch.query_lens)
            self._put("inv_n", np.array([1.0 / n], dtype=np.float32).view(np.int32))
        self.num_candidates = int(batch.candidate_ids.numel())
        self.num_tokens = int(sum(batch.query_lens))
        if batch.query_x is not None:
            self._x_host[:self.num_tokens].copy_(batch.query_x)
            self.x.copy_(self._x_host, non_blocking=True)
        self._device.copy_(self._host, non_blocking=True)

    def fetch(self) -> torch.Tensor:
        """The batch's results on the host: candidate scores (fp32), or every query row's output for an
        embeddings-in model. Synchronises with the compute stream: the designed sync."""
        if self.model.embedding_tables:
            host, device, n = self._scores_host, self.scores, self.num_candidates
        else:
            host, device, n = self._outputs_host, self.outputs, self.num_tokens
        host[:n].copy_(device[:n], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return host[:n].clone()
