"""How a client's KV pool reaches the server: a memfd (CPU) or CUDA IPC handles (GPU).

The server copies straight into the client's pool tensors, so it must map them: a CPU pool
is laid over shared memory whose fd rides the socket; a CUDA pool is exported per layer with
torch's storage sharing (cudaIpcGetMemHandle underneath). The IPC payload is a pickle, which
the server reads only from a peer that passed SO_PEERCRED and the token check.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import reduce_tensor

from layerflow.model.config import DTYPES
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.server.shm import SharedMemory, pool_bytes, pool_layers

CPU_KIND = "memfd"
CUDA_KIND = "cuda_ipc"


def layout_to_dict(layout: KVLayout) -> dict:
    names = {v: k for k, v in DTYPES.items()}
    groups = [[g.num_layers, g.num_heads, g.head_dim, names[g.dtype]] for g in layout.groups]
    return {"page_size": layout.page_size, "groups": groups}


def layout_from_dict(d: dict) -> KVLayout:
    try:
        return KVLayout(tuple(LayerGroup(*g) for g in d["groups"]), d["page_size"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"layout {d!r}: {e}") from e


@dataclass
class Export:
    """What the client sends in REGISTER_POOL."""

    fields: dict
    fds: list[int] = field(default_factory=list)
    payload: bytes = b""


@dataclass
class ClientPool:
    """The server's view of one client's per-layer KV tensors (kept alive with what maps them)."""

    layout: KVLayout
    num_pages: int
    layers: list[torch.Tensor]
    shm: SharedMemory | None = None


def export_pool(layout: KVLayout, layers: Sequence[torch.Tensor], shm: SharedMemory | None = None) -> Export:
    """Describe `layers` for the server. CPU layers must be the ones `shared_cpu_pool` laid over `shm`."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"layers: {len(layers)} tensors for a layout of {layout.num_layers} layers")
    num_pages = layers[0].shape[0]
    head = {"layout": layout_to_dict(layout), "num_pages": num_pages}
    if layers[0].is_cuda:
        handles = [reduce_tensor(t) for t in layers]
        return Export({**head, "kind": CUDA_KIND}, payload=pickle.dumps(handles))
    if shm is None:
        raise ValueError("shm=None: a CPU pool must live in shared memory (see shared_cpu_pool)")
    expected = pool_layers(layout, num_pages, shm.tensor)
    for i, (t, e) in enumerate(zip(layers, expected)):
        if t.data_ptr() != e.data_ptr() or t.shape != e.shape:
            raise ValueError(f"layers[{i}] is not laid over shm as shared_cpu_pool lays it")
    return Export({**head, "kind": CPU_KIND, "size": shm.size}, fds=[shm.fd])


def import_pool(fields: dict, fds: list[int], payload: bytes) -> ClientPool:
    """Map a registered pool in the server. Takes ownership of `fds`."""
    layout = layout_from_dict(fields["layout"])
    num_pages = fields["num_pages"]
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ValueError(f"num_pages={num_pages!r}: must be a positive integer")
    kind = fields.get("kind")
    if kind == CPU_KIND:
        if len(fds) != 1:
            raise ValueError(f"memfd pool registration carried {len(fds)} fds, expected 1")
        size = pool_bytes(layout, num_pages)
        shm = SharedMemory(size, fd=fds[0])
        return ClientPool(layout, num_pages, pool_layers(layout, num_pages, shm.tensor), shm)
    if kind == CUDA_KIND:
        handles = pickle.loads(payload)
        layers = [rebuild(*args) for rebuild, args in handles]
        if len(layers) != layout.num_layers:
            raise ValueError(f"{len(layers)} CUDA tensors for a layout of {layout.num_layers} layers")
        return ClientPool(layout, num_pages, layers)
    raise ValueError(f"kind={kind!r}: expected {CPU_KIND!r} or {CUDA_KIND!r}")
