"""What a served request can fail with, and the one word (`error_kind`) metrics and HTTP answers name a failure by.

The serving layer's own refusals are `ServingError`s; everything else a request fails with comes from the engine:
ValueError (a bad request), PoolExhausted (the GPU cannot hold it even alone), TransferError (its KV could not move).
"""

from __future__ import annotations

from layerflow.tier.allocator import PoolExhausted
from layerflow.transfer.errors import TransferError


class ServingError(RuntimeError):
    """A request the serving layer refused or gave up on (the engine never failed it)."""


class QueueFull(ServingError):
    """`submit` found the queue at its bound (`serve_max_queue`): the request was not queued; retry later."""


class DeadlineExceeded(ServingError):
    """The request's deadline passed before its batch was launched; nothing of it was recorded."""


class ShuttingDown(ServingError):
    """The serving layer is closing: it drains what it queued but takes nothing new."""


class BadField(ValueError):
    """A request field that is missing or malformed; `field` names it (the HTTP answer says which)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# Most specific first: BadField is a ValueError, NotResident a TransferError.
_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (QueueFull, "queue_full"),
    (ShuttingDown, "shutting_down"),
    (DeadlineExceeded, "deadline"),
    (ValueError, "bad_request"),
    (PoolExhausted, "capacity"),
    (TransferError, "transfer"),
)

ERROR_KINDS: tuple[str, ...] = tuple(kind for _, kind in _KINDS) + ("internal",)


def error_kind(error: BaseException) -> str:
    """The kind of failure `error` is, one of ERROR_KINDS ("internal" for anything unexpected)."""
    return next((kind for cls, kind in _KINDS if isinstance(error, cls)), "internal")
