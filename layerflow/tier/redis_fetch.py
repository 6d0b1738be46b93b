"""MGET replies read on several connections at once, one reader thread per connection, handed on in request order.

One thread reading every connection in turn caps a fetch at one core's receive and hash rate, below what Redis
delivers over several connections; each reader here receives its own connection's replies straight into the host
blocks (hashing them as they land) while the others do the same. The caller consumes the MGETs in order and may stop
early (a damaged block): `close()` then hangs up the connections, which ends every receive in flight, and returns only
once no reader can write into a host block any more, so the caller may free the blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from layerflow.tier.redis_reply import ReplyError, ReplyReader
from layerflow.tier.remote_manifest import block_hasher

Landed = list[tuple[int, int] | None]   # per block of an MGET: (length, digest), or None for a missing key
Views = Callable[[int], Sequence[memoryview]]   # the host views a block index lands in


class ParallelMgets:
    """`mgets[i] = (first block index, keys)`; MGET i goes on connection i % len(conns), two in flight on each."""

    def __init__(self, pool: ThreadPoolExecutor, conns: Sequence, mgets: Sequence[tuple[int, list[str]]],
                 views: Views) -> None:
        self._conns, self._mgets, self._views = list(conns), list(mgets), views
        self._landed: list[Landed | None] = [None] * len(self._mgets)
        self._failure: BaseException | None = None
        self._stop = False
        self._done = threading.Condition()
        self._readers: list[Future] = [pool.submit(self._read, c) for c in range(len(self._conns))]

    def __iter__(self) -> Iterator[tuple[int, Landed]]:
        """(first block index, landed) per MGET, in order; a reader's error is raised here."""
        for i, (start, _) in enumerate(self._mgets):
            with self._done:
                self._done.wait_for(lambda: self._landed[i] is not None or self._failure is not None)
                if self._failure is not None:
                    raise self._failure
                landed, self._landed[i] = self._landed[i], []
            yield start, landed

    def close(self, clean: bool) -> None:
        """Wait for the readers; unless every reply was read (`clean`), hang up first so none waits for more."""
        if not clean:
            with self._done:
                self._stop = True
            for conn in self._conns:
                conn.disconnect()
        for reader in self._readers:
            reader.exception()

    def _read(self, c: int) -> None:
        conn, mine = self._conns[c], list(range(c, len(self._mgets), len(self._conns)))
        try:
            reader = ReplyReader(conn._sock)   # connected: the pool connects what it lends
            for i in mine[:2]:
                conn.send_command("MGET", *self._mgets[i][1])
            for k, i in enumerate(mine):
                start, keys = self._mgets[i]
                if reader.array() != len(keys):
                    raise ReplyError(f"an MGET of {len(keys)} keys answered with another number of values")
                landed: Landed = []
                for index in range(start, start + len(keys)):
                    digest = block_hasher()
                    length = reader.bulk_into(self._views(index), digest)
                    landed.append(None if length is None else (length, digest.intdigest()))
                if k + 2 < len(mine):
                    conn.send_command("MGET", *self._mgets[mine[k + 2]][1])
                with self._done:
                    if self._stop:
                        return
                    self._landed[i] = landed
                    self._done.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which maps it to a fault
            with self._done:
                if self._failure is None and not self._stop:
                    self._failure = e
                self._done.notify_all()
