"""Where a layerwise request's time goes past the copies (`bench --timeline`): device marks at each layer's wait
release, around the graph replay and the score fetch, and host stamps along the issue path.

`TailMarks(engine, copy_engine)` wraps, on that one engine and its parts (never their classes), the layer wait
(a `ReleaseMarks` records an event right after each layer's wait: under capture an event record node, so every replay
re-records it), the graph replay, each bucket's `fetch` and the issue steps of the onboarding. Install it before
`warmup`: the wrapped wait is its own graph variant. The device marks are CUDA events on the compute stream; an event
recorded by the host on a stream that is idle carries the host's time, so `fetch_call` - `graph_end` > 0 says the host
reached the fetch after the GPU had finished, and `woke` is the host's return from the fetch (its wait for the done
word and the results' copy; the host stamps `fetch_waited` and `fetch_end` split the two).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import wraps
from typing import Callable

import torch

from layerflow.bench.copy_timing import TimedCudaCopyEngine
from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.engine import Engine
from layerflow.runtime.waits import LayerWait
from layerflow.transfer import cuda_api
from layerflow.transfer.signals.base import SignalHandle

# Compute-stream marks recorded by the host, in stream order after the graph's work.
DEVICE_MARKS = ("replay_call", "graph_end", "fetch_call", "woke")
# Host stamps in the order a request passes them (ms from score entry, host clock).
HOST_STAMPS = ("tiers_found", "lengths_checked", "pages_allocated", "onboard_call", "tier_onboard", "host_pinned",
               "signal_acquired", "engine_onboard", "job_checked", "copier_built", "copy0_issued", "all_issued",
               "onboard_end", "prepare_end", "fill_end", "replay_call", "launch_end", "fetch_call", "fetch_waited",
               "fetch_end", "collect_end")


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


class ReleaseMarks(LayerWait):
    """`inner`'s waits, each followed by an event: when that layer's compute could start."""

    def __init__(self, inner: LayerWait, num_layers: int) -> None:
        self.inner = inner
        self.events = [cuda_api.create_event(timing=True) for _ in range(num_layers)]

    def bind(self, handle: SignalHandle | None) -> None:
        self.inner.bind(handle)

    def layer(self, layer: int) -> None:
        self.inner.layer(layer)
        if torch.cuda.is_current_stream_capturing():
            cuda_api.record_external(self.events[layer], _stream())
        else:
            cuda_api.record(self.events[layer], _stream())

    def check(self) -> None:
        self.inner.check()


class HostStamps:
    """perf_counter stamps of one request, in ms from `open()`; nothing is stamped outside `open` .. `close`."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self.stamps: dict[str, float] = {}

    def open(self) -> None:
        self.stamps, self._t0 = {}, time.perf_counter()

    def close(self) -> dict[str, float]:
        self._t0 = None
        return self.stamps

    def stamp(self, name: str) -> None:
        if self._t0 is not None and name not in self.stamps:   # the first pass counts (one onboarding per request)
            self.stamps[name] = (time.perf_counter() - self._t0) * 1e3

    def around(self, owner: object, method: str, before: str | None = None, after: str | None = None) -> None:
        """Stamp `before` as `owner.method` is called and `after` as it returns (instance attribute only)."""
        fn = getattr(owner, method)

        @wraps(fn)
        def call(*args, **kwargs):
            if before:
                self.stamp(before)
            result = fn(*args, **kwargs)
            if after:
                self.stamp(after)
            return result
        setattr(owner, method, call)


@dataclass(frozen=True)
class TailTimes:
    """One request's device marks (ms from score entry: `released` per layer, then DEVICE_MARKS) and host stamps."""

    released: tuple[float, ...]
    device: dict[str, float]
    host: dict[str, float]


class TailMarks:
    """The engine's wraps (see the module docstring) and the events they record."""

    def __init__(self, engine: Engine, copy_engine: TimedCudaCopyEngine) -> None:
        self.waits = ReleaseMarks(engine.layer_wait, engine.weights.config.num_layers)
        self.events = {name: cuda_api.create_event(timing=True) for name in DEVICE_MARKS}
        self.host = HostStamps()
        self.copy_engine = copy_engine
        engine.layer_wait = self.waits
        self._wrap_device(engine)
        self._wrap_host(engine, copy_engine)

    def _record(self, name: str) -> None:
        cuda_api.record(self.events[name], _stream())

    def _recording(self, fn: Callable, before: str | None, after: str | None) -> Callable:
        @wraps(fn)
        def call(*args, **kwargs):
            if before:
                self._record(before)
                self.host.stamp(before)
            result = fn(*args, **kwargs)
            if after:
                self._record(after)
            return result
        return call

    def _wrap_device(self, engine: Engine) -> None:
        if engine.graphs is not None:   # forward itself runs inside captures: only the replay is marked then
            engine.graphs.replay = self._recording(engine.graphs.replay, "replay_call", "graph_end")
        else:
            engine.pipeline.forward = self._recording(engine.pipeline.forward, "replay_call", "graph_end")
        bufs_of = engine._bufs

        def bufs(bucket: Bucket) -> BatchBuffers:
            found = bufs_of(bucket)
            if not getattr(found, "_tail_marked", False):
                if found._done is not None:
                    self.host.around(found._done, "wait", after="fetch_waited")
                self.host.around(found, "fetch", after="fetch_end")   # inside the marks: the copy, not the mark
                found.fetch = self._recording(found.fetch, "fetch_call", "woke")
                self.host.around(found, "fill", after="fill_end")
                found._tail_marked = True
            return found
        engine._bufs = bufs

    def _wrap_host(self, engine: Engine, copy_engine: TimedCudaCopyEngine) -> None:
        stamps, kv = self.host, engine.kv
        stamps.around(kv, "_tier_for", after="tiers_found")   # the first user's: one user per request at BS=1
        stamps.around(kv, "_query_tokens", after="lengths_checked")
        stamps.around(kv, "_allocate", after="pages_allocated")
        stamps.around(kv, "_onboard", "onboard_call", "onboard_end")
        stamps.around(engine, "prepare", after="prepare_end")
        stamps.around(engine, "launch", after="launch_end")
        stamps.around(engine, "collect", after="collect_end")
        below = kv.below
        if hasattr(below, "cache"):
            stamps.around(below.cache, "pin_for_onboard", after="host_pinned")
        stamps.around(below, "onboard", "tier_onboard")
        stamps.around(below.signals, "acquire", after="signal_acquired")
        stamps.around(copy_engine, "onboard", "engine_onboard")
        stamps.around(copy_engine, "_onboard", "job_checked", "all_issued")
        stamps.around(copy_engine, "_layer_copier", after="copier_built")
        stamps.around(copy_engine, "_onboard_run", "job_checked", "all_issued")   # one run: checked, no job
        stamps.around(copy_engine, "_run_copier", after="copier_built")
        copy_engine.on_layer_issued = lambda layer: stamps.stamp("copy0_issued") if layer == 0 else None

    def read(self, entry: object) -> TailTimes:
        """The marks of the request just timed, relative to its `entry` event (already completed)."""
        ms = cuda_api.elapsed_ms
        return TailTimes(tuple(ms(entry, e) for e in self.waits.events),
                         {name: ms(entry, e) for name, e in self.events.items()}, self.host.close())
