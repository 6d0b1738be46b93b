"""Host time per phase of each timed request (`layerflow bench --profile`), by the host clock.

`PhaseTimer.attach(engine)` wraps, on that one engine and its parts (never their classes), the methods each phase is
made of; a wrapped call adds its host time to its phase only while a request is open (`start` .. `stop`), so staging,
warm-up and probes are not counted, and only inside its own step (the slab staging chooses the bucket in `prepare`:
that call is part of prepare's packing, not of `launch.bucket`). `rows` turns one request's phase times and its wall time into the reported rows:
the three steps of `Engine.score`, their parts (a part may have parts of its own), what each step or part spends
outside its parts ("other") and what the timed call spends outside the three steps (the engine's lock, splitting and
converting the scores).
"""

from __future__ import annotations

import time
from functools import wraps
from typing import Callable

from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.engine import Engine

# (row, parent, what it times), in the order of the tables. A parent's "other" row is derived: its time less its
# timed parts.
PHASES: tuple[tuple[str, str | None, str], ...] = (
    ("prepare", None, "Engine.prepare: validate, place, issue the onboarding"),
    ("prepare.tiers", "prepare", "tier lookups (KVManager._tier_for, every request)"),
    ("prepare.pack", "prepare", "batch packing and validation (KVManager._batch, JaggedBatch)"),
    ("prepare.alloc", "prepare", "GPU page allocation (KVManager._allocate)"),
    ("prepare.onboard", "prepare", "onboarding issue (KVManager._onboard)"),
    ("launch", None, "Engine.launch"),
    ("launch.bucket", "launch", "bucket choice (Engine._bucket; the slab staging makes it in prepare.pack)"),
    ("launch.fill", "launch", "buffer fill and its host->device copy (BatchBuffers.fill)"),
    ("launch.fill.copy", "launch.fill", "the slab's host->device copy issue (BatchBuffers._slab_to_device)"),
    ("launch.bind", "launch", "wait binding (LayerWait.bind)"),
    ("launch.forward", "launch", "graph replay or eager forward"),
    ("launch.offload", "launch", "history record and early offload issue (KVManager.offload_early)"),
    ("launch.offload.tier", "launch.offload", "the tier's offload: host blocks and copies (KVTier.offload)"),
    ("launch.offload.tier.copy", "launch.offload.tier", "the copy engine's offload issue (CopyEngine.offload)"),
    ("collect", None, "Engine.collect"),
    ("collect.fetch", "collect", "scores fetch incl. the device sync (BatchBuffers.fetch)"),
    ("collect.commit", "collect", "onboarding release and unpin (KVManager.commit)"),
)
STEPS = tuple(name for name, parent, _ in PHASES if parent is None)
OUTSIDE = "outside"   # the timed call less its three steps


PARTS = {name: [part for part, parent, _ in PHASES if parent == name] for name, _, _ in PHASES}


def _subtree(name: str) -> list[str]:
    """`name`, then each of its parts' rows in order, then its "other" if it has parts."""
    names = [name]
    for part in PARTS[name]:
        names += _subtree(part)
    return names + ([f"{name}.other"] if PARTS[name] else [])


def row_names() -> list[str]:
    """Every reported row in table order: each step, its parts (each followed by its own parts), its "other"; then
    "outside" and "wall"."""
    return [name for step in STEPS for name in _subtree(step)] + [OUTSIDE, "wall"]


def rows(phases: dict[str, float], wall_ms: float) -> dict[str, float]:
    """One request's rows (ms): the timed phases (0 where a phase did not run), each parent's other and outside."""
    out = {name: phases.get(name, 0.0) for name, _, _ in PHASES}
    for name, parts in PARTS.items():
        if parts:
            out[f"{name}.other"] = out[name] - sum(out[part] for part in parts)
    out[OUTSIDE] = wall_ms - sum(out[step] for step in STEPS)
    out["wall"] = wall_ms
    return {name: out[name] for name in row_names()}


class PhaseTimer:
    """Sums the host time of each phase over the calls one request makes."""

    def __init__(self) -> None:
        self._open: dict[str, float] | None = None
        self._step: str | None = None   # the step (prepare, launch, collect) being timed

    def start(self) -> None:
        self._open = {}

    def stop(self) -> dict[str, float]:
        """The phases of the request since `start` (ms); the timer records nothing until the next `start`."""
        if self._open is None:
            raise RuntimeError("PhaseTimer.stop: no request was started")
        out, self._open = self._open, None
        return out

    def timed(self, phase: str, fn: Callable) -> Callable:
        """`fn`, adding its host time to `phase` while a request is open."""
        step = phase.split(".")[0]

        @wraps(fn)
        def call(*args, **kwargs):
            if self._open is None or (step != phase and step != self._step):
                return fn(*args, **kwargs)
            outer, self._step = self._step, step
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._open[phase] = self._open.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
                self._step = outer
        return call

    def _wrap(self, owner: object, method: str, phase: str) -> None:
        setattr(owner, method, self.timed(phase, getattr(owner, method)))

    def attach(self, engine: Engine) -> None:
        """Time `engine`'s phases (this instance and its parts only; for the engine's life)."""
        for method in ("prepare", "launch", "collect"):
            self._wrap(engine, method, method)
        self._wrap(engine, "_bucket", "launch.bucket")
        for method, phase in (("_tier_for", "prepare.tiers"), ("_batch", "prepare.pack"),
                              ("_allocate", "prepare.alloc"), ("_onboard", "prepare.onboard"),
                              ("offload_early", "launch.offload"), ("commit", "collect.commit")):
            self._wrap(engine.kv, method, phase)
        for wait in (engine.no_wait, engine.layer_wait):
            self._wrap(wait, "bind", "launch.bind")
        self._wrap(engine.kv.below, "offload", "launch.offload.tier")
        copies = getattr(engine.kv.below, "engine", None)   # the in-process tier's copy engine (none over a server)
        if copies is not None:
            self._wrap(copies, "offload", "launch.offload.tier.copy")
        self._wrap(engine.pipeline, "forward", "launch.forward")
        if engine.graphs is not None:
            self._wrap(engine.graphs, "replay", "launch.forward")
        bufs_of = engine._bufs

        def bufs(bucket: Bucket) -> BatchBuffers:
            found = bufs_of(bucket)
            if "fill" not in vars(found):   # each bucket's buffers are wrapped once, when first handed out
                self._wrap(found, "fill", "launch.fill")
                self._wrap(found, "_slab_to_device", "launch.fill.copy")
                self._wrap(found, "fetch", "collect.fetch")
            return found
        engine._bufs = bufs
