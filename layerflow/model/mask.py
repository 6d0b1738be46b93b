"""Which keys a token attends to: generative-recommenders' id rule, shared by the reference math and the kernels.

Every token of a user's sequence (history, then its targets = candidates) gets an id: its position, shifted so the
first c tokens (the contextual prefix) all get id 0, then clamped to m, the id of the first target, so every
target shares one id. Token i sees token j when

    (i is j or id(i) > id(j)) and (W == 0 or id(i) - id(j) <= W),  or  (c > 0 and id(i) == 0 and id(j) < m).

So history is causal (diagonal included), a target sees the history and itself but never another target, the
contextual tokens see all history in both directions, and with a window W every id only looks W ids back (the
contextual tokens included: they have id 0). A target-unaware model clamps no id: its candidates are plain causal
tokens in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskRule:
    """The mask options of a model: contextual prefix length c, window W (0: none), target-aware candidates."""

    contextual_len: int = 0
    max_attn_len: int = 0
    target_aware: bool = True

    def __post_init__(self) -> None:
        for name in ("contextual_len", "max_attn_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a non-negative integer")
        if not isinstance(self.target_aware, bool):
            raise ValueError(f"target_aware={self.target_aware!r}: must be a bool")

    @property
    def id_shift(self) -> int:
        """id(p) = p - id_shift before clamping: c - 1 with a contextual prefix, else 0."""
        return max(self.contextual_len - 1, 0)

    def first_target_id(self, history_len: int, num_targets: int) -> int:
        """m: the id every target is clamped to (a target-unaware model clamps past its last token)."""
        return (history_len if self.target_aware else history_len + num_targets) - self.id_shift

    def full_mask(self, history_len: int, num_targets: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [n, n] over one user's whole sequence, n = history_len + num_targets (targets last)."""
        n = history_len + num_targets
        m = self.first_target_id(history_len, num_targets)
        ids = (torch.arange(n, device=device) - self.id_shift).clamp(min=0).clamp(max=m)
        row, col = ids.unsqueeze(1), ids.unsqueeze(0)
        mask = torch.eye(n, dtype=torch.bool, device=device) | (row > col)
        if self.max_attn_len:
            mask &= row - col <= self.max_attn_len
        if self.contextual_len:
            mask |= (row == 0) & (col < m)
        return mask

    def cached_read_start(self, cached_len: int, num_appended: int, num_candidates: int) -> int:
        """First cached history position a cached step may read; it reads every position from there to cached_len.

        With no window that is 0. With a window W the step's first token (position cached_len: its first appended
        token, else its candidates) has the smallest id q and reads back to id q - W: position q - W + id_shift, or 0
        once q - W reaches the id-0 tokens.
        """
        if num_appended + num_candidates == 0:
            return cached_len
        m = self.first_target_id(cached_len + num_appended, num_candidates)
        first_id = min(max(cached_len - self.id_shift, 0), m)
        if not self.max_attn_len or first_id <= self.max_attn_len:
            return 0
        return min(first_id - self.max_attn_len + self.id_shift, cached_len)


def attention_mask(history_len: int, num_appended: int, num_candidates: int,
                   rule: MaskRule = MaskRule()) -> torch.Tensor:
    """Bool [num_appended + num_candidates, history_len + num_candidates]: one user's cached-step queries.

    Keys are the user's history (cached + appended) followed by its candidates; the queries are the last rows of the
    user's full mask (its appended tokens, then its candidates).
    """
    delta = num_appended + num_candidates
    return rule.full_mask(history_len, num_candidates)[history_len + num_candidates - delta:]


def cached_read_range(rule: MaskRule, cached_len: int, num_appended: int, num_candidates: int) -> range:
    """The cached history positions one user's cached step reads: the pages the engine must have on the GPU."""
    return range(rule.cached_read_start(cached_len, num_appended, num_candidates), cached_len)
