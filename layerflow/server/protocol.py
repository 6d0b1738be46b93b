"""Messages between the transfer server and its clients, one per SOCK_SEQPACKET datagram.

SEQPACKET keeps message boundaries and delivers SCM_RIGHTS fds with the message they
belong to, so framing is only: a 4-byte header length, a JSON header, an optional raw
payload (e.g. the raw bytes of CUDA IPC handles). A truncated message or truncated fd array is a
ProtocolError, never silently a shorter message.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

VERSION = 5  # 4: the server tracks each user's valid tokens (OFFLOAD/LOOKUP carry tokens; TRUNCATE, EVICT, USAGE);
             # 5: a CUDA pool names its GPU by PCI bus id, not by the client's ordinal; OFFLOAD
             # carries the history, ADOPT hands a user to another client
MAX_MESSAGE = 1 << 20
MAX_FDS = 253  # SCM_MAX_FD: the kernel's limit of fds per message
_LEN = struct.Struct("<I")


class Op(str, Enum):
    """Every message kind. Client -> server unless noted."""

    HELLO = "hello"  # token, rank, pid, layers, counters
    COUNTER_SET = "counter_set"  # counter_id, layers, counters, rank + one eventfd per layer
    REGISTER_POOL = "register_pool"  # the client's per-layer KV tensors (memfd or CUDA IPC)
    ONBOARD = "onboard"  # req, loads=[[user, gpu_pages], ...], counter_id, layerwise: one counter for all users
    OFFLOAD = "offload"  # req, user, tokens, gpu_pages (+ payload: the history's item ids, int64): the server copies
                         # the pages its host copy does not hold yet
    ADOPT = "adopt"  # req, user -> DONE tokens, history (base64 int64 item ids): a user another client offloaded
    LOOKUP = "lookup"  # req, user -> DONE tier ("host" | "ssd" | "none"), tokens
    TRUNCATE = "truncate"  # req, user, tokens: only the first `tokens` tokens of the user's copies stay valid
    EVICT = "evict"  # req, user: move the host copy down to SSD
    DROP = "drop"  # req, user
    USAGE = "usage"  # req -> DONE with the host cache's occupancy
    ACK = "ack"  # server -> client
    NACK = "nack"  # server -> client: reason
    DONE = "done"  # server -> client: req finished
    ERROR = "error"  # server -> client: req failed; reason, users


class ProtocolError(ConnectionError):
    """The peer sent something that is not a well-formed message, or hung up."""


@dataclass
class Message:
    op: Op
    fields: dict = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)
    payload: bytes = b""

    def __getitem__(self, key: str):
        if key not in self.fields:
            raise ProtocolError(f"{self.op.value} message lacks field {key!r}")
        return self.fields[key]

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def int_field(fields: Mapping, key: str, low: int, high: int) -> int:
    """`fields[key]`, which must be an int (JSON true/false are not) in [low, high]; ValueError naming it otherwise."""
    if key not in fields:
        raise ValueError(f"field {key!r} is missing")
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key}={value!r}: must be an integer in [{low}, {high}]")
    return value


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of the socket type the protocol expects (for tests and in-process use)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def encode(op: Op, fields: dict, payload: bytes = b"") -> bytes:
    header = json.dumps({"v": VERSION, "op": op.value, **fields}, separators=(",", ":")).encode()
    data = _LEN.pack(len(header)) + header + payload
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes exceeds MAX_MESSAGE={MAX_MESSAGE}")
    return data


def decode(data: bytes, fds: list[int]) -> Message:
    if len(data) < _LEN.size:
        raise ProtocolError(f"message of {len(data)} bytes is shorter than its length prefix")
    (n,) = _LEN.unpack_from(data)
    if _LEN.size + n > len(data):
        raise ProtocolError(f"header length {n} exceeds message of {len(data)} bytes")
    try:
        header = json.loads(data[_LEN.size:_LEN.size + n])
        op = Op(header.pop("op"))
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed header: {e}") from e
    if header.pop("v", None) != VERSION:
        raise ProtocolError(f"protocol version mismatch: expected {VERSION}")
    return Message(op, header, list(fds), bytes(data[_LEN.size + n:]))


def send(sock: socket.socket, op: Op, fds: list[int] | tuple[int, ...] = (), payload: bytes = b"",
         **fields) -> None:
    """Send one message; fds ride along as SCM_RIGHTS (the kernel duplicates them into the peer)."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} fds exceed the per-message limit {MAX_FDS}")
    data = encode(op, fields, payload)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> Message:
    """Receive one message. Raises ProtocolError on hang-up or truncation."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ProtocolError("message or its fds were truncated")
    if not data:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("peer closed the connection")
    return decode(data, fds)
