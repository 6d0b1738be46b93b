"""Transfer server: one shared host/SSD KV cache for several inference processes on a host.

Clients hand over per-layer eventfds (SCM_RIGHTS) after SO_PEERCRED and token checks; the
server copies KV into their pools and posts those eventfds layer by layer.
"""

from layerflow.server.client import TransferClient
from layerflow.tier.base import NotResident
from layerflow.server.handoff import HandoffError
from layerflow.server.launcher import ServerHandle, spawn_server
from layerflow.server.main import main
from layerflow.server.server import TransferServer
from layerflow.server.shm import shared_cpu_pool

__all__ = ["HandoffError", "NotResident", "ServerHandle", "TransferClient", "TransferServer", "main",
           "shared_cpu_pool", "spawn_server"]
