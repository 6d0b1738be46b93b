"""Requests: one returning user's new interactions and what to score (item ids, or token embeddings)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch

MAX_USER_ID = 2**63  # user ids are keys of int64 tables and of the transfer server's JSON messages


def _index(value: object) -> int:
    """`value` as a plain int if it is integer-like (`operator.index`), else TypeError; bool is no id."""
    if isinstance(value, bool):
        raise TypeError
    return operator.index(value)


def _id_list(user: int, name: str, values: Iterable[object]) -> list[int]:
    """A fresh list of plain ints: the fast path copies a list of ints, the slow one names the first bad value."""
    if hasattr(values, "tolist"):  # numpy arrays and torch tensors: one C call
        values = values.tolist()
    values = list(values)
    if set(map(type, values)) <= {int}:
        return values
    out = []
    for i, value in enumerate(values):
        try:
            out.append(_index(value))
        except TypeError:
            raise ValueError(f"user {user}: {name}[{i}]={value!r} is not an integer ({type(value).__name__})") \
                from None
    return out


def user_id_of(value: object) -> int:
    """A validated user id: integer-like, in [0, 2**63), as a plain int."""
    try:
        user = _index(value)
    except TypeError:
        raise ValueError(f"user_id={value!r}: must be an integer in [0, 2**63), not {type(value).__name__}") from None
    if not 0 <= user < MAX_USER_ID:
        raise ValueError(f"user_id={value!r}: must be an integer in [0, 2**63)")
    return user


@dataclass(frozen=True)
class Request:
    """One returning user: the items appended to the history since the last visit, and the items to score.

    `user_id` is any integer-like value (`operator.index`: int, IntEnum, numpy or torch integers) in [0, 2**63) and is
    kept as a plain int, so 1, np.int64(1) and an IntEnum of 1 are one user while True and 1.0 are refused. `items` and
    `candidates` become lists of plain ints (the vocabulary check is the batch's, which knows the model).
    """

    user_id: int
    items: list[int]
    candidates: list[int]

    def __post_init__(self) -> None:
        user = user_id_of(self.user_id)
        object.__setattr__(self, "user_id", user)
        object.__setattr__(self, "items", _id_list(user, "items", self.items))
        object.__setattr__(self, "candidates", _id_list(user, "candidates", self.candidates))

@dataclass(frozen=True)
class EmbeddingRequest:
    """One returning user of a model whose caller brings the token embeddings (e.g. generative-recommenders' STU):
    the new history tokens' embeddings `new_x` [n, E] and the candidates' `candidates_x` [c, E]. The engine returns
    the final embeddings of the candidates (and of the new tokens) for the caller's own heads."""

    user_id: int
    new_x: torch.Tensor
    candidates_x: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "user_id", user_id_of(self.user_id))
        for name in ("new_x", "candidates_x"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"user {self.user_id}: {name} {shape}: expected a [n, E] tensor")
