"""Jagged batches: B users of different lengths, described by offsets (no padding in the math).

Per user b: `cached_lens[b]` history tokens whose K/V are cached, `appended` new history items, `candidates` items to
score. The query tokens of the cached path are each user's appended tokens followed by its candidates.
Positions: appended token j sits at cached_len + j; every candidate sits at the history length (the next slot), so a
candidate's result never depends on the other candidates or their order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from layerflow.hstu.config import HSTUConfig


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int64)


@dataclass(frozen=True)
class JaggedBatch:
    cached_lens: list[int]
    appended_lens: list[int]
    candidate_lens: list[int]
    appended_ids: torch.Tensor   # int64 [sum appended]
    candidate_ids: torch.Tensor  # int64 [sum candidates]

    @classmethod
    def from_lists(cls, config: HSTUConfig, cached_lens: list[int], appended: list[list[int]],
                   candidates: list[list[int]], user_ids: list[int] | None = None) -> "JaggedBatch":
        """Validate and pack per-user lists; every bad value raises ValueError naming the user and value.

        Users are named by `user_ids` when given, else by their index in the batch.
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
            total = c + len(a) + len(k)
            if total > config.max_seq_len:
                raise ValueError(
                    f"user {b}: total length {total} (cached {c} + appended {len(a)} + candidates {len(k)}) "
                    f"exceeds max_seq_len={config.max_seq_len}"
                )
            for kind, ids in (("appended", a), ("candidate", k)):
                bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
                       or not 0 <= i < config.item_vocab_size]
                if bad:
                    raise ValueError(
                        f"user {b}: {kind} item id {bad[0]!r} out of vocabulary [0, {config.item_vocab_size})"
                    )
        return cls(
            cached_lens=list(cached_lens),
            appended_lens=[len(a) for a in appended],
            candidate_lens=[len(k) for k in candidates],
            appended_ids=torch.tensor([i for a in appended for i in a], dtype=torch.int64),
            candidate_ids=torch.tensor([i for k in candidates for i in k], dtype=torch.int64),
        )

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

    def query_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(item ids, positions) of the query tokens in jagged order: per user appended then candidates."""
        ids, positions = [], []
        ao, co = self.appended_offsets.tolist(), self.candidate_offsets.tolist()
        for b, (c, a, k) in enumerate(zip(self.cached_lens, self.appended_lens, self.candidate_lens)):
            ids += [self.appended_ids[ao[b]:ao[b + 1]], self.candidate_ids[co[b]:co[b + 1]]]
            positions += [torch.arange(c, c + a), torch.full((k,), c + a)]
        if not ids:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        return torch.cat(ids), torch.cat(positions).to(torch.int64)

    def candidate_mask(self) -> torch.Tensor:
        """Bool [total query tokens]: True where the token is a candidate."""
        flags = [torch.cat([torch.zeros(a, dtype=torch.bool), torch.ones(k, dtype=torch.bool)])
                 for a, k in zip(self.appended_lens, self.candidate_lens)]
        return torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)
