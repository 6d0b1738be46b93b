"""Redis replies read off a connection's socket with each value received straight into the caller's memory.

redis-py (with hiredis) copies a value three times before the caller sees it: the socket into its read buffer, that
buffer into the hiredis reader, the reader into a new bytes object; a store then copies that into its host block.
`ReplyReader` reads the few bytes of each reply's header through a small buffer and `recv_into`s a bulk string's
payload into the destination views, feeding each chunk to a digest while it is still in cache: one copy, by the
kernel, and the checksum pass on warm data. It speaks RESP2 (redis-py's default) and the RESP3 null, which is all an
MGET answers with; an error reply or anything else is a `ReplyError`.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol

HEADER_BYTES = 4096   # a header is a few bytes; at most this much of the payload after it is copied through here


class ReplyError(Exception):
    """The server answered with an error, or with a reply of another shape than the command's."""


class Digest(Protocol):
    def update(self, data: memoryview, /) -> object: ...


class ReplyReader:
    """The replies on one connection, in order. The socket's timeout bounds every receive (socket.timeout, i.e.
    TimeoutError); a closed connection is a ConnectionError. After any error the stream is out of step: the caller
    must drop the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(HEADER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0   # the received bytes not consumed yet: _buffer[_start:_end]

    def array(self) -> int:
        """The number of items of the array reply that comes next."""
        kind, text = self._header()
        if kind != "*":
            raise ReplyError(f"expected an array reply, got {kind!r} {text[:80]!r}")
        return self._number(text)

    def bulk_into(self, views: Sequence[memoryview], digest: Digest) -> int | None:
        """The next bulk string: its length (None: a nil, no such key). When the length is that of `views` together,
        the value is received into them in order and `digest` sees every byte; otherwise it is read past and neither
        the views nor the digest are touched."""
        kind, text = self._header()
        if kind == "_" or (kind == "$" and text == "-1"):
            return None
        if kind != "$":
            raise ReplyError(f"expected a bulk string, got {kind!r} {text[:80]!r}")
        length = self._number(text)
        if length == sum(len(v) for v in views):
            for view in views:
                self._receive(view, digest)
        else:
            self._skip(length)
        self._crlf()
        return length

    # ---- the stream -------------------------------------------------------------------------

    def _header(self) -> tuple[str, str]:
        """The next line's type byte and its text (an error reply raised)."""
        while (end := self._buffer.find(b"\r\n", self._start, self._end)) < 0:
            if self._end - self._start == HEADER_BYTES:
                raise ReplyError(f"a reply header longer than {HEADER_BYTES} bytes")
            self._more()
        line = self._buffer[self._start:end].decode("utf-8", "replace")
        self._start = end + 2
        if not line:
            raise ReplyError("an empty reply line")
        if line[0] == "-":
            raise ReplyError(line[1:])
        return line[0], line[1:]

    @staticmethod
    def _number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ReplyError(f"a reply length {text[:80]!r} is not a number") from None
        if value < 0:
            raise ReplyError(f"a reply length {value} is negative")
        return value

    def _receive(self, view: memoryview, digest: Digest) -> None:
        """`view` filled from the stream: what the header buffer holds first, the rest straight off the socket."""
        done = min(len(view), self._end - self._start)
        if done:
            view[:done] = self._view[self._start:self._start + done]
            self._start += done
            digest.update(view[:done])
        while done < len(view):
            got = self._sock.recv_into(view[done:])
            if got == 0:
                raise ConnectionError("the server closed the connection")
            digest.update(view[done:done + got])
            done += got

    def _skip(self, length: int) -> None:
        while length > 0:
            if self._start == self._end:
                self._more()
            taken = min(length, self._end - self._start)
            self._start += taken
            length -= taken

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._more()
        if self._buffer[self._start:self._start + 2] != b"\r\n":
            raise ReplyError("a bulk string not followed by CRLF")
        self._start += 2

    def _more(self) -> None:
        """Receive into the header buffer after what it holds (moved to its front first)."""
        if self._start:
            held = self._end - self._start
            self._buffer[:held] = self._buffer[self._start:self._end]
            self._start, self._end = 0, held
        got = self._sock.recv_into(self._view[self._end:])
        if got == 0:
            raise ConnectionError("the server closed the connection")
        self._end += got
