"""A bucket's pinned host slab of per-batch integers, and an item-id batch packed straight into it.

The device reads every per-batch integer (offsets, lengths, page table, token ids and positions, candidate rows and
ids, 1/N) from one int32 slab per bucket, filled by one host->device copy from a pinned host slab laid out the same.
`HostSlab` is that host side with its numpy views, made once. `stage_items` writes an item-id batch's requests into a
slab during `prepare` (the ids range-checked on the request's lists first), so no per-request batch tensors are built
and the launch only issues the copy. A slab handed to a prepared batch stays its own until the batch is collected or given up: the
copy reads it asynchronously, and another batch may be prepared while this one is in flight.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from layerflow.model.batch import BatchShape, check_item_ids
from layerflow.model.config import HSTUConfig
from layerflow.model.reference import batch_n


def slab_fields(max_batch: int, max_tokens: int, max_pages: int) -> dict[str, slice]:
    """Each field's slice of a bucket's int32 slab (host and device share it); the per-user lengths lead it."""
    sizes = {"q_offsets": max_batch + 1, "history_lens": max_batch, "appended_lens": max_batch,
             "page_table": max_batch * max_pages, "ids": max_tokens, "positions": max_tokens,
             "candidate_rows": max_tokens, "candidate_ids": max_tokens, "inv_n": 1}
    slices, start = {}, 0
    for name, n in sizes.items():
        slices[name] = slice(start, start + n)
        start += n
    return slices


class HostSlab:
    """The host side of a bucket's slab (pinned when `pin`; positions up to `max_position`) and a numpy view of each
    field. It remembers the page ids each table row holds and how many token and candidate entries the last batch
    wrote, so the next batch writes only what changed and clears only what that batch left behind."""

    def __init__(self, fields: dict[str, slice], max_batch: int, max_pages: int, max_position: int, pin: bool):
        total = max(s.stop for s in fields.values())
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.address = self.host.data_ptr()   # taken once: Tensor.data_ptr is a torch call per request otherwise
        whole = self.host.numpy()
        self.views = {name: whole[s] for name, s in fields.items()}
        self.table = self.views["page_table"].reshape(max_batch, max_pages)
        self.lengths = whole[:fields["appended_lens"].stop]   # q_offsets, history_lens, appended_lens
        self.held: list[tuple[int, ...]] = [()] * max_batch   # the pages each table row holds (zeros after them)
        # 0, 1, 2, ...: positions and candidate rows are slices of it (a copy, where an arange would be a ufunc)
        self.ramp = np.arange(max(max_position, len(self.views["ids"])) + 1, dtype=np.int32)
        self.tokens_written = self.candidates_written = 0
        self.taken = False   # handed to a staged batch (BatchBuffers.take_slab / give_slab)
        self.packer: object | None = None   # the native packer's state for this slab (native_staging.py), if used

    def write_pages(self, page_rows: Sequence[Sequence[int]]) -> None:
        """Each user's GPU pages at the front of its page-table row, zeros after them and in the rows past the batch
        (page 0 is valid: a kernel reading past a user's pages cannot fault). A row whose user holds the pages it held
        in this row last time plus new ones (a returning GPU hit) is given only the new ones: converting a 16K
        history's 528 page ids costs ~10 us."""
        table, held = self.table, self.held
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

    def put(self, name: str, values: np.ndarray | list[int], tail: int = 0) -> None:
        """`values` at the front of the field `name`, `tail` after them."""
        staged = self.views[name]
        staged[:len(values)] = values
        staged[len(values):] = tail

    def write_lengths(self, model: HSTUConfig, cached_lens: list[int], appended_lens: list[int],
                      query_lens: list[int]) -> None:
        """The per-user fields in one write (they lead the slab, in this order): query offsets (users past the batch
        own no tokens), history and appended lengths (zero past the batch); and 1/N (as float32 bits) for a model
        that takes N from the batch."""
        offsets = [0]
        for n in query_lens:
            offsets.append(offsets[-1] + n)
        pad = [0] * (len(self.held) - len(cached_lens))
        self.lengths[:] = offsets + [offsets[-1]] * len(pad) + [c + a for c, a in zip(cached_lens, appended_lens)] \
            + pad + appended_lens + pad
        if model.attn_n_rule == "batch":
            n = batch_n(model, cached_lens, query_lens)
            self.views["inv_n"][0] = np.array(1.0 / n, dtype=np.float32).view(np.int32)

    def clear_past(self, num_tokens: int, num_candidates: int) -> None:
        """Zero the token and candidate entries a larger batch before left past these counts."""
        views = self.views
        if self.tokens_written > num_tokens:
            for name in ("ids", "positions"):
                views[name][num_tokens:self.tokens_written] = 0
        if self.candidates_written > num_candidates:
            for name in ("candidate_rows", "candidate_ids"):
                views[name][num_candidates:self.candidates_written] = 0
        self.tokens_written, self.candidates_written = num_tokens, num_candidates


@dataclass(frozen=True)
class StagedBatch(BatchShape):
    """An item-id batch already packed into `slab` (the slab of the bucket `bucket`; `num_tokens` query tokens,
    `num_candidates` candidates), ready for one host->device copy."""

    bucket: Hashable
    slab: HostSlab = field(repr=False, compare=False)
    num_tokens: int
    num_candidates: int
    query_x = None   # an item-id batch carries no embeddings


def _in_vocabulary(model: HSTUConfig, lists: Sequence[list[int]]) -> bool:
    """Whether every id of these plain-int lists lies in [0, vocabulary), by the builtins min and max: no numpy
    reduction, whose machinery costs tens of microseconds when the host's caches are cold, as they are per request."""
    try:
        return all(not ids or (min(ids) >= 0 and max(ids) < model.item_vocab_size) for ids in lists)
    except TypeError:   # not a number: named by the per-user check
        return False


def stage_items(slab: HostSlab, model: HSTUConfig, users: list[int], cached_lens: list[int],
                appended: list[list[int]], candidates: list[list[int]], page_rows: Sequence[Sequence[int]],
                bucket: Hashable) -> StagedBatch:
    """Pack lists of plain-int ids (a Request's, or a stored history joined with one) into `slab`: per user its
    appended ids then its candidates, each appended token at cached_len + j and every candidate at the history length.
    A bad id raises ValueError naming the user and the id before anything is written. Every write is a slice
    assignment from a list or from another int32 slice (the ramp of positions): few distinct numpy paths per request."""
    if not (_in_vocabulary(model, appended) and _in_vocabulary(model, candidates)):
        check_item_ids(model, users, appended, candidates)   # raises, naming the user and the id
        raise ValueError(f"users {users}: the item ids failed their range check")
    views, ramp = slab.views, slab.ramp
    ids, positions = views["ids"], views["positions"]
    candidate_rows, candidate_ids = views["candidate_rows"], views["candidate_ids"]
    appended_lens, candidate_lens = [len(a) for a in appended], [len(k) for k in candidates]
    row = first_candidate = 0
    for cached, a_ids, k_ids, a, k in zip(cached_lens, appended, candidates, appended_lens, candidate_lens):
        ids[row:row + a] = a_ids
        ids[row + a:row + a + k] = k_ids
        positions[row:row + a] = ramp[cached:cached + a]
        positions[row + a:row + a + k] = cached + a
        candidate_rows[first_candidate:first_candidate + k] = ramp[row + a:row + a + k]
        candidate_ids[first_candidate:first_candidate + k] = ids[row + a:row + a + k]
        row, first_candidate = row + a + k, first_candidate + k
    slab.clear_past(row, first_candidate)
    query_lens = [a + k for a, k in zip(appended_lens, candidate_lens)]
    slab.write_lengths(model, cached_lens, appended_lens, query_lens)
    slab.write_pages(page_rows)
    return StagedBatch(list(cached_lens), appended_lens, candidate_lens, bucket, slab, row, first_candidate)
