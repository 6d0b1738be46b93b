"""The tier below the GPU served by a transfer server (`TransferClient`): host pool and SSD live in its process.

The server copies into this process's KV pool (CUDA IPC, or shared memory on the CPU path) and posts the client's
eventfds, so the engine's eventfd waits work unchanged on `client.signals`. The server keeps the host cache and its
bookkeeping (valid tokens per user, the same `HostCache` the in-process tier runs); this side asks it. If the server
dies, the client's reader poisons every counter in flight at once (waiters raise TransferError, cause NotResident) and
`alive()` is False until a reconnect succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout

import torch

from layerflow.config import Config
from layerflow.server.client import TransferClient
from layerflow.server.handoff import HandoffError
from layerflow.server.launcher import ServerHandle, spawn_server
from layerflow.server.protocol import ProtocolError
from layerflow.server.shm import SharedMemory
from layerflow.tier.base import KVTier, Load, Onboarding, Tier, TierUsage, settle
from layerflow.tier.layout import KVLayout
from layerflow.transfer.copy_engine import Transfer
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import SignalHandle

log = logging.getLogger(__name__)


class _FutureTransfer(Transfer):
    """A server request seen as a Transfer; waits are bounded by the client's timeout."""

    def __init__(self, future: Future, timeout_s: float):
        self.future, self.timeout_s = future, timeout_s

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> None:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            self.future.result(timeout)
        except FutureTimeout:
            raise TransferError(f"transfer server did not answer within {timeout:.3f} s") from None

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None


class _RemoteOnboarding(Onboarding):
    """The server writes into our pages until it answers (or its connection drops: it died, or it finished its
    lanes before closing)."""

    def __init__(self, handle: SignalHandle, done: Future, timeout_s: float):
        self.handle, self._done = handle, _FutureTransfer(done, timeout_s)

    def finish(self, wait: bool) -> bool:
        if wait:
            settle(self._done)
        self.handle.release()
        return self.fenced()

    def fenced(self) -> bool:
        return self._done.done()


class RemoteTier(KVTier):
    """`client` talks to the server; `server` is the process this tier spawned (stopped at close), if any; `shm` is
    the shared memory the CPU path's GPU pool lives in (closed at close)."""

    def __init__(self, client: TransferClient, server: ServerHandle | None = None,
                 shm: SharedMemory | None = None) -> None:
        self.client, self.server, self.shm = client, server, shm
        self.signals = client.signals
        self._offloads: dict[int, Transfer] = {}
        self._unreachable = False   # a lookup failed: said once, until one succeeds again

    def locate(self, user: int, tokens: int) -> Tier:
        """A server that does not answer (hung, or gone) holds nothing: the user is a miss, recomputed."""
        if tokens <= 0:
            return Tier.NONE
        try:
            where, held = self.client.lookup(user)
        except TransferError as e:
            if not self._unreachable:
                log.warning("transfer server lookups fail, serving its users as misses: %s", e)
            self._unreachable = True
            return Tier.NONE
        if self._unreachable:
            log.warning("transfer server lookups answer again")
            self._unreachable = False
        return Tier(where) if held >= tokens else Tier.NONE

    def adopt(self, user: int) -> tuple[int, list[int]] | None:
        """A user another engine of this host offloaded to the server; a server that does not answer, or answers
        garbage, holds none (the user is a miss)."""
        try:
            return self.client.adopt(user)
        except (TransferError, ProtocolError, ValueError) as e:
            log.warning("adopting user %s from the transfer server failed: %s", user, e)
            return None

    def onboard(self, loads: Sequence[Load], layerwise: bool, after: Sequence[Transfer] = ()) -> Onboarding:
        handle, done = self.client.onboard_many([(load.user, load.gpu_pages, load.first_page) for load in loads],
                                                layerwise)
        return _RemoteOnboarding(handle, done, self.client.timeout_s)

    def offload(self, user: int, tokens: int, gpu_pages: Sequence[int], valid_from: int = 0,
                history: Sequence[int] | None = None) -> Transfer:
        """The server copies the pages from the first one its copy does not hold yet; `history` goes with them (the
        server keeps it for the other engines of the host, which `adopt` the user)."""
        if user in self._offloads:  # reap the previous one first: its failure must be seen before this one lands
            settle(self._offloads[user])
            self.reap()
        transfer = _FutureTransfer(self.client.offload(user, tokens, gpu_pages, valid_from, history),
                                   self.client.timeout_s)
        self._offloads[user] = transfer
        return transfer

    def reap(self) -> None:
        for user, transfer in list(self._offloads.items()):
            if transfer.done():
                del self._offloads[user]
                if transfer.error is not None:
                    log.warning("offload of user %s to the transfer server failed: %s", user, transfer.error)

    def _settled(self, user: int) -> None:
        settle(self._offloads.get(user))
        self.reap()

    def truncate(self, user: int, tokens: int) -> None:
        self._settled(user)
        self._quietly(self.client.truncate, user, tokens)

    def evict(self, user: int) -> None:
        self._settled(user)
        self._quietly(self.client.evict, user)

    def drop(self, user: int) -> None:
        self._settled(user)
        self._quietly(self.client.drop, user)

    def _quietly(self, call, *args) -> None:
        """A bookkeeping call the server may not hear: it went away with the copy (a reconnect starts afresh)."""
        if self.client.connected:
            try:
                call(*args)
            except TransferError as e:
                log.info("transfer server did not take %s%r: %s", call.__name__, args, e)

    def usage(self) -> TierUsage:
        return TierUsage(**self.client.usage())

    def alive(self) -> bool:
        """Connected, or reconnected now (e.g. to a restarted server: it knows only what it holds)."""
        if self.client.connected:
            return True
        try:
            self.client.connect()
        except (HandoffError, OSError, ValueError) as e:
            log.info("transfer server at %s unreachable: %s", self.client.socket_path, e)
            return False
        log.warning("reconnected to the transfer server at %s", self.client.socket_path)
        return True

    def close(self) -> None:
        for transfer in self._offloads.values():
            settle(transfer)
        self.client.close()
        if self.server is not None:
            self.server.stop()
        if self.shm is not None:
            self.shm.close()


def connect(config: Config, layout: KVLayout, kv_layers: Sequence[torch.Tensor],
            shm: SharedMemory | None = None) -> RemoteTier:
    """The tier of the config's server: spawn one (`spawn_server`) or connect to `server_socket`.

    `kv_layers` is the engine's KV pool (on CUDA, or on the CPU laid over `shm` by `shared_cpu_pool`); the tier owns
    `shm` from now on."""
    if not (config.spawn_server or config.server_socket):
        raise ValueError("spawn_server=False and server_socket=None: the config names no transfer server")
    if not config.spawn_server:
        return RemoteTier(TransferClient.from_config(config, layout, kv_layers, shm=shm), shm=shm)
    server = spawn_server(config)
    try:
        client = TransferClient(server.socket_path, server.token_path, layout, kv_layers, shm=shm,
                                num_counters=config.num_counters, timeout_s=config.transfer_timeout_s)
    except BaseException:
        server.stop()
        raise
    return RemoteTier(client, server, shm)
