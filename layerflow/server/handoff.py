"""The start-up handshake: authenticate, then pass per-layer eventfds with SCM_RIGHTS.

Client: HELLO(token, rank, pid, layers, counters) -> ACK, then one COUNTER_SET per counter
carrying that counter's `layers` eventfds -> ACK or NACK(reason). Any NACK, hang-up or
timeout raises HandoffError in the client's start-up, so a bad handoff is a synchronous
failure with a reason, never a waiter that hangs later. Every field is type- and
range-checked before the server allocates anything for it: `layers` is capped by the fds one
message can carry and `counters` by the config's bound, so a client cannot make the server
allocate for 10**7 counters or acknowledge 10**30 layers.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from layerflow.config import MAX_COUNTERS
from layerflow.server import protocol
from layerflow.server.auth import AuthError, PeerCred, check_peer, peer_credentials, tokens_match
from layerflow.server.protocol import Op, ProtocolError, int_field

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
MAX_LAYERS = protocol.MAX_FDS   # a counter set carries one eventfd per layer in one message
MAX_RANK = 2**31 - 1
MAX_PID = 2**22                 # the kernel's pid_max ceiling


class HandoffError(ConnectionError):
    """The handshake failed; the message says why (refused, nacked, or the peer vanished)."""


@dataclass
class Session:
    """What the server learned from a successful handshake. `fds[c][l]` is counter c, layer l."""

    peer: PeerCred
    rank: int
    layers: int
    counters: int
    fds: list[list[int]]

    def close(self) -> None:
        for row in self.fds:
            for fd in row:
                os.close(fd)
        self.fds = []


def eventfd_problem(fd: int) -> str | None:
    """Why `fd` is not a semaphore eventfd of ours, or None if it is one."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        return f"fd {fd} unreadable: {e}"
    if target != "anon_inode:[eventfd]":
        return f"fd {fd} is {target}, not an eventfd"
    with open(f"/proc/self/fdinfo/{fd}") as f:
        info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    if info.get("eventfd-semaphore", " 1").strip() != "1":
        return f"fd {fd} is an eventfd without EFD_SEMAPHORE"
    return None


def client_handoff(sock: socket.socket, token: str, rank: int, fds: list[list[int]]) -> None:
    """Run the client side of the handshake on a connected socket; raise HandoffError on any failure."""
    counters, layers = len(fds), len(fds[0]) if fds else 0
    if counters == 0 or layers == 0 or any(len(row) != layers for row in fds):
        raise ValueError(f"fds must be a non-empty counters x layers grid, got shape {[len(r) for r in fds]}")
    if counters > MAX_COUNTERS or layers > MAX_LAYERS:
        raise ValueError(f"{counters} counters x {layers} layers: at most {MAX_COUNTERS} x {MAX_LAYERS}")
    old_timeout = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        protocol.send(sock, Op.HELLO, token=token, rank=rank, pid=os.getpid(), layers=layers, counters=counters)
        _expect_ack(sock, "hello")
        for c, row in enumerate(fds):
            protocol.send(sock, Op.COUNTER_SET, fds=row, counter_id=c, layers=layers, counters=counters, rank=rank)
            _expect_ack(sock, f"counter set {c}")
    except (OSError, ProtocolError) as e:
        if isinstance(e, HandoffError):
            raise
        raise HandoffError(f"transfer server handshake failed: {e}") from e
    finally:
        sock.settimeout(old_timeout)


def _expect_ack(sock: socket.socket, what: str) -> protocol.Message:
    reply = protocol.recv(sock)
    reply.close_fds()
    if reply.op is Op.NACK:
        raise HandoffError(f"transfer server refused {what}: {reply.get('reason', 'no reason given')}")
    if reply.op is not Op.ACK:
        raise HandoffError(f"transfer server answered {what} with {reply.op.value}, expected ack")
    return reply


def server_handoff(sock: socket.socket, token: str, allowed_uid: int,
                   peer_check: Callable[[PeerCred, int], None] = check_peer) -> Session:
    """Authenticate a freshly accepted connection and collect its eventfds.

    Refusals are answered with a NACK carrying the reason, logged, and raised as
    HandoffError/AuthError so the caller drops the connection.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    peer = peer_credentials(sock)
    try:
        peer_check(peer, allowed_uid)
        hello = protocol.recv(sock)
        hello.close_fds()
        if hello.op is not Op.HELLO:
            raise HandoffError(f"expected hello, got {hello.op.value}")
        if not tokens_match(token, hello.get("token")):
            raise AuthError(f"peer pid {peer.pid} uid {peer.uid} offered a wrong token")
        layers = int_field(hello.fields, "layers", 1, MAX_LAYERS)
        counters = int_field(hello.fields, "counters", 1, MAX_COUNTERS)
        rank = int_field(hello.fields, "rank", 0, MAX_RANK)
        int_field(hello.fields, "pid", 1, MAX_PID)
    except (AuthError, HandoffError, ValueError, ProtocolError) as e:
        log.warning("transfer server refused peer pid=%d uid=%d: %s", peer.pid, peer.uid, e)
        _nack_quietly(sock, str(e))
        raise HandoffError(str(e)) from e
    protocol.send(sock, Op.ACK)
    session = Session(peer, rank, layers, counters, [[] for _ in range(counters)])
    try:
        for _ in range(counters):
            _receive_counter_set(sock, session)
    except (HandoffError, ProtocolError, OSError) as e:
        log.warning("handoff from pid=%d rank=%d failed: %s", peer.pid, rank, e)
        session.close()
        raise HandoffError(str(e)) from e
    sock.settimeout(None)
    return session


def _receive_counter_set(sock: socket.socket, session: Session) -> None:
    msg = protocol.recv(sock)
    try:
        problem = _counter_set_problem(msg, session)
    except (ProtocolError, ValueError) as e:
        problem = str(e)
    if problem is not None:
        msg.close_fds()
        _nack_quietly(sock, problem)
        raise HandoffError(problem)
    session.fds[msg["counter_id"]] = msg.fds
    protocol.send(sock, Op.ACK, counter_id=msg["counter_id"])


def _counter_set_problem(msg: protocol.Message, session: Session) -> str | None:
    if msg.op is not Op.COUNTER_SET:
        return f"expected counter_set, got {msg.op.value}"
    c = int_field(msg.fields, "counter_id", 0, session.counters - 1)
    if session.fds[c]:
        return f"counter_id={c} sent twice"
    header = tuple(int_field(msg.fields, key, 0, MAX_RANK) for key in ("layers", "counters", "rank"))
    if header != (session.layers, session.counters, session.rank):
        return f"counter set {c} header disagrees with hello"
    if len(msg.fds) != session.layers:
        return f"counter set {c} carried {len(msg.fds)} fds, expected {session.layers}"
    for fd in msg.fds:
        problem = eventfd_problem(fd)
        if problem is not None:
            return f"counter set {c}: {problem}"
    return None


def _nack_quietly(sock: socket.socket, reason: str) -> None:
    try:
        protocol.send(sock, Op.NACK, reason=reason)
    except OSError:
        pass
