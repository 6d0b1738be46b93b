"""Synthetic returning-user workloads: the requests that the CLI and the benchmarks send."""

from __future__ import annotations

import random

from layerflow.runtime.request import Request


def returning_users(num_users: int, history_len: int, append_len: int, num_candidates: int, rounds: int,
                    vocab: int, seed: int = 0) -> tuple[list[Request], list[list[Request]]]:
    """A first visit per user that builds `history_len` tokens of history, then `rounds` rounds of return visits."""
    rng = random.Random(seed)

    def items(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    first = [Request(u, items(history_len), []) for u in range(num_users)]
    later = [[Request(u, items(append_len), items(num_candidates)) for u in range(num_users)] for _ in range(rounds)]
    return first, later
