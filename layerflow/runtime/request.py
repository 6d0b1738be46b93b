"""A scoring request: one returning user's new interactions and the items to score."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

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
        try:
            user = _index(self.user_id)
        except TypeError:
            raise ValueError(f"user_id={self.user_id!r}: must be an integer in [0, 2**63), "
                             f"not {type(self.user_id).__name__}") from None
        if not 0 <= user < MAX_USER_ID:
            raise ValueError(f"user_id={self.user_id!r}: must be an integer in [0, 2**63)")
        object.__setattr__(self, "user_id", user)
        object.__setattr__(self, "items", _id_list(user, "items", self.items))
        object.__setattr__(self, "candidates", _id_list(user, "candidates", self.candidates))
