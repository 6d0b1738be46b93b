"""Jagged batches: B users of different lengths, described by offsets (no padding in the math).

Per user b: `cached_lens[b]` history tokens whose K/V are cached, `appended` new history items, `candidates` items to
score. The query tokens of the cached path are each user's appended tokens followed by its candidates.
Positions: appended token j sits at cached_len + j; every candidate sits at the history length (the next slot), so a
candidate's result never depends on the other candidates or their order.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, chain

import numpy as np
import torch

from layerflow.model.config import HSTUConfig


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int64)


# Per float dtype: the integer view of its bits, the mask that drops the sign, and the smallest masked value that is
# inf or nan (every exponent bit set).
_NONFINITE_BITS = {torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
                   torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
                   torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
                   torch.float16: (torch.int16, 0x7FFF, 0x7C00)}


def float_bits(x: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU float tensor's bits (None for a dtype without one, or a GPU tensor): numpy copies and
    reductions run on one thread, where torch's CPU ops on a request's rows wake its thread pool."""
    bits = _NONFINITE_BITS.get(x.dtype)
    if bits is None or x.device.type != "cpu":
        return None
    return x.detach().view(bits[0]).numpy()


def _concat_rows(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.cat(rows)` of CPU [n, width] tensors of `dtype`, copied by numpy where the dtype allows."""
    out = torch.empty(sum(len(r) for r in rows), width, dtype=dtype)
    out_bits = float_bits(out)
    if out_bits is None:
        return torch.cat(rows, out=out) if rows else out
    start = 0
    for r in rows:
        out_bits[start:start + len(r)] = float_bits(r)
        start += len(r)
    return out


def _all_finite(x: torch.Tensor) -> bool:
    """`torch.isfinite(x).all()` for a float tensor, by one mask and one max over its bits in numpy for a CPU tensor
    of a common float dtype: torch's CPU isfinite on bfloat16 costs ~0.6 ms for one request's 320 x 512 rows."""
    bits = float_bits(x)
    if bits is None or not bits.size:
        return bool(torch.isfinite(x).all())
    _, mask, first_nonfinite = _NONFINITE_BITS[x.dtype]
    return int((bits & mask).max()) < first_nonfinite


def _outside_vocabulary(config: HSTUConfig, ids: np.ndarray) -> bool:
    """Whether any int64 id is negative or past the vocabulary: one reduction (a negative id reads as a huge
    unsigned one)."""
    return bool(ids.size) and int(ids.view(np.uint64).max()) >= config.item_vocab_size


def _batch_item_ids(config: HSTUConfig, names: list, appended: Sequence, candidates: Sequence,
                    plain_ints: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every user's appended ids and candidate ids as two int64 arrays in batch order. When every user's ids are a
    list of plain ints (what a Request holds; `plain_ints`: the caller vouches for that, so the type scan is
    skipped), the whole batch is converted and range-checked at once; otherwise, or when that check fails, user by
    user (`_item_ids`), so the error names the user and the id."""
    lists = [*appended, *candidates]
    if plain_ints or (all(type(ids) is list for ids in lists) and set(map(type, chain.from_iterable(lists))) <= {int}):
        try:
            ids = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=sum(map(len, lists)))
        except (OverflowError, TypeError, ValueError):   # an id past int64, or not a number: named below
            ids = None
        if ids is not None and not _outside_vocabulary(config, ids):
            split = sum(map(len, appended))
            return ids[:split], ids[split:]
    return tuple(np.concatenate([np.zeros(0, np.int64), *[_item_ids(config, b, kind, i) for b, i in zip(names, lists)]])
                 for kind, lists in (("appended", appended), ("candidate", candidates)))


def _item_ids(config: HSTUConfig, user: object, kind: str, ids: Sequence[object]) -> np.ndarray:
    """`ids` as int64, checked in bulk. Any integer-like id (`operator.index`: int, IntEnum, numpy or torch integers)
    counts as its int value; bool and everything else is refused. The per-item pass that names the bad id runs only
    when the fast path (plain ints, or an integer array, all in the vocabulary) does not apply."""
    arr = None
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        arr = ids.astype(np.int64)  # a uint64 past 2**63 wraps negative and takes the naming pass below
    elif set(map(type, ids)) <= {int}:
        try:
            arr = np.array(ids, dtype=np.int64)
        except OverflowError:
            arr = None
    if arr is not None and not _outside_vocabulary(config, arr):
        return arr
    values = []
    for item in ids:
        try:
            if isinstance(item, bool):
                raise TypeError
            value = operator.index(item)
        except TypeError:
            raise ValueError(f"user {user}: {kind} item id {item!r} is not an integer ({type(item).__name__})") \
                from None
        if not 0 <= value < config.item_vocab_size:
            raise ValueError(f"user {user}: {kind} item id {value} out of vocabulary [0, {config.item_vocab_size})")
        values.append(value)
    return np.array(values, dtype=np.int64)


def check_lengths(config: HSTUConfig, names: Sequence, cached_lens: Sequence[int], appended: Sequence[Sized],
                  candidates: Sequence[Sized]) -> None:
    """ValueError naming the first user whose cached + appended + candidate tokens exceed the model's max_seq_len:
    lengths only, so a caller can refuse such a batch before placing it (the packing checks it again)."""
    for b, c, a, k in zip(names, cached_lens, appended, candidates):
        if c + len(a) + len(k) > config.max_seq_len:
            raise ValueError(f"user {b}: total length {c + len(a) + len(k)} (cached {c} + appended {len(a)} + "
                             f"candidates {len(k)}) exceeds max_seq_len={config.max_seq_len}")


def check_item_ids(config: HSTUConfig, names: list, appended: Sequence, candidates: Sequence) -> None:
    """ValueError naming the first user and id that is not an integer in the vocabulary (the per-user pass)."""
    _batch_item_ids(config, names, appended, candidates)


@dataclass(frozen=True)
class BatchShape:
    """Per user of a batch: cached history tokens, appended tokens and candidates (what every packing of the batch
    and the split of its results need)."""

    cached_lens: list[int]
    appended_lens: list[int]
    candidate_lens: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.cached_lens)

    @property
    def history_lens(self) -> list[int]:
        """History length after this request's append."""
        return [c + a for c, a in zip(self.cached_lens, self.appended_lens)]

    @property
    def query_lens(self) -> list[int]:
        return [a + k for a, k in zip(self.appended_lens, self.candidate_lens)]


@dataclass(frozen=True)
class JaggedBatch(BatchShape):
    appended_ids: torch.Tensor   # int64 [sum appended] (empty for an embeddings-in batch)
    candidate_ids: torch.Tensor  # int64 [sum candidates] (empty for an embeddings-in batch)
    query_x: torch.Tensor | None = None   # [sum (appended + candidates), E]: an embeddings-in batch's token rows
    # The two id tensors' numpy arrays when the batch was built from them (`id_arrays`).
    id_numpy: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_embeddings(cls, config: HSTUConfig, cached_lens: list[int], appended: list[torch.Tensor],
                        candidates: list[torch.Tensor], user_ids: list[int] | None = None) -> "JaggedBatch":
        """Pack per-user token embeddings ([n, E] each, the model's dtype) of a model whose caller brings them;
        the query rows are each user's appended tokens, then its candidates."""
        if not (len(cached_lens) == len(appended) == len(candidates)):
            raise ValueError(f"batch sizes disagree: cached_lens={len(cached_lens)}, appended={len(appended)}, "
                             f"candidates={len(candidates)}")
        names = list(range(len(cached_lens))) if user_ids is None else user_ids
        rows = []
        for b, c, a, k in zip(names, cached_lens, appended, candidates):
            for kind, x in (("appended", a), ("candidate", k)):
                if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != config.embedding_dim:
                    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(f"user {b}: {kind} embeddings {shape}: expected [n, {config.embedding_dim}]")
                if not x.dtype.is_floating_point or not _all_finite(x):
                    raise ValueError(f"user {b}: {kind} embeddings must be finite floats, got {x.dtype}")
            check_lengths(config, [b], [c], [a], [k])
            rows += [a.to("cpu", config.dtype), k.to("cpu", config.dtype)]
        x = _concat_rows(rows, config.embedding_dim, config.dtype)
        return cls(cached_lens=list(cached_lens), appended_lens=[len(a) for a in appended],
                   candidate_lens=[len(k) for k in candidates],
                   appended_ids=torch.zeros(sum(len(a) for a in appended), dtype=torch.int64),
                   candidate_ids=torch.zeros(sum(len(k) for k in candidates), dtype=torch.int64),
                   query_x=x)

    @classmethod
    def from_lists(cls, config: HSTUConfig, cached_lens: list[int], appended: list[list[int]],
                   candidates: list[list[int]], user_ids: list[int] | None = None,
                   plain_ints: bool = False) -> "JaggedBatch":
        """Validate and pack per-user lists; every bad value raises ValueError naming the user and value.

        Users are named by `user_ids` when given, else by their index in the batch. `plain_ints`: the caller
        guarantees every id is a plain int (a Request's lists are, from its construction), so only the vocabulary
        is checked: the per-id type scan is most of the packing time of a request.
        """
        if not (len(cached_lens) == len(appended) == len(candidates)):
            raise ValueError(
                f"batch sizes disagree: cached_lens={len(cached_lens)}, appended={len(appended)}, "
                f"candidates={len(candidates)}"
            )
        names = list(range(len(cached_lens))) if user_ids is None else user_ids
        for b, c, a, k in zip(names, cached_lens, appended, candidates):
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"user {b}: cached_len={c!r} must be a non-negative integer")
            check_lengths(config, [b], [c], [a], [k])
        appended_ids, candidate_ids = _batch_item_ids(config, names, appended, candidates, plain_ints)
        return cls(
            cached_lens=list(cached_lens),
            appended_lens=[len(a) for a in appended],
            candidate_lens=[len(k) for k in candidates],
            appended_ids=torch.from_numpy(appended_ids),
            candidate_ids=torch.from_numpy(candidate_ids),
            id_numpy=(appended_ids, candidate_ids),
        )

    def id_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(appended ids, candidate ids) as int64 numpy arrays sharing the tensors' memory: the ones `from_lists`
        built them from (the runtime reads them several times per request, and `Tensor.numpy` costs ~5 us a call on
        the H200's host), else the tensors' views."""
        if self.id_numpy is not None:
            return self.id_numpy
        return self.appended_ids.numpy(), self.candidate_ids.numpy()

    @cached_property
    def query_offsets(self) -> torch.Tensor:
        return _offsets(self.query_lens)

    @cached_property
    def cached_offsets(self) -> torch.Tensor:
        return _offsets(self.cached_lens)

    @cached_property
    def appended_offsets(self) -> torch.Tensor:
        return _offsets(self.appended_lens)

    @cached_property
    def candidate_offsets(self) -> torch.Tensor:
        return _offsets(self.candidate_lens)

    def pack_query(self, ids: np.ndarray, positions: np.ndarray, candidate_rows: np.ndarray) -> int:
        """Write the query tokens in jagged order (per user its appended tokens, then its candidates) to the fronts of
        `ids` and `positions`, and each candidate's query row to the front of `candidate_rows`; returns the number of
        query tokens. A few slices per user and nothing the size of the batch in between: the runtime packs its
        buffers with it per request."""
        appended, candidates = self.id_arrays()
        row = first_appended = first_candidate = 0
        for cached, a, k in zip(self.cached_lens, self.appended_lens, self.candidate_lens):
            ids[row:row + a] = appended[first_appended:first_appended + a]
            ids[row + a:row + a + k] = candidates[first_candidate:first_candidate + k]
            positions[row:row + a] = np.arange(cached, cached + a)
            positions[row + a:row + a + k] = cached + a
            candidate_rows[first_candidate:first_candidate + k] = np.arange(row + a, row + a + k)
            row, first_appended, first_candidate = row + a + k, first_appended + a, first_candidate + k
        return row

    def query_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(item ids, positions, is-candidate flags) of the query tokens in jagged order, per user appended then
        candidates (`pack_query`), as fresh int64 / bool arrays."""
        total = sum(self.query_lens)
        ids, positions = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        rows = np.empty(len(self.candidate_ids), dtype=np.int64)
        self.pack_query(ids, positions, rows)
        is_candidate = np.zeros(total, dtype=bool)
        is_candidate[rows] = True
        return ids, positions, is_candidate

    def query_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(item ids, positions) of the query tokens: appended token j of a user sits at cached_len + j, every
        candidate at the history length."""
        ids, positions, _ = self.query_arrays()
        return torch.from_numpy(ids), torch.from_numpy(positions)

    def candidate_mask(self) -> torch.Tensor:
        """Bool [total query tokens]: True where the token is a candidate."""
        return torch.from_numpy(self.query_arrays()[2])
