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


def poll_until(ready: Callable[[], bool], deadline: float, spin_s: float = 0.02) -> bool:
    """Call `ready()` until it is true (True) or `deadline` (monotonic seconds) passes (False).

    The first `spin_s` only yield the GIL between checks: a sleep, even a short one, oversleeps by 50-500 us, which
    measured as a 0.5 ms late completion on a 1.5 ms onboarding. Longer waits back off to sleeps of at most 0.5 ms.
    """
    spin_until = time.monotonic() + spin_s
    sleep = 5e-5
    while True:
        if ready():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            time.sleep(0)
            continue
        time.sleep(min(sleep, deadline - now))
        sleep = min(sleep * 2, 5e-4)
