"""How closely one engine's candidate scores follow another's: relative error and ranking agreement.

Per user, `scores` and `reference` score the same candidates. The relative error of a candidate is its absolute
difference over the largest |reference| score of its user (a score near zero would make a per-score ratio
meaningless). Ranking agreement is the overlap of the top-k sets (|top-k(a) & top-k(b)| / k) and Kendall's tau-b over
every pair of candidates (ties on either side counted as tau-b does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch


def relative_errors(scores: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|scores - reference| / max|reference| per candidate (0 where the reference is all zero and so are scores)."""
    _check_pair(scores, reference)
    scale = reference.abs().max()
    diff = (scores.double() - reference.double()).abs()
    return diff / scale if scale > 0 else diff


def top_k_overlap(scores: torch.Tensor, reference: torch.Tensor, k: int) -> float:
    """The fraction of the reference's k best candidates that are also among `scores`' k best (k capped at the
    number of candidates)."""
    _check_pair(scores, reference)
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k={k!r}: must be a positive integer")
    k = min(k, scores.numel())
    ours = set(torch.topk(scores.double(), k).indices.tolist())
    theirs = set(torch.topk(reference.double(), k).indices.tolist())
    return len(ours & theirs) / k


def kendall_tau(scores: torch.Tensor, reference: torch.Tensor) -> float:
    """Kendall's tau-b between the two orders of the candidates (1: the same order, -1: reversed)."""
    _check_pair(scores, reference)
    if scores.numel() < 2:
        raise ValueError(f"{scores.numel()} candidates: Kendall's tau needs at least two")
    a = torch.sign(scores.double()[:, None] - scores.double()[None, :])
    b = torch.sign(reference.double()[:, None] - reference.double()[None, :])
    upper = torch.triu(torch.ones_like(a, dtype=torch.bool), diagonal=1)
    a, b = a[upper], b[upper]
    untied = ((a != 0).sum() * (b != 0).sum()).double().sqrt()
    return float((a * b).sum() / untied) if untied > 0 else 1.0


def _check_pair(scores: torch.Tensor, reference: torch.Tensor) -> None:
    if scores.dim() != 1 or scores.shape != reference.shape or scores.numel() == 0:
        raise ValueError(f"scores {tuple(scores.shape)} and reference {tuple(reference.shape)}: expected two equal "
                         f"non-empty 1-D shapes")


@dataclass(frozen=True)
class Agreement:
    """Agreement over many users: errors over every candidate, rankings averaged over users (and their worst)."""

    users: int
    candidates: int
    max_relative_error: float
    mean_relative_error: float
    top10_overlap: float
    top50_overlap: float
    kendall_tau: float
    worst_top10_overlap: float
    worst_kendall_tau: float

    @classmethod
    def of(cls, scores: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> "Agreement":
        if not scores or len(scores) != len(reference):
            raise ValueError(f"{len(scores)} and {len(reference)} users: expected the same, at least one")
        errors = torch.cat([relative_errors(s, r) for s, r in zip(scores, reference)])
        top10 = [top_k_overlap(s, r, 10) for s, r in zip(scores, reference)]
        top50 = [top_k_overlap(s, r, 50) for s, r in zip(scores, reference)]
        taus = [kendall_tau(s, r) for s, r in zip(scores, reference)]
        return cls(len(scores), errors.numel(), float(errors.max()), float(errors.mean()), sum(top10) / len(top10),
                   sum(top50) / len(top50), sum(taus) / len(taus), min(top10), min(taus))

    def passes(self, top10: float, tau: float) -> bool:
        """The gate: mean top-10 overlap and mean Kendall tau at least these."""
        return self.top10_overlap >= top10 and self.kendall_tau >= tau

    def to_dict(self) -> dict:
        return asdict(self)
