"""The fields of a client's requests, checked before the server uses them: a malformed value is a ValueError naming
it (answered with ERROR), never a crash of the client's thread or a key the server cannot hash."""

from __future__ import annotations

import numpy as np

from layerflow.server import protocol

MAX_USER_KEY = 256   # characters of a string user id
MAX_USER_ID = 2**63


def user_of(value: object) -> int | str:
    """A user id: an int in [0, 2**63) (what the engine sends) or a short string."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_USER_ID:
        return value
    if isinstance(value, str) and 0 < len(value) <= MAX_USER_KEY:
        return value
    raise ValueError(f"user={value!r}: expected an integer in [0, 2**63) or a string of 1..{MAX_USER_KEY} characters")


def count_of(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ValueError(f"{name}={value!r}: must be a non-negative integer")
    return value


def history_of(payload: bytes, tokens: int) -> np.ndarray | None:
    """An OFFLOAD's item history: none (empty payload) or exactly one little-endian int64 per token."""
    if not payload:
        return None
    if len(payload) != 8 * tokens:
        raise ValueError(f"history: {len(payload)} bytes for tokens={tokens} (8 bytes, one int64, per token)")
    return np.frombuffer(payload, dtype="<i8")


def page_list(pages: object) -> list[int]:
    if not isinstance(pages, list) or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 2**31
                                              for p in pages):
        raise ValueError(f"gpu_pages={pages!r}: expected a list of page indices")
    return pages


def parse_loads(loads: object) -> list[tuple[int | str, list[int], int]]:
    """`[[user, gpu_pages, first_page], ...]` from an ONBOARD message, each user once (first_page may be left out)."""
    if not isinstance(loads, list) or not loads:
        raise ValueError(f"loads={loads!r}: expected a non-empty list of [user, gpu_pages, first_page]")
    out = []
    for load in loads:
        if not (isinstance(load, list) and len(load) in (2, 3)):
            raise ValueError(f"load {load!r}: expected [user, [page, ...], first_page]")
        first = count_of(load[2], "first_page") if len(load) == 3 else 0
        out.append((user_of(load[0]), page_list(load[1]), first))
    users = [user for user, _, _ in out]
    if len(set(users)) != len(users):
        raise ValueError(f"loads: a user appears twice in {users!r}")
    return out


def users_of(msg: protocol.Message) -> list:
    """The users a request is about (an ONBOARD's loads, else its `user`) as far as they are valid ids: what its
    claim holds and its ERROR reply names."""
    loads = msg.get("loads")
    candidates = [load[0] for load in loads if isinstance(load, list) and load] if isinstance(loads, list) \
        else [msg.fields["user"]] if "user" in msg.fields else []
    valid = []
    for user in candidates:
        try:
            valid.append(user_of(user))
        except ValueError:
            pass
    return valid
