"""The body of `POST /v1/score`, checked field by field before anything is queued.

`{"user_id": int, "items": [int], "candidates": [int], "deadline_ms": number (optional)}`: items are the
interactions appended to the user's history since the last visit, candidates the items to score, both ids in the
model's vocabulary. Any other key, a missing key or a bad value raises BadField naming the field, so the client is
told exactly what to fix. Limits that depend on the user's stored history (its total length) are the engine's.
`check_deadline_s` checks the deadline any caller of `AsyncEngine.submit` passes.
"""

from __future__ import annotations

from collections.abc import Mapping

from layerflow.model.config import HSTUConfig
from layerflow.runtime.request import Request
from layerflow.serving.errors import BadField

FIELDS = ("user_id", "items", "candidates", "deadline_ms")
MAX_USER_ID = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _item_ids(field: str, value: object, vocab: int) -> list[int]:
    if not isinstance(value, list):
        raise BadField(field, f"expected a list of item ids, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not _is_int(item) or not 0 <= item < vocab:
            raise BadField(field, f"{field}[{i}]={item!r} is not an item id in [0, {vocab})")
    return value


def check_deadline_s(deadline_s: object) -> float | None:
    """A deadline in seconds from now (None: the server's default); ValueError naming a bad one."""
    if deadline_s is None:
        return None
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise ValueError(f"deadline_s={deadline_s!r}: must be a positive number of seconds or None")
    return float(deadline_s)


def parse_score_request(body: object, model: HSTUConfig) -> tuple[Request, float | None]:
    """The request and its deadline in seconds (None: the server's default) from a decoded JSON body."""
    if not isinstance(body, Mapping):
        raise BadField("body", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadField(unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    for name in ("user_id", "items", "candidates"):
        if name not in body:
            raise BadField(name, "missing")
    user = body["user_id"]
    if not _is_int(user) or not 0 <= user <= MAX_USER_ID:
        raise BadField("user_id", f"{user!r} is not an integer in [0, 2**63)")
    items = _item_ids("items", body["items"], model.item_vocab_size)
    candidates = _item_ids("candidates", body["candidates"], model.item_vocab_size)
    if len(items) + len(candidates) > model.max_seq_len:
        raise BadField("candidates", f"{len(items)} items + {len(candidates)} candidates exceed the model's "
                                     f"max_seq_len={model.max_seq_len}")
    deadline = body.get("deadline_ms")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not deadline > 0):
        raise BadField("deadline_ms", f"{deadline!r} is not a positive number of milliseconds")
    return Request(user, items, candidates), None if deadline is None else deadline / 1e3
