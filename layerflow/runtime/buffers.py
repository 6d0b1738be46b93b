"""Device-resident inputs and outputs of one shape bucket, at fixed addresses so a captured graph can replay them.

Every per-batch integer (offsets, lengths, page table, token ids and positions, candidate rows) is packed into one
pinned host buffer and reaches the device in a single copy; the scores come back in a single copy (torch's
`Tensor.copy_`: on the H200 a ctypes cudaMemcpyAsync was slower, docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from layerflow.model.batch import JaggedBatch, float_bits
from layerflow.model.config import HSTUConfig
from layerflow.model.reference import batch_n

def token_ladder(smallest: int, largest: int, steps: int = 8) -> tuple[int, ...]:
    """Token capacities from `smallest` to `largest` (powers of two, `smallest` >= `steps`): in each octave [p, 2p),
    `steps` evenly spaced sizes p + i * p / steps. A request of n > `smallest` tokens then fits a size below
    n * (1 + 1 / steps): at most 12.5% padding with the default 8, where powers of two alone pad up to 100%."""
    for name, value in (("smallest", smallest), ("largest", largest), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
            raise ValueError(f"{name}={value!r}: must be a positive power of two")
    if not steps <= smallest <= largest:
        raise ValueError(f"smallest={smallest}, largest={largest}, steps={steps}: need steps <= smallest <= largest")
    sizes, p = [], smallest
    while p < largest:
        sizes += range(p, 2 * p, p // steps)
        p *= 2
    return (*sizes, largest)


@dataclass(frozen=True, order=True)
class Bucket:
    """Capacity of one captured graph: users, query tokens (appended + candidates) and candidates."""

    max_batch: int
    max_tokens: int

    def fits(self, batch_size: int, num_tokens: int) -> bool:
        return batch_size <= self.max_batch and num_tokens <= self.max_tokens


class BatchBuffers:
    """Static tensors of one bucket; `fill` writes a batch into them without allocating. The engine issues every batch
    on the stream that was current when its buffers were made."""

    def __init__(self, bucket: Bucket, max_pages: int, device: torch.device, model: HSTUConfig):
        b, t = bucket.max_batch, bucket.max_tokens
        self.bucket, self.max_pages, self.device, self.model = bucket, max_pages, device, model
        sizes = {"q_offsets": b + 1, "history_lens": b, "appended_lens": b, "page_table": b * max_pages,
                 "ids": t, "positions": t, "candidate_rows": t, "candidate_ids": t, "inv_n": 1}
        total = sum(sizes.values())
        pin = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self._device = torch.zeros(total, dtype=torch.int32, device=device)
        slices: dict[str, slice] = {}
        start = 0
        for name, n in sizes.items():
            slices[name] = slice(start, start + n)
            start += n
        self._staged = {name: self._host.numpy()[s] for name, s in slices.items()}   # numpy views of the host slab
        self._table = self._staged["page_table"].reshape(b, max_pages)
        self._held: list[tuple[int, ...]] = [()] * b   # the pages each table row holds (zeros after them)
        view = {name: self._device[s] for name, s in slices.items()}
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
            self._x_bits = float_bits(self._x_host)
            self.outputs = torch.zeros(t, e, dtype=model.dtype, device=device)
            self._outputs_host = torch.zeros(t, e, dtype=model.dtype, pin_memory=pin)
        results = self._scores_host if model.embedding_tables else self._outputs_host
        self._results = results, float_bits(results)   # the host results and a numpy view of their bits
        # The compute stream (the current one when the buffers are made: the engine's), kept: fetch and the serving
        # scheduler's marks use it, and torch.cuda.current_stream() costs ~7.5 us a call on the H200's host.
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    @staticmethod
    def _to_device(device: torch.Tensor, host: torch.Tensor) -> None:
        """The whole of `host` into `device` (same shape), ordered on the current stream."""
        device.copy_(host, non_blocking=True)

    def _write_pages(self, page_rows: list[tuple[int, ...]]) -> None:
        """Each user's GPU pages at the front of its page-table row, zeros after them and in the rows past the batch
        (page 0 is valid: a kernel reading past a user's pages cannot fault). A row whose user holds the pages it held
        in this row last time plus new ones (a returning GPU hit) is given only the new ones: converting a 16K
        history's 528 page ids costs ~10 us."""
        table, held = self._table, self._held
        for b, old in enumerate(held):
            new = page_rows[b] if b < len(page_rows) else ()
            if type(new) is not tuple:
                new = tuple(new)
            if new == old:
                continue
            n, k = len(new), len(old)
            if k <= n and new[:k] == old:
                table[b, k:n] = new[k:]
            else:
                table[b, :n] = new
                table[b, n:k] = 0
            held[b] = new

    def _put(self, name: str, values: np.ndarray | list[int], tail: int = 0) -> None:
        """`values` at the front of the slab's `name` slice, `tail` after them."""
        staged = self._staged[name]
        staged[:len(values)] = values
        staged[len(values):] = tail

    def fill(self, batch: JaggedBatch, page_rows: list[tuple[int, ...]]) -> None:
        """Write a batch (and each user's GPU pages) into the static tensors: one host->device copy."""
        q_offsets = list(accumulate(batch.query_lens, initial=0))
        self._put("q_offsets", q_offsets, tail=q_offsets[-1])   # users past the batch own no tokens
        self._put("history_lens", batch.history_lens)
        self._put("appended_lens", batch.appended_lens)
        self._write_pages(page_rows)
        staged = self._staged
        self.num_tokens = batch.pack_query(staged["ids"], staged["positions"], staged["candidate_rows"])
        candidate_ids = batch.id_arrays()[1]
        self.num_candidates = len(candidate_ids)
        for name in ("ids", "positions"):
            staged[name][self.num_tokens:] = 0
        staged["candidate_rows"][self.num_candidates:] = 0
        self._put("candidate_ids", candidate_ids)
        if self.inv_n is not None:
            n = batch_n(self.model, batch.cached_lens, batch.query_lens)
            self._put("inv_n", np.array([1.0 / n], dtype=np.float32).view(np.int32))
        if batch.query_x is not None:
            rows = float_bits(batch.query_x) if batch.query_x.dtype == self._x_host.dtype else None
            if self._x_bits is None or rows is None:
                self._x_host[:self.num_tokens].copy_(batch.query_x)
            else:   # one thread's memcpy: torch's copy of a request's rows wakes its CPU thread pool
                self._x_bits[:self.num_tokens] = rows
            self._to_device(self.x, self._x_host)
        self._to_device(self._device, self._host)

    def send_results(self) -> None:
        """Queue the bucket's whole result buffer to the host on the current stream: the block's last step (inside
        its graph), so the copy never waits behind the offload copies issued after the launch."""
        if self.model.embedding_tables:
            self._scores_host.copy_(self.scores, non_blocking=True)
        else:
            self._outputs_host.copy_(self.outputs, non_blocking=True)

    def fetch(self) -> torch.Tensor:
        """The batch's results on the host (sent by `send_results`): candidate scores (fp32), or every query row's
        output for an embeddings-in model, in a fresh tensor. Synchronises with the compute stream: the designed sync.
        The copy goes through numpy: `Tensor.clone` of the pinned buffer cost ~22 us on the H200's host."""
        n = self.num_candidates if self.model.embedding_tables else self.num_tokens
        if self.stream is not None:
            self.stream.synchronize()
        host, bits = self._results
        if bits is None:
            return host[:n].clone()
        return torch.from_numpy(bits[:n].copy()).view(host.dtype)
