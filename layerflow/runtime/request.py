"""A scoring request: one returning user's new interactions and the items to score."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One returning user: the items appended to the history since the last visit, and the items to score."""

    user_id: int
    items: list[int]
    candidates: list[int]
