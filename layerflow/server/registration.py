"""How a client's KV pool reaches the server: a sealed memfd (CPU) or CUDA IPC memory handles (GPU).

The server copies straight into the client's pool tensors, so it must map them, and it maps only what it checked:
every field has its type and bounds checked before anything is allocated. A CPU pool lies over a memfd whose fd rides
the socket; the memfd must be sealed against shrinking and growing (see `shm`), so a client cannot truncate it under
the server's mapping (a SIGBUS that would kill the server), and its size must hold the pool. A CUDA pool travels as
plain bytes: one 64-byte cudaIpcGetMemHandle handle per distinct allocation plus each layer's (handle, offset, bytes),
so nothing the client sends is ever unpickled; the server opens each handle once with cudaIpcOpenMemHandle, checks
every layer lies inside its allocation, and views the opened memory through `__cuda_array_interface__`. A server
without CUDA refuses a CUDA pool before reading its payload.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from layerflow.config import MAX_PAGE_SIZE
from layerflow.model.config import DTYPES
from layerflow.server.handoff import MAX_LAYERS
from layerflow.server.protocol import int_field
from layerflow.server.shm import SharedMemory, pool_bytes, pool_layers
from layerflow.tier.layout import KVLayout, LayerGroup

CPU_KIND = "memfd"
CUDA_KIND = "cuda_ipc"
IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
PCI_BUS_ID_BYTES = 32  # [domain]:[bus]:[device].[function] needs 13 with its NUL
PCI_BUS_ID = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_PAGES = 2**31 - 1


def layout_to_dict(layout: KVLayout) -> dict:
    names = {v: k for k, v in DTYPES.items()}
    groups = [[g.num_layers, g.num_heads, g.head_dim, names[g.dtype]] for g in layout.groups]
    return {"page_size": layout.page_size, "groups": groups}


def layout_from_dict(d: object) -> KVLayout:
    """The layout a client describes, every value checked against the bounds a server will allocate for."""
    if not isinstance(d, dict) or set(d) != {"page_size", "groups"}:
        raise ValueError(f"layout {d!r}: expected {{'page_size': int, 'groups': [[layers, heads, head_dim, dtype]]}}")
    page_size = int_field(d, "page_size", 1, MAX_PAGE_SIZE)
    groups = d["groups"]
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_LAYERS:
        raise ValueError(f"layout groups={groups!r}: expected a list of 1 to {MAX_LAYERS} groups")
    out = []
    for g in groups:
        if not isinstance(g, list) or len(g) != 4:
            raise ValueError(f"layout group {g!r}: expected [layers, heads, head_dim, dtype]")
        values = dict(zip(("num_layers", "num_heads", "head_dim", "dtype"), g))
        if values["dtype"] not in DTYPES:
            raise ValueError(f"layout group {g!r}: dtype {values['dtype']!r} not in {sorted(DTYPES)}")
        out.append(LayerGroup(int_field(values, "num_layers", 1, MAX_LAYERS),
                              int_field(values, "num_heads", 1, MAX_HEADS),
                              int_field(values, "head_dim", 1, MAX_HEAD_DIM), DTYPES[values["dtype"]]))
    layout = KVLayout(tuple(out), page_size)
    if layout.num_layers > MAX_LAYERS:
        raise ValueError(f"layout of {layout.num_layers} layers: at most {MAX_LAYERS}")
    return layout


@dataclass
class Export:
    """What the client sends in REGISTER_POOL."""

    fields: dict
    fds: list[int] = field(default_factory=list)
    payload: bytes = b""


@dataclass
class ClientPool:
    """The server's view of one client's per-layer KV tensors, kept alive with what maps them; `close()` (once no
    copy uses the tensors any more) unmaps a CUDA pool's IPC memory and closes a CPU pool's fd."""

    layout: KVLayout
    num_pages: int
    layers: list[torch.Tensor]
    shm: SharedMemory | None = None
    unmap: Callable[[], None] | None = None

    def close(self) -> None:
        self.layers = []
        if self.unmap is not None:
            self.unmap()
            self.unmap = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None   # the mapping goes with the last reference to it


def export_pool(layout: KVLayout, layers: Sequence[torch.Tensor], shm: SharedMemory | None = None) -> Export:
    """Describe `layers` for the server. CPU layers must be the ones `shared_cpu_pool` laid over `shm`."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"layers: {len(layers)} tensors for a layout of {layout.num_layers} layers")
    num_pages = layers[0].shape[0]
    head = {"layout": layout_to_dict(layout), "num_pages": num_pages}
    if layers[0].is_cuda:
        return _export_cuda(head, layers)
    if shm is None:
        raise ValueError("shm=None: a CPU pool must live in shared memory (see shared_cpu_pool)")
    expected = pool_layers(layout, num_pages, shm.tensor)
    for i, (t, e) in enumerate(zip(layers, expected)):
        if t.data_ptr() != e.data_ptr() or t.shape != e.shape:
            raise ValueError(f"layers[{i}] is not laid over shm as shared_cpu_pool lays it")
    return Export({**head, "kind": CPU_KIND, "size": shm.size}, fds=[shm.fd])


