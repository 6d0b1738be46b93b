"""What the KV manager keeps of a user's history so a miss can be recomputed exactly: item ids, or token embeddings
for a model whose caller brings them (kept on the host, in the model's dtype)."""

from __future__ import annotations

import array
from abc import ABC, abstractmethod

import numpy as np
import torch


class History(ABC):
    """The tokens of a user's history in order; its K/V are what the tiers cache."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def extend(self, tokens) -> None:
        """Append the tokens one batch added (ids, or embedding rows)."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""

    @abstractmethod
    def tokens(self):
        """All the tokens, in the form a request carries them (to recompute the history)."""

    @abstractmethod
    def clear(self) -> None: ...


class ItemHistory(History):
    """Item ids as int64 in an `array`: a shared tier (the transfer server, Redis) is sent the whole history with each
    offload, and a numpy copy of an array is one memcpy where a list's is a conversion per item."""

    def __init__(self) -> None:
        self._items = array.array("q")

    def __len__(self) -> int:
        return len(self._items)

    def extend(self, tokens) -> None:
        self._items.extend(tokens)

    def truncate(self, length: int) -> None:
        del self._items[length:]

    def tokens(self) -> list[int]:
        return self._items.tolist()

    def clear(self) -> None:
        del self._items[:]

    def __eq__(self, other: object) -> bool:
        """Equal to the list of its items (what callers compare it with)."""
        if isinstance(other, ItemHistory):
            return self._items == other._items
        return self._items.tolist() == other

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """A copy of the items (never a view: the array could not grow while one is alive)."""
        items = np.frombuffer(self._items, dtype=np.int64).copy() if self._items else np.zeros(0, dtype=np.int64)
        return items if dtype is None else items.astype(dtype, copy=False)


class EmbeddingHistory(History):
    """Token embeddings in chunks (one per batch that added tokens), joined only when a miss recomputes them."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        self.embedding_dim, self.dtype = embedding_dim, dtype
        self._chunks: list[torch.Tensor] = []
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: torch.Tensor) -> None:
        """A copy of the rows (the caller's tensor may change after)."""
        if len(tokens):
            self._chunks.append(tokens.to("cpu", self.dtype, copy=True))
            self._length += len(tokens)

    def truncate(self, length: int) -> None:
        self._chunks = [self.tokens()[:length]] if length else []
        self._length = length

    def tokens(self) -> torch.Tensor:
        if not self._chunks:
            return torch.zeros(0, self.embedding_dim, dtype=self.dtype)
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def clear(self) -> None:
        self._chunks, self._length = [], 0
