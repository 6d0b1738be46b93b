"""Thin helpers over cuda.bindings: result checking and the 'needs CUDA' guard shared by the CUDA paths."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from layerflow.transfer.errors import TransferError


def require_cuda(what: str) -> None:
    """Fail early, and say why, when a CUDA-only path is asked for on a machine without a GPU."""
    if not torch.cuda.is_available():
        raise TransferError(f"{what} needs a CUDA GPU; none is available (use the eventfd signal / ThreadCopyEngine)")


def check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings `(err, *values)` tuple; raise TransferError naming `call` on failure."""
    err, *values = result
    if int(err) != 0:
        raise TransferError(f"{call} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def poll_until(ready: Callable[[], bool], deadline: float) -> bool:
    """Spin briefly, then back off to short sleeps, until `ready()` or `deadline` (monotonic seconds).

    Spinning first keeps the host release latency in microseconds for signals that are about to land; the backoff
    caps the CPU a long wait burns.
    """
    sleep = 0.0
    while True:
        if ready():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(sleep, deadline - now))
        sleep = min(max(sleep * 2, 2e-6), 5e-4)
