"""The in-engine side of the transfer server: hand over eventfds, register the KV pool, send requests.

`onboard` returns the same `SignalHandle` the in-process store returns (`wait_layer`, `wait`,
`release`): the client's eventfd ring is the one the server posts, so waiters cannot tell the
difference. When the server reports a failure, or the connection drops (the server died), a
reader thread poisons every affected counter at once: each waiting layer wakes with a
TransferError whose cause is `NotResident` naming the users, and new requests fail fast until
`connect()` is called again (or the caller falls back to the in-process store).
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from layerflow.config import Config
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.eventfd import EventfdSignals
from layerflow.tier.layout import KVLayout
from layerflow.server import protocol
from layerflow.server.auth import TOKEN_FILE, read_token
from layerflow.server.handoff import HANDSHAKE_TIMEOUT_S, HandoffError, client_handoff
from layerflow.server.protocol import Op, ProtocolError
from layerflow.server.registration import export_pool
from layerflow.server.shm import SharedMemory
from layerflow.tier.base import NotResident
from layerflow.transfer.signals.base import SignalHandle

log = logging.getLogger(__name__)


class RemoteSignals(EventfdSignals):
    """An eventfd ring whose layers are written by the server; posting here is bookkeeping only."""

    def _signal(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        """The server already wrote these eventfds before it answered DONE."""


@dataclass
class _Pending:
    users: list
    handle: SignalHandle | None
    future: Future = field(default_factory=Future)
    sent: float = field(default_factory=time.monotonic)


class TransferClient:
    """Connects at construction; raises HandoffError (with the server's reason) if it cannot."""

    def __init__(self, socket_path: str | os.PathLike, token_path: str | os.PathLike, layout: KVLayout,
                 kv_layers: Sequence[torch.Tensor], *, shm: SharedMemory | None = None, num_counters: int = 4,
                 rank: int = 0, timeout_s: float = 10.0) -> None:
        self.layout = layout
        self.rank = rank
        self.timeout_s = timeout_s
        self._kv_layers = list(kv_layers)
        self._shm = shm
        export_pool(layout, self._kv_layers, shm)  # fail early on a pool the server could not map
        self.signals = RemoteSignals(layout.num_layers, num_counters, timeout_s)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._sock = None
        self._reader: threading.Thread | None = None
        self.socket_path, self.token_path = socket_path, token_path
        try:
            self.connect()
        except BaseException:
            self.signals.close()
            raise

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, kv_layers: Sequence[torch.Tensor], *,
                    shm: SharedMemory | None = None, rank: int = 0) -> "TransferClient":
        """Connect to `config.server_socket` (token file beside it) with the config's counters and timeout."""
        if config.server_socket is None:
            raise ValueError("server_socket=None: the config names no transfer server")
        socket_path = Path(config.server_socket)
        if not socket_path.is_socket():
            raise FileNotFoundError(f"server_socket={config.server_socket!r}: no transfer server is running in "
                                    f"{socket_path.parent}")
        return cls(socket_path, socket_path.parent / TOKEN_FILE, layout, kv_layers, shm=shm,
                   num_counters=config.num_counters, rank=rank, timeout_s=config.transfer_timeout_s)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, socket_path: str | os.PathLike | None = None,
                token_path: str | os.PathLike | None = None) -> None:
        """(Re)connect, e.g. to a restarted server: handshake, eventfd handoff, pool registration."""
        self._disconnect("reconnecting")
        self.socket_path = socket_path or self.socket_path
        self.token_path = token_path or self.token_path
        token = read_token(self.token_path)
        sock = protocol.new_socket()
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                sock.connect(str(self.socket_path))
            except OSError as e:
                raise HandoffError(f"cannot connect to transfer server at {self.socket_path}: {e}") from e
            client_handoff(sock, token, self.rank, self.signals.fds)
            export = export_pool(self.layout, self._kv_layers, self._shm)
            protocol.send(sock, Op.REGISTER_POOL, fds=export.fds, payload=export.payload, **export.fields)
            reply = protocol.recv(sock)
            reply.close_fds()
            if reply.op is not Op.ACK:
                raise HandoffError(f"transfer server refused the KV pool: {reply.get('reason')}")
            sock.settimeout(None)
        except (OSError, ProtocolError) as e:
            sock.close()
            if isinstance(e, HandoffError):
                raise
            raise HandoffError(f"transfer server start-up failed: {e}") from e
        with self._lock:
            self._sock = sock
        self._reader = threading.Thread(target=self._read, args=(sock,), daemon=True, name="layerflow-client-reader")
        self._reader.start()

    def close(self) -> None:
        self._disconnect("client closed")
        self.signals.close()

    # ---- requests ------------------------------------------------------------------------

    def onboard(self, user, gpu_pages: Sequence[int], layerwise: bool = True) -> SignalHandle:
        """Copy `user`'s KV from the server into `gpu_pages`; wait on the handle per layer, then `release()` it."""
        return self.onboard_many([(user, gpu_pages)], layerwise)[0]

    def onboard_many(self, loads: Sequence[tuple],
                     layerwise: bool = True) -> tuple[SignalHandle, Future]:
        """One onboarding for several users' `(user, gpu_pages[, first_page])` on ONE signal counter (a batch has one
        wait per layer); `gpu_pages` receive the user's cached pages from `first_page` on (default 0). The server
        copies them in one copy-engine call per layer group. The future completes (or fails with NotResident) once
        the server answered: only then may the pages be reused."""
        if not loads:
            raise ValueError("loads=[]: an onboarding needs at least one user")
        users = [load[0] for load in loads]
        handle = self.signals.acquire(layerwise)
        pending = _Pending(users, handle)
        wire = [[load[0], [int(p) for p in load[1]], int(load[2]) if len(load) > 2 else 0] for load in loads]
        self._submit(Op.ONBOARD, pending, loads=wire,
                     counter_id=handle.counter_id, layerwise=layerwise)
        return handle, pending.future

    def offload(self, user, tokens: int, gpu_pages: Sequence[int], valid_from: int = 0,
                history: Sequence[int] | None = None) -> Future:
        """Copy `user`'s first `tokens` tokens from `gpu_pages` to the server's host pool; the future completes when
        they are there. The server copies only the pages its copy does not hold yet. Its copy stream cannot see this
        process's streams, so pending CUDA work is synchronized first. `history` (one item id per token) goes with
        the copy, so another client of the server can `adopt` the user."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= len(gpu_pages) * \
                self.layout.page_size:
            raise ValueError(f"tokens={tokens!r}: expected 1..{len(gpu_pages) * self.layout.page_size} "
                             f"({len(gpu_pages)} pages)")
        payload = b""
        if history is not None:
            if len(history) != tokens:
                raise ValueError(f"history of {len(history)} items for tokens={tokens}")
            payload = np.asarray(history, dtype="<i8").tobytes()
        if self._kv_layers[0].is_cuda:
            torch.cuda.current_stream(self._kv_layers[0].device).synchronize()
        pending = _Pending([user], None)
        self._submit(Op.OFFLOAD, pending, payload, user=user, tokens=tokens, gpu_pages=[int(p) for p in gpu_pages],
                     valid_from=int(valid_from))
        return pending.future

    def adopt(self, user) -> tuple[int, list[int]] | None:
        """`(tokens, item history)` of a user another client offloaded to the server, or None if it holds none."""
        result = self._call(Op.ADOPT, user=user)
        tokens, encoded = result.get("tokens"), result.get("history")
        if not tokens:
            return None
        history = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i8")
        if len(history) != tokens:
            raise ProtocolError(f"adopt of user {user!r}: {len(history)} history items for tokens={tokens}")
        return tokens, history.tolist()

    def lookup(self, user) -> tuple[str, int]:
        """("host" | "ssd" | "none", valid tokens) of `user` on the server."""
        result = self._call(Op.LOOKUP, user=user)
        return result["tier"], result["tokens"]

    def truncate(self, user, tokens: int) -> None:
        self._call(Op.TRUNCATE, user=user, tokens=tokens)

    def evict(self, user) -> None:
        self._call(Op.EVICT, user=user)

    def drop(self, user) -> None:
        self._call(Op.DROP, user=user)

    def usage(self) -> dict:
        return self._call(Op.USAGE)

    def _call(self, op: Op, **fields) -> dict:
        pending = _Pending([fields["user"]] if "user" in fields else [], None)
        self._submit(op, pending, **fields)
        try:
            return pending.future.result(self.timeout_s)
        except FutureTimeout:
            raise TransferError(f"transfer server did not answer {op.value} {fields} within {self.timeout_s:.3f} s") \
                from None

    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        with self._lock:
            return len(self._pending)

    def responsive(self) -> bool:
        """False while a request has gone unanswered for longer than the timeout (a hung server): new requests then
        fail at once instead of each waiting a timeout. It recovers by itself when the answers come."""
        with self._lock:
            return self._responsive()

    def _responsive(self) -> bool:
        oldest = min((p.sent for p in self._pending.values()), default=None)
        return oldest is None or time.monotonic() - oldest <= self.timeout_s

    def _submit(self, op: Op, pending: _Pending, payload: bytes = b"", **fields) -> None:
        req = next(self._ids)
        with self._lock:
            sock, responsive = self._sock, self._responsive()
            if sock is not None and responsive:
                self._pending[req] = pending
        if sock is None or not responsive:
            why = "not connected to a transfer server" if sock is None else \
                f"the transfer server has left a request unanswered for more than {self.timeout_s:.3f} s"
            self._finish(pending, NotResident(pending.users, why))
            return
        try:
            protocol.send(sock, op, payload=payload, req=req, **fields)
        except OSError as e:
            with self._lock:
                self._pending.pop(req, None)
            self._finish(pending, NotResident(pending.users, f"send failed: {e}"))

    # ---- replies -------------------------------------------------------------------------

    def _read(self, sock) -> None:
        reason = "transfer server connection lost"
        try:
            while True:
                msg = protocol.recv(sock)
                msg.close_fds()
                with self._lock:
                    pending = self._pending.pop(msg.get("req"), None)
                if pending is None:
                    log.warning("transfer server sent %s for unknown request %r", msg.op.value, msg.get("req"))
                elif msg.op is Op.DONE:
                    self._finish(pending, None, {k: v for k, v in msg.fields.items() if k != "req"})
                else:
                    self._finish(pending, NotResident(msg.get("users") or pending.users, msg.get("reason", "")))
        except (ProtocolError, OSError) as e:
            reason = f"{reason}: {e}"
        self._fail_all(sock, reason)

    def _finish(self, pending: _Pending, error: NotResident | None, fields: dict | None = None) -> None:
        if pending.handle is not None:
            if error is None:
                for layer in range(pending.handle.num_layers):
                    pending.handle.complete_layer(layer)
            else:
                pending.handle.fail(error)
        if error is None:
            pending.future.set_result(fields or {})
        else:
            log.warning("%s", error)
            pending.future.set_exception(error)

    def _fail_all(self, sock, reason: str) -> None:
        """Poison every request in flight on `sock` (all of them: the server is gone or we hung up)."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
            failed = list(self._pending.values())
            self._pending.clear()
        for pending in failed:
            self._finish(pending, NotResident(pending.users, reason))

    def _disconnect(self, reason: str) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader is not None:
            self._reader.join()
        sock.close()
        self._fail_all(sock, reason)
