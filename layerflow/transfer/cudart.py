"""The CUDA runtime calls layerflow makes through ctypes on the process's libcudart (the one torch loaded): the
hot-path copies (2D, batched 1D, batched 3D), the event record and wait of the native signal posts, the host-function
launch of the runtime's wait nodes, and one plain copy (the bucket buffers' slab copy, and what the copy benchmarks
compare against).

cuda.bindings converts every list element of cudaMemcpyBatchAsync into a Python object and back (about 0.7 ms per
layer of 512 pages on the H200, which delays the first layer's copy); through ctypes the descriptors are numpy arrays
passed by pointer, and ctypes drops the GIL during the call. Streams are plain CUstream handles, valid for any runtime
on the device's primary context.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from layerflow.transfer.errors import TransferError

_c = ctypes
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST = 1, 2


@functools.cache
def lib() -> ctypes.CDLL:
    """libcudart as already mapped into this process (torch's), else the first one the loader finds."""
    import torch

    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    candidates = sorted(p for p in paths if os.path.basename(p).startswith("libcudart.so"))
    for name in [*candidates, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            found = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(found)
        return found
    raise TransferError("libcudart not found: neither mapped by torch nor on the loader path")


def _declare(lib: ctypes.CDLL) -> None:
    version = _c.c_int()
    lib.cudaRuntimeGetVersion(_c.byref(version))
    lib.runtime_version = version.value
    lib.cudaMemcpyAsync.restype = _c.c_int
    lib.cudaMemcpyAsync.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int, _c.c_void_p]
    lib.cudaMemcpy2DAsync.restype = _c.c_int
    lib.cudaMemcpy2DAsync.argtypes = [_c.c_void_p, _c.c_size_t, _c.c_void_p, _c.c_size_t, _c.c_size_t, _c.c_size_t,
                                      _c.c_int, _c.c_void_p]
    batch = [_c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_void_p, _c.c_void_p, _c.c_size_t]
    if version.value < 13000:
        batch.append(_c.c_void_p)  # CUDA 12.8/12.9: size_t* failIdx before the stream
    lib.cudaMemcpyBatchAsync.restype = _c.c_int
    lib.cudaMemcpyBatchAsync.argtypes = [*batch, _c.c_void_p]
    lib.has_3d_batch = hasattr(lib, "cudaMemcpy3DBatchAsync")   # CUDA 12.8+
    if lib.has_3d_batch:
        fail_index = [_c.c_void_p] if version.value < 13000 else []   # 12.8/12.9: size_t* failIdx before the flags
        lib.cudaMemcpy3DBatchAsync.restype = _c.c_int
        lib.cudaMemcpy3DBatchAsync.argtypes = [_c.c_size_t, _c.c_void_p, *fail_index, _c.c_ulonglong, _c.c_void_p]
    lib.cudaLaunchHostFunc.restype = _c.c_int
    lib.cudaLaunchHostFunc.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_void_p]
    lib.cudaEventRecord.restype = _c.c_int
    lib.cudaEventRecord.argtypes = [_c.c_void_p, _c.c_void_p]
    lib.cudaStreamWaitEvent.restype = _c.c_int
    lib.cudaStreamWaitEvent.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_uint]
    lib.cudaStreamQuery.restype = _c.c_int
    lib.cudaStreamQuery.argtypes = [_c.c_void_p]
    lib.cudaGetErrorString.restype = _c.c_char_p
    lib.cudaGetErrorString.argtypes = [_c.c_int]


def _check(err: int, call: str) -> None:
    if err != 0:
        raise TransferError(f"{call} failed: cudaError {err}")


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    """One plain copy: the bucket buffers' slab copy, and the bulk reference of the transfer
    benchmarks, issued the way the engine issues its copies."""
    _check(lib().cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def memcpy_2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                    stream: int) -> None:
    _check(lib().cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream), "cudaMemcpy2DAsync")


