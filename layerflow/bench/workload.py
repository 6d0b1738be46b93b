"""Synthetic returning-user workloads: the requests that the CLI and the benchmarks send.

- `returning_users`: first visits that build each user's history, then rounds of return visits (`layerflow score`).
- `Workload`: the inference benchmark's users of one history length and the one batch it replays every iteration:
  random item ids for an item-id model, random token embeddings for a model whose caller brings them (DLRMv3).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from layerflow.model.config import HSTUConfig
from layerflow.runtime.engine import Engine, TokenOutputs
from layerflow.runtime.kv_manager import KVManager
from layerflow.runtime.request import EmbeddingRequest, Request


def returning_users(num_users: int, history_len: int, append_len: int, num_candidates: int, rounds: int,
                    vocab: int, seed: int = 0) -> tuple[list[Request], list[list[Request]]]:
    """A first visit per user that builds `history_len` tokens of history, then `rounds` rounds of return visits."""
    rng = random.Random(seed)

    def items(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    first = [Request(u, items(history_len), []) for u in range(num_users)]
    later = [[Request(u, items(append_len), items(num_candidates)) for u in range(num_users)] for _ in range(rounds)]
    return first, later


@dataclass
class Workload:
    """`users` with `seq_len` cached tokens each, and the one batch (a request per user) replayed every iteration."""

    seq_len: int
    histories: dict[int, list[int] | torch.Tensor]
    requests: list[Request | EmbeddingRequest]
    fresh: list[int] = field(default_factory=list)  # no_cache users of the previous iteration

    @classmethod
    def build(cls, users: list[int], seq_len: int, append_len: int, num_candidates: int, model: HSTUConfig,
              seed: int) -> "Workload":
        """Random item ids, or random embeddings, the same for the same seed and length."""
        rng = random.Random(seed * 7919 + seq_len)
        if model.embedding_tables:
            vocab = model.item_vocab_size
            histories = {u: [rng.randrange(vocab) for _ in range(seq_len)] for u in users}
            requests = [Request(u, [rng.randrange(vocab) for _ in range(append_len)],
                                [rng.randrange(vocab) for _ in range(num_candidates)]) for u in users]
            return cls(seq_len, histories, requests)
        gen = torch.Generator().manual_seed(seed * 7919 + seq_len)

        def rows(n: int) -> torch.Tensor:
            return torch.randn(n, model.embedding_dim, generator=gen).to(model.dtype)

        histories = {u: rows(seq_len) for u in users}
        return cls(seq_len, histories, [EmbeddingRequest(u, rows(append_len), rows(num_candidates)) for u in users])

    def load(self, engine: Engine) -> None:
        """First visit: the histories are computed once and offloaded to host."""
        engine.score([first_visit(u, h) for u, h in self.histories.items()])
        engine.kv.wait_offloads()

    def whole(self, user: int, request: Request | EmbeddingRequest) -> Request | EmbeddingRequest:
        """`request` from a user never seen (`user`): the whole history arrives with it."""
        history = self.histories[request.user_id]
        if isinstance(request, EmbeddingRequest):
            return EmbeddingRequest(user, torch.cat([history, request.new_x]), request.candidates_x)
        return Request(user, history + request.items, request.candidates)

    def drop(self, engine: Engine) -> None:
        """Free this length's users from GPU and host so the next length has the pools to itself."""
        for u in list(self.histories) + self.fresh:
            forget(engine.kv, u)
        self.fresh = []


def first_visit(user: int, history: list[int] | torch.Tensor) -> Request | EmbeddingRequest:
    if isinstance(history, torch.Tensor):
        return EmbeddingRequest(user, history, history[:0])
    return Request(user, history, [])


def as_scores(results: list) -> list[torch.Tensor]:
    """Results made comparable: scores as they are, an embeddings-in request's candidate outputs flattened (fp32)."""
    return [r.candidates.float().flatten() if isinstance(r, TokenOutputs) else r for r in results]


def forget(kv: KVManager, user: int) -> None:
    """Drop `user` from every tier once the offloads in flight have landed."""
    kv.wait_offloads()
    kv.drop(user)
