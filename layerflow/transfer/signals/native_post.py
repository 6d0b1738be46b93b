"""A waitvalue layer posted through ctypes: the event after the layer's copies, the posting stream's wait for it and
the stream writes of the layer's words, as plain C calls on the process's libcudart and libcuda.

Why: the post runs once per layer inside the onboarding's issue loop, and through cuda.bindings every call converts
its arguments (and cuStreamBatchMemOp its list of op objects) into Python objects and back. `LAYERFLOW_WAITVALUE_POST`
selects this path (`native`) or the cuda.bindings one (`bindings`, the default until the H200 has compared them).
"""

from __future__ import annotations

import ctypes
import functools
import os

from layerflow.transfer import cudart
from layerflow.transfer.errors import TransferError

ENV = "LAYERFLOW_WAITVALUE_POST"
POSTS = ("bindings", "native")
_MASK = 0xFFFFFFFF


def post_path() -> str:
    """The configured post path; ValueError naming a value that is not one of POSTS."""
    value = os.environ.get(ENV, "bindings").strip().lower()
    if value not in POSTS:
        raise ValueError(f"{ENV}={value!r}: expected one of {POSTS}")
    return value


@functools.cache
def _write_value_32() -> ctypes._CFuncPtr:
    """libcuda's cuStreamWriteValue32 (the `_v2` symbol the header maps the name to since CUDA 12)."""
    cudart.lib()   # torch's runtime first: it creates the primary context libcuda's calls run in
    driver = ctypes.CDLL("libcuda.so.1")
    fn = getattr(driver, "cuStreamWriteValue32_v2", None) or getattr(driver, "cuStreamWriteValue32", None)
    if fn is None:
        raise TransferError("libcuda.so.1 has no cuStreamWriteValue32")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return fn


class NativePoster:
    """Posts on one posting stream: `post` makes the stream wait for `copy_stream`'s work so far (through `event`)
    and then write each `(address, value)`; `write` writes one word on any stream."""

    def __init__(self, post_stream: int) -> None:
        self.post_stream = post_stream
        self._write32 = _write_value_32()

    def write(self, stream: int, address: int, value: int) -> None:
        err = self._write32(stream, address, value & _MASK, 0)
        if err != 0:
            raise TransferError(f"cuStreamWriteValue32 failed: CUresult {err}")

    def post(self, event: int, copy_stream: int, writes: tuple[tuple[int, int], ...]) -> None:
        cudart.event_record(event, copy_stream)
        cudart.stream_wait_event(self.post_stream, event)
        for address, value in writes:
            self.write(self.post_stream, address, value)