class BatchCopier:
    """Reusable descriptors for cudaMemcpyBatchAsync: one attribute (stream source order) for every copy."""

    def __init__(self, attrs_address: int) -> None:
        self._attrs = attrs_address
        self._attr_index = np.zeros(1, dtype=np.uint64)
        self._fail_index = np.zeros(1, dtype=np.uint64)
        self._tail = ((self._attrs, self._attr_index.ctypes.data, 1)
                      + ((self._fail_index.ctypes.data,) if lib().runtime_version < 13000 else ()))

    def copy(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
        """`count` copies whose destinations, sources and sizes are uint64 arrays at these addresses (the caller
        keeps the arrays alive and computes the addresses once: see cuda_copy._page_batches)."""
        _check(lib().cudaMemcpyBatchAsync(dsts, srcs, sizes, count, *self._tail, stream), "cudaMemcpyBatchAsync")


class MemLocation(_c.Structure):
    """cudaMemLocation."""

    _fields_ = [("type", _c.c_int32), ("id", _c.c_int32)]


class PointerOperand(_c.Structure):
    """cudaMemcpy3DOperand of type cudaMemcpyOperandTypePointer: its union holds the pointer member (32 bytes, the
    size of the array member too); `rowLength` and `layerHeight` count elements, which are bytes between pointers."""

    _fields_ = [("type", _c.c_uint32), ("ptr", _c.c_uint64), ("rowLength", _c.c_size_t),
                ("layerHeight", _c.c_size_t), ("locHint", MemLocation)]


class Extent(_c.Structure):
    """cudaExtent."""

    _fields_ = [("width", _c.c_size_t), ("height", _c.c_size_t), ("depth", _c.c_size_t)]


class Memcpy3DBatchOp(_c.Structure):
    """cudaMemcpy3DBatchOp (112 bytes on x86-64, the layout of CUDA 12.8-13's driver_types.h)."""

    _fields_ = [("src", PointerOperand), ("dst", PointerOperand), ("extent", Extent),
                ("srcAccessOrder", _c.c_uint32), ("flags", _c.c_uint32)]


OPERAND_POINTER = 1        # cudaMemcpyOperandTypePointer
SRC_ORDER_STREAM = 1       # cudaMemcpySrcAccessOrderStream
BATCH_OP_3D = np.dtype(Memcpy3DBatchOp)   # the same layout as a numpy record, so a table of ops is filled at once


def pitched_ops(dsts: np.ndarray, dst_pitch: int, srcs: np.ndarray, src_pitch: int, width: int,
                rows: np.ndarray) -> np.ndarray:
    """A table of 2D pointer-to-pointer ops, one per element of `dsts` (any shape; `srcs` and `rows` alike): `rows`
    rows of `width` bytes, `dst_pitch` / `src_pitch` bytes apart, read in stream order."""
    ops = np.zeros(dsts.shape, dtype=BATCH_OP_3D)
    for operand, base, pitch in (("src", srcs, src_pitch), ("dst", dsts, dst_pitch)):
        ops[operand]["type"] = OPERAND_POINTER
        ops[operand]["ptr"] = base
        ops[operand]["rowLength"] = pitch
    ops["extent"]["width"] = width
    ops["extent"]["height"] = rows
    ops["extent"]["depth"] = 1
    ops["srcAccessOrder"] = SRC_ORDER_STREAM
    return ops


class PitchedTable:
    """A reusable `pitched_ops` table of one shape, pitches and width: `fill` rewrites only the pointers and row
    counts (a fresh table costs a dozen numpy field writes per transfer). The driver reads a table during the call
    that issues it, so a table may be refilled once that call returned."""

    def __init__(self, shape: tuple[int, ...], dst_pitch: int, src_pitch: int, width: int) -> None:
        zeros = np.zeros(shape, dtype=np.uint64)
        self.ops = pitched_ops(zeros, dst_pitch, zeros, src_pitch, width, zeros)
        self._dst, self._src = self.ops["dst"]["ptr"], self.ops["src"]["ptr"]
        self._rows = self.ops["extent"]["height"]

    def fill(self, dsts: np.ndarray, srcs: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The table with these destinations, sources and rows (`rows` broadcast over the table's shape)."""
        self._dst[...] = dsts
        self._src[...] = srcs
        self._rows[...] = rows
        return self.ops


class OpsCopier:
    """cudaMemcpy3DBatchAsync over tables of BATCH_OP_3D records (each op carries its own source order)."""

    def __init__(self) -> None:
        cuda = lib()
        if not cuda.has_3d_batch:
            raise TransferError(f"cudaMemcpy3DBatchAsync needs CUDA 12.8+; this libcudart is {cuda.runtime_version}")
        self._fail_index = np.zeros(1, dtype=np.uint64)
        self._fail = (self._fail_index.ctypes.data,) if cuda.runtime_version < 13000 else ()

    def copy(self, ops: int, count: int, stream: int) -> None:
        """The `count` ops at address `ops`: the driver reads the table during the call (the caller keeps it alive
        that long), the copies run in stream order after it."""
        _check(lib().cudaMemcpy3DBatchAsync(count, ops, *self._fail, 0, stream), "cudaMemcpy3DBatchAsync")


def event_record(event: int, stream: int) -> None:
    """cudaEventRecord on a raw event handle (`int(cudaEvent_t)`), for the per-layer signal posts."""
    _check(lib().cudaEventRecord(event, stream or None), "cudaEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    """cudaStreamWaitEvent(stream, event, 0) on raw handles."""
    _check(lib().cudaStreamWaitEvent(stream or None, event, 0), "cudaStreamWaitEvent")


NOT_READY = 600   # cudaErrorNotReady


def stream_idle(stream: int) -> bool:
    """cudaStreamQuery on a raw stream handle: True once all work queued on it has finished, False while some is
    pending; any other result (a failed kernel) raises TransferError."""
    err = lib().cudaStreamQuery(stream or None)
    if err == NOT_READY:
        return False
    _check(err, "cudaStreamQuery")
    return True


def launch_host_func(stream: int, fn_addr: int, user_data: int) -> None:
    """cudaLaunchHostFunc(stream, fn, user_data) (a host node when the stream is capturing); cuda.bindings' wrapper
    crashed with a raw function pointer, the C symbol does not."""
    cuda = lib()
    err = cuda.cudaLaunchHostFunc(stream or None, fn_addr, user_data or None)
    if err != 0:
        raise TransferError(f"cudaLaunchHostFunc failed: {cuda.cudaGetErrorString(err).decode()} ({err})")
