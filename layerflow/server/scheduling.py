"""How the transfer server orders a client's requests: issued in order on the client's connection thread, finished
on one of its completion lanes (each lane in order, the lanes independent), every user claimed while a request about
it is in flight (any client's)."""

from __future__ import annotations

import enum
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from layerflow.transfer.fifo_worker import FifoWorker
from layerflow.server import protocol
from layerflow.server.handoff import Session
from layerflow.server.protocol import Op
from layerflow.server.registration import ClientPool
from layerflow.tier.copies import GroupCopier
from layerflow.transfer.signals.notifier import EventNotifier


class Lane(enum.Enum):
    """A client's completion lanes: each finishes its requests in order, independently of the others."""

    ONBOARD = "onboard"
    OFFLOAD = "offload"
    SSD_ONBOARD = "ssd-onboard"


@dataclass(frozen=True)
class Finish:
    """What an issued request leaves to do: `run` returns the DONE fields; it runs on `lane`, or at once if None."""

    run: Callable[[], dict]
    lane: Lane | None = None


class Client:
    """One connected client: its socket, eventfds, mapped KV pool and completion lanes."""

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock = sock
        self.session = session
        self.pool: ClientPool | None = None
        self.copier: GroupCopier | None = None
        self.notifier: EventNotifier | None = None   # the notifier of the pool's GPU (None: a shared-memory pool)
        self.send_lock = threading.Lock()
        self._lanes: dict[Lane, FifoWorker] = {}   # started on first use: an idle client costs one thread

    def lane(self, lane: Lane) -> FifoWorker:
        if lane not in self._lanes:
            self._lanes[lane] = FifoWorker(f"layerflow-server-{lane.value}")
        return self._lanes[lane]

    def send(self, op: Op, **fields) -> None:
        with self.send_lock:
            protocol.send(self.sock, op, **fields)

    def close_lanes(self) -> None:
        """Let the requests already issued finish (and answer, if the socket still takes it)."""
        for lane in self._lanes.values():
            lane.stop()


class InFlight:
    """Users with a request not yet finished (every client's): a request claims all its users at once, waiting
    while any of them is claimed, and releases them when it finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, threading.Event] = {}

    def claim(self, users: list) -> threading.Event:
        keys = [repr(user) for user in users]
        while True:
            with self._lock:
                busy = next((self._users[k] for k in keys if k in self._users), None)
                if busy is None:
                    finished = threading.Event()
                    self._users.update(dict.fromkeys(keys, finished))
                    return finished
            busy.wait()

    def release(self, users: list, finished: threading.Event) -> None:
        with self._lock:
            for user in users:
                self._users.pop(repr(user), None)
        finished.set()
