"""How a remote store meets its faults: as episodes, logged once, backed off, and never with a secret in them.

A remote store's faults come in bursts (a server restarting, a full memory, a partition), so each is an episode: the
first failure logs its reason, the ones after it log nothing, and the first success logs the recovery. While an
outage lasts, calls are not even tried until a backoff that doubles per failure (capped) has passed, so a down store
costs a request nothing; the first call after it probes (and reconnects).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class RemoteFault(Exception):
    """A remote store call failed for a reason the store can say without secrets (down, timeout, out of memory)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Episode:
    """A condition logged once when it starts (with the reason given then) and once when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self.active = False
        self.count = 0   # episodes started so far
        self.reason = ""   # the reason the last episode started with

    def start(self, reason: str) -> bool:
        """Enter the episode; True (and logged) when it was not already on."""
        with self._lock:
            if self.active:
                return False
            self.active = True
            self.count += 1
            self.reason = reason
        log.warning("%s: %s", self.what, reason)
        return True

    def end(self) -> None:
        with self._lock:
            if not self.active:
                return
            self.active = False
        log.info("%s: recovered", self.what)


class Outage(Episode):
    """An episode of failing calls with a backoff: `ready()` is False for `base_s * 2**k` (at most `cap_s`) seconds
    after the k-th failure in a row."""

    def __init__(self, what: str, base_s: float = 0.05, cap_s: float = 5.0) -> None:
        super().__init__(what + " unavailable")
        self.base_s, self.cap_s = base_s, cap_s
        self._failures = 0
        self._retry_at = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._retry_at

    def failed(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self._retry_at = time.monotonic() + min(self.cap_s, self.base_s * 2 ** (self._failures - 1))
        self.start(reason)

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._retry_at = 0.0
        self.end()


def read_secret(path: str | None, variable: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The password in file `path` (its trailing newline dropped) or in environment variable `variable`; None when
    neither is given. Errors name where the secret was to come from, never what it holds."""
    if path is not None and variable is not None:
        raise ValueError(f"remote_password_file={path!r} and remote_password_env={variable!r}: give one, not both")
    if path is not None:
        try:
            with open(path) as fh:
                secret = fh.read().rstrip("\r\n")
        except OSError as e:
            raise ValueError(f"remote_password_file={path!r}: cannot read it ({e.strerror})") from None
        where = f"remote_password_file={path!r}"
    elif variable is not None:
        if variable not in env:
            raise ValueError(f"remote_password_env={variable!r}: the variable is not set")
        secret, where = env[variable], f"remote_password_env={variable!r}"
    else:
        return None
    if not secret:
        raise ValueError(f"{where}: the password is empty")
    return secret
