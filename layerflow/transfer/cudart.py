"""The CUDA runtime calls layerflow makes through ctypes on the process's libcudart (the one torch loaded): the two
hot-path copies, the event record and wait of the native signal posts, the host-function launch of the runtime's
wait nodes, and the plain copy benchmarks compare against.

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
    lib.cudaLaunchHostFunc.restype = _c.c_int
    lib.cudaLaunchHostFunc.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_void_p]
    lib.cudaEventRecord.restype = _c.c_int
    lib.cudaEventRecord.argtypes = [_c.c_void_p, _c.c_void_p]
    lib.cudaStreamWaitEvent.restype = _c.c_int
    lib.cudaStreamWaitEvent.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_uint]
    lib.cudaGetErrorString.restype = _c.c_char_p
    lib.cudaGetErrorString.argtypes = [_c.c_int]


def _check(err: int, call: str) -> None:
    if err != 0:
        raise TransferError(f"{call} failed: cudaError {err}")


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    """One plain copy: the bulk reference of the transfer benchmarks, issued the way the engine issues its copies."""
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
        keeps the arrays alive and computes the addresses once: see cuda_copy._BatchedLayers)."""
        _check(lib().cudaMemcpyBatchAsync(dsts, srcs, sizes, count, *self._tail, stream), "cudaMemcpyBatchAsync")


def event_record(event: int, stream: int) -> None:
    """cudaEventRecord on a raw event handle (`int(cudaEvent_t)`), for the per-layer signal posts."""
    _check(lib().cudaEventRecord(event, stream or None), "cudaEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    """cudaStreamWaitEvent(stream, event, 0) on raw handles."""
    _check(lib().cudaStreamWaitEvent(stream or None, event, 0), "cudaStreamWaitEvent")


def launch_host_func(stream: int, fn_addr: int, user_data: int) -> None:
    """cudaLaunchHostFunc(stream, fn, user_data) (a host node when the stream is capturing); cuda.bindings' wrapper
    crashed with a raw function pointer, the C symbol does not."""
    cuda = lib()
    err = cuda.cudaLaunchHostFunc(stream or None, fn_addr, user_data or None)
    if err != 0:
        raise TransferError(f"cudaLaunchHostFunc failed: {cuda.cudaGetErrorString(err).decode()} ({err})")
