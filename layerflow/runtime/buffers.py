"""Device-resident inputs and outputs of one shape bucket, at fixed addresses so a captured graph can replay them.

Every per-batch integer (offsets, lengths, page table, token ids and positions, candidate rows) is packed into one
pinned host buffer and reaches the device in a single copy; the scores come back in a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layerflow.model.batch import JaggedBatch


@dataclass(frozen=True, order=True)
class Bucket:
    """Capacity of one captured graph: users, query tokens (appended + candidates) and candidates."""

    max_batch: int
    max_tokens: int

    def fits(self, batch_size: int, num_tokens: int) -> bool:
        return batch_size <= self.max_batch and num_tokens <= self.max_tokens


class BatchBuffers:
    """Static tensors of one bucket; `fill` writes a batch into them without allocating."""

    def __init__(self, bucket: Bucket, max_pages: int, device: torch.device):
        b, t = bucket.max_batch, bucket.max_tokens
        self.bucket, self.max_pages, self.device = bucket, max_pages, device
        sizes = {"q_offsets": b + 1, "history_lens": b, "appended_lens": b, "page_table": b * max_pages,
                 "ids": t, "positions": t, "candidate_rows": t, "candidate_ids": t}
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
        self.scores = torch.zeros(t, dtype=torch.float32, device=device)
        self._scores_host = torch.zeros(t, dtype=torch.float32, pin_memory=pin)
        self.num_candidates = 0

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
        self.num_candidates = int(batch.candidate_ids.numel())
        self._device.copy_(self._host, non_blocking=True)

    def fetch_scores(self) -> torch.Tensor:
        """The batch's candidate scores on the host (synchronises with the compute stream: the designed sync)."""
        n = self.num_candidates
        self._scores_host[:n].copy_(self.scores[:n], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._scores_host[:n].clone()
