"""The transfer server process: one host pool in shared memory, shared by every client on the host.

Each client (an inference process, e.g. one GPU worker) hands over its per-layer eventfds and
maps its KV pool into the server; the server then runs the copy engine for its onboard and
offload requests and posts the client's eventfds layer by layer. Users live in the host pool
(LRU); with an SSD tier, a user evicted from the host is first written to SSD, and an onboard
of a user found only on SSD reads it back in groups, each group handed to the copy engine as it
lands (SSD -> host -> GPU pipelined; the layer signals fire once the last group's copies are done).

A client's requests are read and issued in order on its connection thread; waiting for an onboard's or an offload's
copies (and answering DONE) happens on one of that client's completion lanes, so a 16K-token offload in flight does
not hold up the next onboard, and an onboard that reads users back from SSD runs whole on its own lane, so it does not
hold up host hits. A request about a user with a request still in flight (any client) waits for that one first: an
onboard never reads blocks an offload is still writing, a drop never frees them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from layerflow.config import Config
from layerflow.transfer.copy_engine import CopyEngine, Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.notifier import EventNotifier
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout
from layerflow.server import protocol
from layerflow.server.auth import (TOKEN_FILE, PeerCred, check_peer, make_private_dir, read_token,
                                            write_token)
from layerflow.server.handoff import HandoffError, server_handoff
from layerflow.server.protocol import Op, ProtocolError
from layerflow.server.registration import import_pool, layout_to_dict
from layerflow.server.remote_signal import ClientSignal
from layerflow.server.scheduling import Client, Finish, InFlight, Lane
from layerflow.server.shm import SharedMemory
from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views

log = logging.getLogger(__name__)
SOCKET_FILE = "transfer.sock"


def make_engine(cuda: bool) -> CopyEngine:
    """The CUDA engine for a client pool on the GPU, the CPU thread engine for one in shared memory."""
    if cuda:
        from layerflow.transfer.cuda_copy import CudaCopyEngine
        return CudaCopyEngine()
    from layerflow.transfer.thread_copy import ThreadCopyEngine
    return ThreadCopyEngine()


class TransferServer:
    """Listens on `run_dir/socket_name` (token beside it); `serve_forever()` accepts clients until `close()`."""

    def __init__(self, config: Config, run_dir: str | os.PathLike | None = None,
                 peer_check: Callable[[PeerCred, int], None] = check_peer, socket_name: str = SOCKET_FILE) -> None:
        self.config = config
        self.run_dir = make_private_dir(run_dir)
        _clear_stale(self.run_dir / socket_name, self.run_dir / TOKEN_FILE)
        self.token_path = write_token(self.run_dir)
        self._token = read_token(self.token_path)
        self.socket_path = self.run_dir / socket_name
        self._peer_check = peer_check
        self._listener = protocol.new_socket()
        self._listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(16)
        self._lock = threading.Lock()  # host pool + SSD bookkeeping
        self._cuda = torch.cuda.is_available()
        self._engines: dict[bool, CopyEngine] = {}  # keyed by "the client pool is on CUDA"
        self._notifier = EventNotifier("layerflow-server-notifier") if self._cuda else None
        self.layout: KVLayout | None = None
        self.host: HostKVPool | None = None
        self._host_shm: SharedMemory | None = None
        self.ssd: SsdStore | None = None
        self._clients: set[Client] = set()
        self._threads: list[threading.Thread] = []   # one per client connection, joined at close
        self._in_flight = InFlight()
        self._closed = threading.Event()
        self._handlers: dict[Op, Callable[[Client, protocol.Message], None]] = {
            Op.REGISTER_POOL: self._register_pool,
            Op.ONBOARD: self._onboard,
            Op.OFFLOAD: self._offload,
            Op.LOOKUP: self._lookup,
            Op.DROP: self._drop,
        }

    # ---- lifecycle -----------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                break
            thread = threading.Thread(target=self._serve_client, args=(sock,), daemon=True,
                                      name="layerflow-server-client")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def close(self) -> None:
        self._closed.set()
        for sock in [self._listener] + [client.sock for client in list(self._clients)]:
            try:  # shutdown, unlike close, wakes a thread blocked in accept() or recv() on the socket
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        self.socket_path.unlink(missing_ok=True)
        for thread in self._threads:  # a thread still inside torch at interpreter exit aborts the process
            thread.join(timeout=5)
        for engine in self._engines.values():
            engine.close()
        if self._notifier is not None:
            self._notifier.stop()
        if self.ssd is not None:
            self.ssd.close()
        if self._host_shm is not None:
            self._host_shm.close()

    # ---- per client ----------------------------------------------------------------------

    def _serve_client(self, sock: socket.socket) -> None:
        try:
            session = server_handoff(sock, self._token, os.getuid(), self._peer_check)
        except (HandoffError, OSError):
            sock.close()
            return
        client = Client(sock, session)
        self._clients.add(client)
        log.info("client pid=%d rank=%d connected (%d layers x %d counters)",
                 session.peer.pid, session.rank, session.layers, session.counters)
        try:
            while True:
                msg = protocol.recv(sock)
                handler = self._handlers.get(msg.op)
                if handler is None:
                    msg.close_fds()
                    client.send(Op.NACK, reason=f"unexpected {msg.op.value} message")
                    continue
                handler(client, msg)
        except (ProtocolError, OSError) as e:
            log.info("client pid=%d rank=%d gone: %s", session.peer.pid, session.rank, e)
        finally:
            self._clients.discard(client)
            client.close_lanes()
            session.close()
            sock.close()

    def _register_pool(self, client: Client, msg: protocol.Message) -> None:
        try:
            pool = import_pool(msg.fields, msg.fds, msg.payload)
            if pool.layout.num_layers != client.session.layers:
                raise ValueError(f"pool has {pool.layout.num_layers} layers, the handoff said {client.session.layers}")
            with self._lock:
                self._ensure_host(pool.layout)
        except Exception as e:  # noqa: BLE001 - a pool we cannot map is refused with the reason, whatever it was
            msg.close_fds()
            client.send(Op.NACK, reason=f"pool registration refused: {e}")
            return
        cuda = pool.layers[0].is_cuda
        with self._lock:
            if cuda not in self._engines:
                self._engines[cuda] = make_engine(cuda)
        client.pool = pool
        client.engine = self._engines[cuda]
        client.send(Op.ACK)

    def _ensure_host(self, layout: KVLayout) -> None:
        """The first registered layout sizes the host pool; later clients must match it."""
        if self.layout is not None:
            if layout != self.layout:
                raise ValueError(f"layout {layout_to_dict(layout)} differs from the server's {layout_to_dict(self.layout)}")
            return
        num_blocks = layout.pages_for_gb(self.config.cpu_cache_gb)
        if num_blocks <= 0:
            raise ValueError(f"cpu_cache_gb={self.config.cpu_cache_gb} holds no block of {layout.page_bytes} bytes")
        shm = SharedMemory(num_blocks * layout.page_bytes, name="layerflow-host-kv")
        if self._cuda:
            from cuda.bindings import runtime as rt

            from layerflow.transfer.cuda_api import check
            check(rt.cudaHostRegister(shm.tensor.data_ptr(), shm.size, rt.cudaHostRegisterDefault),
                  "cudaHostRegister")
        self.host = HostKVPool(layout, buffer=shm.tensor)
        self._host_shm = shm
        self.layout = layout
        if self.config.ssd_cache_gb > 0:
            self.ssd = SsdStore(self.config.ssd_cache_dirs, int(self.config.ssd_cache_gb * 2**30), layout.page_bytes,
                                io_threads=self.config.ssd_io_threads)
        log.info("host pool: %d blocks of %d bytes in shared memory%s", num_blocks, layout.page_bytes,
                 f", SSD tier {self.config.ssd_cache_gb} GiB" if self.ssd else "")

    # ---- requests ------------------------------------------------------------------------

    def _request(self, client: Client, msg: protocol.Message, issue: Callable[[], Finish]) -> None:
        """Run `issue` (checks, pins, issues the copies) now; the finish step it returns (waits for the copies,
        unpins, returns the DONE fields) runs on the client's lane it names, or at once. The request claims its users
        first and holds them until then. An error at either step is answered with ERROR naming the users (then
        non-resident)."""
        msg.close_fds()
        users = _users_of(msg)
        finished = self._in_flight.claim(users)
        try:
            if client.pool is None:
                raise ValueError(f"{msg.op.value} before register_pool")
            finish = issue()
        except Exception as e:  # noqa: BLE001 - whatever failed, the client's waiters must hear about it
            self._in_flight.release(users, finished)
            self._reply_error(client, msg, e)
            return

        def complete() -> None:
            try:
                fields, error = finish.run(), None
            except Exception as e:  # noqa: BLE001 - as above, on the lane
                fields, error = {}, e
            self._in_flight.release(users, finished)  # before the reply: the client's next request may name them
            if error is None:
                self._answer(client, Op.DONE, req=msg["req"], **fields)
            else:
                self._reply_error(client, msg, error)

        if finish.lane is None:
            complete()
        else:
            client.lanes[finish.lane].submit(complete)

    @classmethod
    def _reply_error(cls, client: Client, msg: protocol.Message, error: Exception) -> None:
        users = _users_of(msg)
        log.warning("%s of users %r failed: %s", msg.op.value, users, error)
        cls._answer(client, Op.ERROR, req=msg.get("req"), users=users, reason=str(error))

    @staticmethod
    def _answer(client: Client, op: Op, **fields) -> None:
        """A reply from a lane: a client gone by then is logged, not raised (the request's work is over)."""
        try:
            client.send(op, **fields)
        except OSError as e:
            log.info("cannot send %s, the client is gone: %s", op.value, e)

    def _views(self):
        return tensor_block_views(self.host.blocks)

    def _spill(self, user) -> None:
        """Host eviction hook, run only for users really evicted: write the victim to SSD first when there is one."""
        if self.ssd is not None and not self.ssd.contains(user):
            try:
                self.ssd.store(user, self._views(), self.host.pages(user))
            except (OSError, ValueError) as e:
                log.warning("could not spill user %r to SSD: %s", user, e)

    def _groups(self, client: Client, gpu_pages: list[int], blocks: list[int], signal: ClientSignal | None,
                onboard: bool, issued: list[Transfer]) -> None:
        """One copy-engine call per layer group, each transfer appended to `issued` as soon as it is in flight."""
        for g, r in enumerate(self.layout.group_ranges):
            layers = client.pool.layers[r.start:r.stop]
            if onboard:
                issued.append(client.engine.onboard(layers, self.host.blocks[g], gpu_pages, blocks, signal, r.start))
            else:
                issued.append(client.engine.offload(layers, self.host.blocks[g], gpu_pages, blocks))

    def _wait(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            t.wait(self.config.transfer_timeout_s)

    def _drain(self, transfers: list[Transfer]) -> None:
        """After a failed issue: let the copies already in flight end before their blocks are unpinned."""
        for t in transfers:
            try:
                t.wait(self.config.transfer_timeout_s)
            except TransferError:
                pass

    def _onboard(self, client: Client, msg: protocol.Message) -> None:
        """Several users onto one counter: SSD users are read back first (SSD -> host -> GPU pipelined, unsignalled),
        then every host user's pages go in ONE copy-engine call per layer group, signalled layer by layer. Without SSD
        users the copies are issued here and the onboard lane waits for them; with any, the whole onboarding runs on
        the SSD lane."""
        def issue() -> Finish:
            loads = _parse_loads(msg["loads"])
            counter = msg["counter_id"]
            if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < client.session.counters:
                raise ValueError(f"counter_id={counter!r} outside [0, {client.session.counters})")
            signal = ClientSignal(client.session.fds[counter], bool(msg["layerwise"]), self._notifier)
            pinned = self._pin_for_onboard(loads)
            transfers: list[Transfer] = []

            def fail() -> None:
                self._drain(transfers)
                self._unpin_onboarded(loads, pinned, failed=True)

            def copy() -> None:
                try:
                    gpu_pages, blocks = [], []
                    for (user, pages), (held, from_ssd) in zip(loads, pinned):
                        if from_ssd:
                            self._onboard_from_ssd(client, user, pages, held)
                        else:
                            gpu_pages += pages
                            blocks += held[:len(pages)]
                    if gpu_pages:
                        self._groups(client, gpu_pages, blocks, signal, True, transfers)
                    else:
                        for layer in range(signal.num_layers):
                            signal.complete_layer(layer)
                except BaseException as e:
                    fail()
                    if isinstance(e, Miss):
                        raise LookupError(f"not resident: {e.args[0]}") from e
                    raise

            def finish() -> dict:
                try:
                    self._wait(transfers)
                    signal.flush(self.config.transfer_timeout_s)
                    if signal.error is not None:
                        raise TransferError(str(signal.error))
                except BaseException:
                    fail()
                    raise
                self._unpin_onboarded(loads, pinned, failed=False)
                return {"tiers": ["ssd" if from_ssd else "host" for _, from_ssd in pinned]}

            def copy_then_finish() -> dict:
                copy()
                return finish()

            if any(from_ssd for _, from_ssd in pinned):
                return Finish(copy_then_finish, Lane.SSD_ONBOARD)
            copy()
            return Finish(finish, Lane.ONBOARD)

        self._request(client, msg, issue)

    def _pin_for_onboard(self, loads: list[tuple[object, list[int]]]) -> list[tuple[list[int], bool]]:
        """Pin every user's host blocks (allocating them for users found only on SSD): `(blocks, from_ssd)` each.

        Host-resident users are pinned first, so reading an SSD user back never spills another user of the request.
        A user may hold more blocks than `gpu_pages` (its history was truncated): the first ones are its prefix."""
        out: dict[int, tuple[list[int], bool]] = {}
        with self._lock:
            order = sorted(range(len(loads)), key=lambda i: loads[i][0] not in self.host)
            try:
                for i in order:
                    user, pages = loads[i]
                    if user in self.host:
                        blocks, from_ssd = list(self.host.pages(user)), False
                        self._check_pages(user, len(pages), len(blocks))
                    elif self.ssd is not None and self.ssd.contains(user):
                        held = self.ssd.num_blocks(user)
                        self._check_pages(user, len(pages), held)
                        blocks = list(self.host.allocate(user, held * self.layout.page_size, on_evict=self._spill).pages)
                        from_ssd = True
                    else:
                        raise LookupError(f"user {user!r} is not resident on this server (host or SSD)")
                    self.host.touch(user)
                    self.host.pin(user)
                    out[i] = (blocks, from_ssd)
            except BaseException:
                for i, (_, from_ssd) in out.items():
                    self.host.unpin(loads[i][0])
                    if from_ssd:
                        self.host.free(loads[i][0])
                raise
        return [out[i] for i in range(len(loads))]

    def _unpin_onboarded(self, loads, pinned, failed: bool) -> None:
        with self._lock:
            for (user, _), (_, from_ssd) in zip(loads, pinned):
                self.host.unpin(user)
                if failed and from_ssd:  # half-read blocks must not pass for a host copy; the SSD entry decides
                    self.host.free(user)

    @staticmethod
    def _check_pages(user, num_pages: int, num_blocks: int) -> None:
        if not 0 < num_pages <= num_blocks:
            raise ValueError(f"gpu_pages has {num_pages} pages, user {user!r} holds {num_blocks} blocks")

    def _onboard_from_ssd(self, client: Client, user, gpu_pages: list[int], blocks: list[int]) -> None:
        """SSD -> host in groups, each group's prefix blocks handed to the copy engine as it lands."""
        page_of = dict(zip(blocks, gpu_pages))
        transfers: list[Transfer] = []

        def landed(group_blocks: list[int]) -> None:
            wanted = [b for b in group_blocks if b in page_of]
            if wanted:
                self._groups(client, [page_of[b] for b in wanted], wanted, None, True, transfers)

        try:
            self.ssd.load(user, self._views(), blocks, on_group=landed)
        finally:
            self._wait(transfers)

    def _offload(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            user, gpu_pages, first = msg["user"], [int(p) for p in msg["gpu_pages"]], msg["first"]
            if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= len(gpu_pages):
                raise ValueError(f"offload of user {user!r}: first={first!r} not in [0, {len(gpu_pages)}]")
            with self._lock:
                if user not in self.host or len(self.host.pages(user)) < first:
                    first = 0  # the prefix left the host (spilled, dropped): copy the whole history
                if first == 0 and user in self.host:
                    self.host.free(user)
                blocks = list(self.host.allocate(user, len(gpu_pages) * self.layout.page_size,
                                                 on_evict=self._spill).pages)
                self.host.pin(user)
                if self.ssd is not None:
                    self.ssd.evict(user)
            transfers: list[Transfer] = []

            def fail() -> None:
                self._drain(transfers)
                with self._lock:
                    self.host.unpin(user)
                    self.host.free(user)

            try:
                self._groups(client, gpu_pages[first:], blocks[first:len(gpu_pages)], None, False, transfers)
            except BaseException:
                fail()
                raise

            def finish() -> dict:
                try:
                    self._wait(transfers)
                except BaseException:
                    fail()
                    raise
                with self._lock:
                    self.host.unpin(user)
                return {"blocks": len(blocks), "copied": len(gpu_pages) - first}

            return Finish(finish, Lane.OFFLOAD)

        self._request(client, msg, issue)

    def _lookup(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            user = msg["user"]
            with self._lock:
                if user in self.host:
                    found = {"tier": "host", "blocks": len(self.host.pages(user))}
                elif self.ssd is not None and self.ssd.contains(user):
                    found = {"tier": "ssd", "blocks": self.ssd.num_blocks(user)}
                else:
                    found = {"tier": None, "blocks": 0}
            return Finish(lambda: found)

        self._request(client, msg, issue)

    def _drop(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            user = msg["user"]
            with self._lock:
                on_host = user in self.host
                if on_host:
                    self.host.free(user)
                on_ssd = self.ssd.evict(user) if self.ssd is not None else False
            return Finish(lambda: {"dropped": on_host or on_ssd})

        self._request(client, msg, issue)


def _parse_loads(loads: object) -> list[tuple[object, list[int]]]:
    """`[[user, gpu_pages], ...]` from an ONBOARD message, each user once."""
    if not isinstance(loads, list) or not loads:
        raise ValueError(f"loads={loads!r}: expected a non-empty list of [user, gpu_pages]")
    out = []
    for load in loads:
        if not (isinstance(load, list) and len(load) == 2 and isinstance(load[1], list)
                and all(isinstance(p, int) and not isinstance(p, bool) for p in load[1])):
            raise ValueError(f"load {load!r}: expected [user, [page, ...]]")
        out.append((load[0], load[1]))
    users = [user for user, _ in out]
    if len(set(map(repr, users))) != len(users):
        raise ValueError(f"loads: a user appears twice in {users!r}")
    return out


def _users_of(msg: protocol.Message) -> list:
    """The users a request is about (an ONBOARD's loads, else its `user`), for the ERROR reply."""
    loads = msg.get("loads")
    if isinstance(loads, list):
        return [load[0] for load in loads if isinstance(load, list) and load]
    return [msg.get("user")]


def _clear_stale(socket_path: Path, token_path: Path) -> None:
    """Let a server restart in its directory: a dead predecessor's socket and token go; a live one's stay (refused)."""
    if socket_path.exists():
        probe = protocol.new_socket()
        try:
            probe.connect(str(socket_path))
        except ConnectionRefusedError:
            socket_path.unlink()
        else:
            raise RuntimeError(f"another transfer server listens on {socket_path}")
        finally:
            probe.close()
    token_path.unlink(missing_ok=True)
