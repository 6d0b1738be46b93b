"""The transfer server process: one host cache in shared memory, shared by every client on the host.

Each client (an inference process, e.g. one GPU worker) hands over its per-layer eventfds and maps its KV pool into
the server; the server then runs the copy engine for its requests and posts the client's eventfds layer by layer. What
the host and SSD hold, and every move between them, is the shared `HostCache` policy (the in-process tier runs the
same code); the copies of an onboarding are the shared `OnboardCopies`. User ids are global on a server: clients that
name the same user share its KV.

A client's requests are read and issued in order on its connection thread; waiting for an onboard's or an offload's
copies (and answering DONE) happens on one of that client's completion lanes, so a 16K-token offload in flight does
not hold up the next onboard, and an onboard that reads users back from SSD runs whole on its own lane, so it does not
hold up host hits. A request about a user with a request still in flight (any client) waits for that one first: an
onboard never reads blocks an offload is still writing, a drop never frees them.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable

import numpy as np
import torch


from layerflow.config import Config
from layerflow.server import protocol
from layerflow.server.auth import PeerCred, check_peer, make_private_dir
from layerflow.server.fields import count_of, history_of, page_list, parse_loads, user_of, users_of
from layerflow.server.handoff import HandoffError, server_handoff
from layerflow.server.listener import SOCKET_FILE, listen
from layerflow.server.protocol import Op, ProtocolError
from layerflow.server.registration import import_pool, layout_to_dict
from layerflow.server.remote_signal import ClientSignal
from layerflow.server.scheduling import Client, Finish, InFlight, Lane
from layerflow.server.shm import SharedMemory
from layerflow.tier.copies import GroupCopier, OnboardCopies, drain
from layerflow.tier.host_cache import HostCache
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout
from layerflow.tier.ssd import SsdStore
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.notifier import EventNotifier

log = logging.getLogger(__name__)
MAX_CLIENTS = 64       # connections served at once; one more is told so and closed (each costs threads and fds)


def make_engine(device: int | None) -> CopyEngine:
    """The CUDA engine of GPU `device` for client pools there, the CPU thread engine (None) for pools in shared
    memory."""
    if device is not None:
        from layerflow.transfer.cuda_copy import CudaCopyEngine
        return CudaCopyEngine(device=device)
    from layerflow.transfer.thread_copy import ThreadCopyEngine
    return ThreadCopyEngine()


class TransferServer:
    """Listens on `run_dir/socket_name` (token beside it); `serve_forever()` accepts clients until `close()`."""

    def __init__(self, config: Config, run_dir: str | os.PathLike | None = None,
                 peer_check: Callable[[PeerCred, int], None] = check_peer, socket_name: str = SOCKET_FILE) -> None:
        self.config = config
        self.run_dir = make_private_dir(run_dir)
        self._listener, self.socket_path, self.token_path, self._token = listen(self.run_dir, socket_name)
        self._peer_check = peer_check
        self._lock = threading.Lock()  # the host cache's creation, the copy engines and the notifiers
        # One copy engine (its own streams) per GPU that client pools live on, None for shared-memory pools, and one
        # notifier per GPU: a CUDA event belongs to one device, so a client's signals follow its own GPU's copies.
        self._engines: dict[int | None, CopyEngine] = {}
        self._notifiers: dict[int, EventNotifier] = {}
        self.layout: KVLayout | None = None
        self.cache: HostCache | None = None
        self._host_shm: SharedMemory | None = None
        self._clients: set[Client] = set()
        self._threads: list[threading.Thread] = []   # one per client connection, joined at close
        self._in_flight = InFlight()
        self._closed = threading.Event()
        self._handlers: dict[Op, Callable[[Client, protocol.Message], None]] = {
            Op.REGISTER_POOL: self._register_pool,
            Op.ONBOARD: self._onboard,
            Op.OFFLOAD: self._offload,
            Op.LOOKUP: self._lookup,
            Op.ADOPT: self._adopt,
            Op.TRUNCATE: self._truncate,
            Op.EVICT: self._evict,
            Op.DROP: self._drop,
            Op.USAGE: self._usage,
        }

    # ---- lifecycle -----------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                break
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= MAX_CLIENTS:
                log.warning("refusing a connection: %d clients already (MAX_CLIENTS)", len(self._threads))
                try:
                    protocol.send(sock, Op.NACK, reason=f"the transfer server serves {MAX_CLIENTS} clients at most")
                except OSError:
                    pass
                sock.close()
                continue
            thread = threading.Thread(target=self._serve_client, args=(sock,), daemon=True,
                                      name="layerflow-server-client")
            self._threads.append(thread)
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
        self.token_path.unlink(missing_ok=True)
        for thread in self._threads:  # a thread still inside torch at interpreter exit aborts the process
            thread.join(timeout=5)
        for engine in self._engines.values():
            engine.close()
        for notifier in self._notifiers.values():
            notifier.stop()
        if self.cache is not None and self.cache.ssd is not None:
            self.cache.ssd.close()
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
            if client.pool is not None:   # its lanes are drained: nothing copies into its memory any more
                client.pool.close()
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
        device = pool.layers[0].device.index if pool.layers[0].is_cuda else None
        with self._lock:
            if device not in self._engines:
                self._engines[device] = make_engine(device)
            if device is not None and device not in self._notifiers:
                self._notifiers[device] = EventNotifier(f"layerflow-server-notifier-{device}", device)
        client.pool = pool
        client.notifier = self._notifiers.get(device)
        client.copier = GroupCopier(self._engines[device], self.layout, pool.layers, self.cache.host.blocks,
                                    self.config.transfer_timeout_s)
        client.send(Op.ACK)

    def _ensure_host(self, layout: KVLayout) -> None:
        """The first registered layout sizes the host pool; later clients must match it."""
        if self.layout is not None:
            if layout != self.layout:
                raise ValueError(f"layout {layout_to_dict(layout)} differs from the server's {layout_to_dict(self.layout)}")
            return
        num_blocks = self.config.blocks("cpu_cache_gb", layout.page_bytes)
        shm = SharedMemory(num_blocks * layout.page_bytes, name="layerflow-host-kv")
        if torch.cuda.is_available():   # portable: pinned for the copy engines of every GPU, not just the first
            from cuda.bindings import runtime as rt

            from layerflow.transfer.cuda_api import check
            check(rt.cudaHostRegister(shm.tensor.data_ptr(), shm.size, rt.cudaHostRegisterPortable),
                  "cudaHostRegister")
        ssd = None
        if self.config.ssd_cache_gb > 0:
            ssd = SsdStore(self.config.ssd_cache_dirs, int(self.config.ssd_cache_gb * 2**30), layout.page_bytes,
                           io_threads=self.config.ssd_io_threads)
        self.cache = HostCache(HostKVPool(layout, buffer=shm.tensor), ssd, keep_histories=True)
        self._host_shm = shm
        self.layout = layout
        log.info("host pool: %d blocks of %d bytes in shared memory%s", num_blocks, layout.page_bytes,
                 f", SSD tier {self.config.ssd_cache_gb} GiB" if ssd else "")

    # ---- requests ------------------------------------------------------------------------

    def _request(self, client: Client, msg: protocol.Message, issue: Callable[[], Finish]) -> None:
        """Run `issue` (checks, pins, issues the copies) now; the finish step it returns (waits for the copies,
        unpins, returns the DONE fields) runs on the client's lane it names, or at once. The request claims its users
        first and holds them until then. An error at either step is answered with ERROR naming the users (then
        non-resident)."""
        msg.close_fds()
        try:
            count_of(msg.get("req"), "req")
        except ValueError as e:
            self._reply_error(client, msg, e)
            return
        users = users_of(msg)
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
            client.lane(finish.lane).submit(complete)

    @classmethod
    def _reply_error(cls, client: Client, msg: protocol.Message, error: Exception) -> None:
        users = users_of(msg)
        log.warning("%s of users %r failed: %s", msg.op.value, users, error)
        cls._answer(client, Op.ERROR, req=msg.get("req"), users=users, reason=str(error))

    @staticmethod
    def _answer(client: Client, op: Op, **fields) -> None:
        """A reply from a lane: a client gone by then is logged, not raised (the request's work is over)."""
        try:
            client.send(op, **fields)
        except OSError as e:
            log.info("cannot send %s, the client is gone: %s", op.value, e)

    def _onboard(self, client: Client, msg: protocol.Message) -> None:
        """Several users onto one counter (the shared `OnboardCopies`): without SSD users the copies are issued here
        and the onboard lane waits for them; with any, the whole onboarding runs on the SSD lane."""
        def issue() -> Finish:
            loads = parse_loads(msg["loads"])
            counter = msg["counter_id"]
            if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < client.session.counters:
                raise ValueError(f"counter_id={counter!r} outside [0, {client.session.counters})")
            signal = ClientSignal(client.session.fds[counter], bool(msg["layerwise"]), client.notifier)
            pinned = self.cache.pin_for_onboard([(user, first, len(pages)) for user, pages, first in loads])
            copies = OnboardCopies(self.cache, client.copier, pinned, [pages for _, pages, _ in loads], signal)

            def failed() -> None:
                """Let the copies in flight end, then give the pinned blocks back (a half read-back is freed)."""
                copies.settle()
                self.cache.release_onboarded(pinned, failed=True)

            def run() -> None:
                """Issue the copies, reading SSD users back first."""
                try:
                    copies.run()
                except BaseException:
                    failed()
                    raise

            def finish() -> dict:
                try:
                    copies.wait()
                    signal.flush(self.config.transfer_timeout_s)
                    if signal.error is not None:
                        raise TransferError(str(signal.error))
                except BaseException:
                    failed()
                    raise
                self.cache.release_onboarded(pinned, failed=False)
                return {"tiers": ["ssd" if p.from_ssd else "host" for p in pinned]}

            def run_then_finish() -> dict:
                run()
                return finish()

            if copies.from_ssd:
                return Finish(run_then_finish, Lane.SSD_ONBOARD)
            run()
            return Finish(finish, Lane.ONBOARD)

        self._request(client, msg, issue)

    def _offload(self, client: Client, msg: protocol.Message) -> None:
        """Copies the pages from the first one the host copy does not hold yet (the shared host cache decides)."""
        def issue() -> Finish:
            user, tokens, gpu_pages = user_of(msg["user"]), count_of(msg["tokens"], "tokens"), \
                page_list(msg["gpu_pages"])
            n = -(-tokens // self.layout.page_size)
            if not 0 < n <= len(gpu_pages):
                raise ValueError(f"offload of user {user!r}: tokens={tokens!r} need more than the "
                                 f"{len(gpu_pages)} pages sent")
            slot = self.cache.begin_offload(user, tokens, count_of(msg.get("valid_from", 0), "valid_from"),
                                            history_of(msg.payload, tokens))
            try:
                transfers = client.copier.copy(gpu_pages[slot.first:n], slot.blocks[slot.first:n], to_gpu=False)
            except BaseException:
                self.cache.end_offload(user, ok=False)
                raise

            def finish() -> dict:
                try:
                    for t in transfers:
                        t.wait(self.config.transfer_timeout_s)
                except BaseException:
                    drain(transfers, self.config.transfer_timeout_s)
                    self.cache.end_offload(user, ok=False)
                    raise
                self.cache.end_offload(user, ok=True)
                return {"copied": n - slot.first}

            return Finish(finish, Lane.OFFLOAD)

        self._request(client, msg, issue)

    def _lookup(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            tier, tokens = self.cache.lookup(user_of(msg["user"]))
            return Finish(lambda: {"tier": tier.value, "tokens": tokens})

        self._request(client, msg, issue)

    def _adopt(self, client: Client, msg: protocol.Message) -> None:
        """A user another client offloaded, with its history, so this client's engine can serve it (tokens 0: none)."""
        def issue() -> Finish:
            adopted = self.cache.adopt(user_of(msg["user"]))
            tokens, history = adopted if adopted is not None else (0, [])
            encoded = base64.b64encode(np.asarray(history, dtype="<i8").tobytes()).decode()
            return Finish(lambda: {"tokens": tokens, "history": encoded})

        self._request(client, msg, issue)

    def _truncate(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            self.cache.truncate(user_of(msg["user"]), count_of(msg["tokens"], "tokens"))
            return Finish(dict)

        self._request(client, msg, issue)

    def _evict(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            self.cache.evict(user_of(msg["user"]))
            return Finish(dict)

        self._request(client, msg, issue)

    def _drop(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            self.cache.drop(user_of(msg["user"]))
            return Finish(dict)

        self._request(client, msg, issue)

    def _usage(self, client: Client, msg: protocol.Message) -> None:
        def issue() -> Finish:
            return Finish(lambda: dataclasses.asdict(self.cache.usage()))

        self._request(client, msg, issue)