def import_pool(fields: dict, fds: list[int], payload: bytes) -> ClientPool:
    """Map a registered pool in the server after checking every field. Takes ownership of `fds` on success; on an
    error (ValueError naming the field, or the CUDA call that failed) they stay the caller's to close."""
    kind = fields.get("kind")
    if kind not in (CPU_KIND, CUDA_KIND):
        raise ValueError(f"kind={kind!r}: expected {CPU_KIND!r} or {CUDA_KIND!r}")
    if kind == CUDA_KIND and not torch.cuda.is_available():
        raise ValueError(f"kind={CUDA_KIND!r}: this transfer server has no CUDA device to open the pool on")
    layout = layout_from_dict(fields.get("layout"))
    num_pages = int_field(fields, "num_pages", 1, MAX_PAGES)
    if kind == CUDA_KIND:
        if fds:
            raise ValueError(f"CUDA pool registration carried {len(fds)} fds, expected none")
        return _import_cuda(fields, payload, layout, num_pages)
    if len(fds) != 1:
        raise ValueError(f"memfd pool registration carried {len(fds)} fds, expected 1")
    size = int_field(fields, "size", 1, 2**62)
    need = pool_bytes(layout, num_pages)
    if need > size:
        raise ValueError(f"num_pages={num_pages} needs {need} bytes, size={size} holds fewer")
    shm = SharedMemory(size, fd=fds[0])  # refuses an fd that is not a sealed memfd of at least `size` bytes
    return ClientPool(layout, num_pages, pool_layers(layout, num_pages, shm.tensor), shm)


# ---- CUDA IPC ---------------------------------------------------------------------------------------------------


