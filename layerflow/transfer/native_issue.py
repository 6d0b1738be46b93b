"""A one-run transfer's layers issued by one C call (`csrc/issue_run.c`): each layer's cudaMemcpy2DAsync and, for an
onboarding, its waitvalue post (event record, the posting stream's wait, one cuStreamBatchMemOp of the layer's two
words).

Why: on the caller's thread each layer's copy call and signal post cost ~15-40 us of Python on the H200's host
(docs/performance.md), ahead of the graph's launch for the lead, and after it for the rest and the batch's offload,
while the host should be on its way to the fetch. The C loop
leaves the driver's own cost. It makes the same calls on the same streams in the same order as the Python path
(`layer_issue.LayerIssue` over `cuda_copy._runs_copier` and `WaitValueSignals._signal`), so what the device runs is
unchanged. Where the library cannot be built (no C compiler) `native_run_issuer()` is None and the engine keeps the
Python path.

`RunIssue` has LayerIssue's contract: layers in order, each followed by its post; `finish(error)` once after the
last layer or a failure; a failure poisons the signal from the failed layer on.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from layerflow.runtime.native_build import build_library
from layerflow.transfer.errors import TransferError
from layerflow.transfer.signals.base import NativePosts, SignalHandle

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "issue_run.c"
ENV = "LAYERFLOW_RUN_ISSUE"
ISSUES = ("native", "python")
_STAGES = {1: "cudaMemcpy2DAsync", 2: "cudaEventRecord", 3: "cudaStreamWaitEvent", 4: "cuStreamBatchMemOp"}

_u64, _ptr = ctypes.c_uint64, ctypes.c_void_p


class CudaCalls(ctypes.Structure):
    """The entry points the C loop calls (`lf_cuda_calls`): the process's CUDA ones, or a test's stand-ins."""

    _fields_ = [("memcpy2d", _ptr), ("event_record", _ptr), ("stream_wait", _ptr), ("batch_mem_op", _ptr)]


def native_issue_configured() -> bool:
    """Whether $LAYERFLOW_RUN_ISSUE (one of ISSUES, default "native") asks for the C loop; ValueError naming any
    other value."""
    value = os.environ.get(ENV, ISSUES[0]).strip().lower()
    if value not in ISSUES:
        raise ValueError(f"{ENV}={value!r}: expected one of {list(ISSUES)}")
    return value == "native"


def _load(source: Path) -> ctypes._CFuncPtr:
    fn = ctypes.CDLL(str(build_library(source))).layerflow_issue_run
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.POINTER(CudaCalls), ctypes.c_int64, ctypes.c_int64, _ptr, _u64, _u64, _ptr, _u64, _u64,
                   _u64, _u64, ctypes.c_int32, _ptr, _ptr, _ptr, ctypes.c_uint32, _ptr, ctypes.c_uint32, _ptr,
                   ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]
    return fn


@functools.cache
def issue_run_fn() -> ctypes._CFuncPtr | None:
    """The compiled `layerflow_issue_run` (built on first use), or None where it cannot be built."""
    try:
        return _load(SOURCE)
    except (RuntimeError, OSError) as e:
        log.warning("native run issue unavailable, onboardings are issued from Python: %s", e)
        return None


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def cuda_calls() -> CudaCalls:
    """The process's libcudart calls (torch's runtime) and libcuda's cuStreamBatchMemOp."""
    from layerflow.transfer import cudart

    rt = cudart.lib()
    driver = ctypes.CDLL("libcuda.so.1")
    batch = getattr(driver, "cuStreamBatchMemOp_v2", None) or getattr(driver, "cuStreamBatchMemOp", None)
    if batch is None:
        raise TransferError("libcuda.so.1 has no cuStreamBatchMemOp")
    return CudaCalls(_address(rt.cudaMemcpy2DAsync), _address(rt.cudaEventRecord), _address(rt.cudaStreamWaitEvent),
                     _address(batch))


class RunLayers(NamedTuple):
    """One run's per-layer copy: layer l copies `rows` rows of `width` bytes from `src_bases[l] + src_offset`
    (`src_pitch` apart) to `dst_bases[l] + dst_offset` (`dst_pitch` apart) in direction `kind` (cudaMemcpyKind); the
    tables are uint64 arrays kept alive here."""

    dst_bases: np.ndarray
    dst_offset: int
    dst_pitch: int
    src_bases: np.ndarray
    src_offset: int
    src_pitch: int
    width: int
    rows: int
    kind: int


class RunIssue:
    """Issues a run's layers `0 .. num_layers - 1` through `fn` (`issue_run_fn()`) with `calls`, posting `signal`'s
    layers `first_layer + l` natively; `finish(error)` runs once, after the last layer or a failure."""

    def __init__(self, fn: ctypes._CFuncPtr, calls: CudaCalls, run: RunLayers, num_layers: int,
                 signal: SignalHandle | None, first_layer: int, stream: int,
                 finish: Callable[[TransferError | None], None]) -> None:
        self._fn, self._calls, self._run, self._num_layers = fn, ctypes.byref(calls), run, num_layers
        self._signal, self._first_layer, self._stream, self._finish = signal, first_layer, stream, finish
        self._bases = (run.dst_bases.ctypes.data, run.src_bases.ctypes.data)
        self._error, self._stage = ctypes.c_int32(), ctypes.c_int32()
        self.next_layer = 0

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def done(self) -> bool:
        return self.next_layer >= self._num_layers

    def _call(self, start: int, stop: int, posts: NativePosts | None) -> int:
        run, (dst, src) = self._run, self._bases
        if posts is None:
            events = words = captures = None
            epoch = target = 0
            post_stream = None
        else:   # the tables from this run's first layer: the C loop indexes them by the run's own layers
            offset = 8 * self._first_layer
            events, words, captures = posts.events + offset, posts.words + offset, posts.captures + offset
            epoch, target, post_stream = posts.epoch, posts.target, posts.post_stream
        return self._fn(self._calls, start, stop, dst, run.dst_offset, run.dst_pitch, src, run.src_offset,
                        run.src_pitch, run.width, run.rows, run.kind, self._stream, events, words, epoch, captures,
                        target, post_stream, ctypes.byref(self._error), ctypes.byref(self._stage))

    def issue(self, until: int) -> None:
        """Issue the layers up to `until` (exclusive) in one C call."""
        if self.done:
            return
        start, stop = self.next_layer, min(until, self._num_layers)
        if stop <= start:
            return
        try:
            if self._signal is None:
                issued = self._call(start, stop, None)
            else:
                issued = self._signal.post_native(self._first_layer + start, self._first_layer + stop,
                                                  lambda posts: self._call(start, stop, posts))
        except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters, whatever raised it
            self._fail(exc if isinstance(exc, TransferError) else TransferError(f"issuing layer {start} failed: "
                                                                                f"{exc!r}"))
            return
        self.next_layer = start + issued
        if issued < stop - start:
            layer = self.next_layer
            self._fail(TransferError(f"issuing layer {layer} failed: {_STAGES.get(self._stage.value, '?')} "
                                            f"returned {self._error.value}"))
            return
        if self.done:
            self._finish(None)

    def _fail(self, error: TransferError) -> None:
        if self._signal is not None:
            self._signal.fail(error, self._stream)
        self.next_layer = self._num_layers
        self._finish(error)
