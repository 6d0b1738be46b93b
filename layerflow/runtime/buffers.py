"""Device-resident inputs and outputs of one shape bucket, at fixed addresses so a captured graph can replay them.

Every per-batch integer (offsets, lengths, page table, token ids and positions, candidate rows) is packed into one
pinned host buffer and reaches the device in a single copy; the scores come back in a single copy (torch's
`Tensor.copy_`). On CUDA the integers' copy is one ctypes cudaMemcpyAsync on the buffers' own stream handle and
addresses, taken once: on the H200 it halves the fill's host time against torch's `copy_` (~0.04 -> ~0.02 ms; a ctypes
copy that looked the stream up per call was slower, docs/performance.md). The CPU path copies with torch.

On CUDA the fetch waits for the batch's done word (runtime/done_word.py), which the results' send sets right after
their copy (inside the graph) and `fill` clears, rather than for the stream's completion.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from layerflow.model.batch import JaggedBatch, float_bits
from layerflow.model.config import HSTUConfig
from layerflow.runtime.done_word import DoneWord
from layerflow.runtime.staging import HostSlab, StagedBatch, slab_fields
from layerflow.transfer import cudart


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


class Bucket(NamedTuple):
    """Capacity of one captured graph: users and query tokens (appended + candidates). A named tuple: a request
    hashes and compares its bucket several times (buffers, graphs, the staged batch's check), and a tuple's hash and
    equality run in C where a dataclass's are Python calls, each a few microseconds when the host's caches are cold."""

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
        slices = slab_fields(b, t, max_pages)
        self._pin = device.type == "cuda"
        self._slab = HostSlab(slices, b, max_pages, model.max_seq_len, self._pin)   # the one a JaggedBatch fills
        self._spare: list[HostSlab] = []   # slabs for staged batches, given back after their batch
        self._device = torch.zeros(len(self._slab.host), dtype=torch.int32, device=device)
        self._device_address, self._slab_bytes = self._device.data_ptr(), self._device.nbytes
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
        self._scores_host = torch.zeros(t, dtype=torch.float32, pin_memory=self._pin)
        self.num_candidates = 0
        self.num_tokens = 0
        if not model.embedding_tables:   # the caller's token embeddings in, every query row's output back
            e = model.embedding_dim
            self.x = torch.zeros(t, e, dtype=model.dtype, device=device)
            self._x_host = torch.zeros(t, e, dtype=model.dtype, pin_memory=self._pin)
            self._x_bits = float_bits(self._x_host)
            self.outputs = torch.zeros(t, e, dtype=model.dtype, device=device)
            self._outputs_host = torch.zeros(t, e, dtype=model.dtype, pin_memory=self._pin)
        results = self._scores_host if model.embedding_tables else self._outputs_host
        self._results = results, float_bits(results)   # the host results and a numpy view of their bits
        # The compute stream (the current one when the buffers are made: the engine's), kept: fetch and the serving
        # scheduler's marks use it, and torch.cuda.current_stream() costs ~7.5 us a call on the H200's host.
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._raw_stream = self.stream.cuda_stream if self.stream is not None else None   # 0: the legacy default
        if self._raw_stream is not None:
            cudart.lib()   # loaded at set-up, never by a request's first cudart fill
        self._done = DoneWord(self._raw_stream) if self._raw_stream is not None else None

    @staticmethod
    def _to_device(device: torch.Tensor, host: torch.Tensor) -> None:
        """The whole of `host` into `device` (same shape), ordered on the current stream."""
        device.copy_(host, non_blocking=True)

    def _slab_to_device(self, slab: HostSlab) -> None:
        """A whole host slab into the device slab: on CUDA one cudart copy on the buffers' stream (the current one when
        a batch is issued) from the slab's address taken once, else torch's copy."""
        if self._raw_stream is not None:
            cudart.memcpy_async(self._device_address, slab.address, self._slab_bytes, cudart.MEMCPY_HOST_TO_DEVICE,
                                self._raw_stream)
        else:
            self._to_device(self._device, slab.host)

    def take_slab(self) -> HostSlab:
        """A host slab of this bucket for a staged batch (`stage_items`), its own until `give_slab`."""
        if self._spare:
            slab = self._spare.pop()
        else:
            b, t = self.bucket.max_batch, self.bucket.max_tokens
            slab = HostSlab(slab_fields(b, t, self.max_pages), b, self.max_pages, self.model.max_seq_len, self._pin)
        slab.taken = True
        return slab

    def give_slab(self, slab: HostSlab) -> None:
        """A staged batch's slab back, once its host->device copy has run (its batch was collected or never sent);
        a slab already given back stays given."""
        if slab.taken:
            slab.taken = False
            self._spare.append(slab)

    def fill(self, batch: JaggedBatch | StagedBatch, page_rows: list[tuple[int, ...]]) -> None:
        """Write a batch (and each user's GPU pages) into the static tensors: one host->device copy. A StagedBatch
        (`stage_items`, its slab one of this bucket's) is already in its slab: only the copy is issued."""
        if self._done is not None:
            self._done.clear()
        if isinstance(batch, StagedBatch):
            if batch.bucket != self.bucket:
                raise ValueError(f"a batch staged for {batch.bucket} filled into the buffers of {self.bucket}")
            self.num_tokens, self.num_candidates = batch.num_tokens, batch.num_candidates
            self._slab_to_device(batch.slab)
            return
        slab = self._slab
        slab.write_lengths(self.model, batch.cached_lens, batch.appended_lens, batch.query_lens)
        slab.write_pages(page_rows)
        staged = slab.views
        self.num_tokens = batch.pack_query(staged["ids"], staged["positions"], staged["candidate_rows"])
        candidate_ids = batch.id_arrays()[1]
        self.num_candidates = len(candidate_ids)
        for name in ("ids", "positions"):
            staged[name][self.num_tokens:] = 0
        staged["candidate_rows"][self.num_candidates:] = 0
        slab.put("candidate_ids", candidate_ids)
        if batch.query_x is not None:
            rows = float_bits(batch.query_x) if batch.query_x.dtype == self._x_host.dtype else None
            if self._x_bits is None or rows is None:
                self._x_host[:self.num_tokens].copy_(batch.query_x)
            else:   # one thread's memcpy: torch's copy of a request's rows wakes its CPU thread pool
                self._x_bits[:self.num_tokens] = rows
            self._to_device(self.x, self._x_host)
        self._slab_to_device(slab)

    def send_results(self) -> None:
        """Queue the bucket's whole result buffer to the host on the current stream: the block's last step (inside
        its graph), so the copy never waits behind the offload copies issued after the launch."""
        if self.model.embedding_tables:
            self._scores_host.copy_(self.scores, non_blocking=True)
        else:
            self._outputs_host.copy_(self.outputs, non_blocking=True)
        if self._done is not None:
            self._done.set_on(torch.cuda.current_stream(self.device).cuda_stream)

    def fetch(self) -> torch.Tensor:
        """The batch's results on the host (sent by `send_results`): candidate scores (fp32), or every query row's
        output for an embeddings-in model, in a fresh tensor. Waits for the batch's done word on CUDA: the designed
        sync. The copy goes through numpy: `Tensor.clone` of the pinned buffer cost ~22 us on the H200's host."""
        n = self.num_candidates if self.model.embedding_tables else self.num_tokens
        if self._done is not None:
            self._done.wait()
        host, bits = self._results
        if bits is None:
            return host[:n].clone()
        return torch.from_numpy(bits[:n].copy()).view(host.dtype)