class _DeviceBytes:
    """A raw device range in the `__cuda_array_interface__` protocol, so `torch.as_tensor` views it as uint8."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3}


def _export_cuda(head: dict, layers: Sequence[torch.Tensor]) -> Export:
    from cuda.bindings import driver, runtime as rt

    from layerflow.transfer.cuda_api import check

    device = layers[0].device.index
    bases: dict[int, int] = {}   # allocation base -> its handle's index
    handles, rows = [], []
    with torch.cuda.device(device):
        for i, t in enumerate(layers):
            if t.device.index != device or not t.is_contiguous():
                raise ValueError(f"layers[{i}] on {t.device}: every layer must be contiguous on cuda:{device}")
            pointer = t.data_ptr()
            base, _ = check(driver.cuMemGetAddressRange(pointer), "cuMemGetAddressRange")
            base = int(base)
            if base not in bases:
                handle = check(rt.cudaIpcGetMemHandle(base), "cudaIpcGetMemHandle")
                bases[base] = len(handles)
                handles.append(ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES))
            rows.append([bases[base], pointer - base, t.numel() * t.element_size()])
        bus_id = check(rt.cudaDeviceGetPCIBusId(PCI_BUS_ID_BYTES, device), "cudaDeviceGetPCIBusId")
    fields = {**head, "kind": CUDA_KIND, "pci_bus_id": bus_id.split(b"\0", 1)[0].decode(), "handles": len(handles),
              "layers": rows}
    return Export(fields, payload=b"".join(handles))


def device_of_bus_id(bus_id: object) -> int:
    """The server's ordinal of the client's GPU. Ordinals differ between processes (CUDA_VISIBLE_DEVICES pins each
    engine process to its GPU as its cuda:0), the PCI bus id does not."""
    from cuda.bindings import runtime as rt

    from layerflow.transfer.cuda_api import check

    if not isinstance(bus_id, str) or not PCI_BUS_ID.fullmatch(bus_id):
        raise ValueError(f"pci_bus_id={bus_id!r}: expected a PCI bus id like '0000:1b:00.0'")
    try:
        return int(check(rt.cudaDeviceGetByPCIBusId(bus_id.encode()), "cudaDeviceGetByPCIBusId"))
    except Exception as e:  # noqa: BLE001 - the reason names the id; the registration is refused with it
        raise ValueError(f"pci_bus_id={bus_id!r}: not a GPU this server sees ({e})") from None


def _import_cuda(fields: dict, payload: bytes, layout: KVLayout, num_pages: int) -> ClientPool:
    """Open the client's handles (each once) and view every layer inside its allocation."""
    from cuda.bindings import driver, runtime as rt

    from layerflow.transfer.cuda_api import check

    device = device_of_bus_id(fields.get("pci_bus_id"))
    count = int_field(fields, "handles", 1, MAX_LAYERS)
    if len(payload) != count * IPC_HANDLE_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes for {count} IPC handles of {IPC_HANDLE_BYTES} bytes")
    rows = fields.get("layers")
    if not isinstance(rows, list) or len(rows) != layout.num_layers:
        raise ValueError(f"layers={rows!r}: expected one [handle, offset, bytes] per layer of {layout.num_layers}")
    opened: list[tuple[int, int]] = []   # (pointer, allocation size) per handle

    def unmap() -> None:
        with torch.cuda.device(device):
            for pointer, _ in opened:
                rt.cudaIpcCloseMemHandle(pointer)

    try:
        with torch.cuda.device(device):
            for h in range(count):
                handle = rt.cudaIpcMemHandle_t()
                ctypes.memmove(handle.getPtr(), payload[h * IPC_HANDLE_BYTES:(h + 1) * IPC_HANDLE_BYTES],
                               IPC_HANDLE_BYTES)
                pointer = int(check(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess),
                                    "cudaIpcOpenMemHandle"))
                _, size = check(driver.cuMemGetAddressRange(pointer), "cuMemGetAddressRange")
                opened.append((pointer, int(size)))
        layers = []
        for layer, ((g, _), row) in enumerate(zip(layout.layer_map, rows)):
            if not isinstance(row, list) or len(row) != 3:
                raise ValueError(f"layers[{layer}]={row!r}: expected [handle, offset, bytes]")
            named = dict(zip(("handle", "offset", "bytes"), row))
            h, offset, nbytes = (int_field(named, key, 0, 2**62) for key in ("handle", "offset", "bytes"))
            expected = num_pages * layout.layer_page_bytes(g)
            if h >= count or nbytes != expected or offset + nbytes > opened[h][1]:
                raise ValueError(f"layers[{layer}]={row!r}: needs a handle below {count}, {expected} bytes, and to "
                                 f"lie inside its allocation")
            flat = torch.as_tensor(_DeviceBytes(opened[h][0] + offset, nbytes), device=f"cuda:{device}")
            layers.append(flat.view(layout.groups[g].dtype).view(num_pages, *layout.gpu_page_shape(g)))
    except BaseException:
        unmap()
        raise
    return ClientPool(layout, num_pages, layers, unmap=unmap)
