"""Where the host time of issuing copies goes, for the serving and copy-path benchmarks: a CudaCopyEngine that times
each transfer on the host clock: the whole `onboard` / `offload` call, of it the engine's issue (less: the plan of runs
and the index checks), of that the address set-up and the copy calls (the driver; the rest: per-layer signal posts,
the completion event, an offload's wait for the current stream); the time from the call's start until layer 0's
copies were issued (what a layerwise onboarding's first layer waits for on the host); and histograms of runs per
placement.

Only host time is read (perf_counter around the engine's own steps); the copies are the production engine's.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from layerflow.transfer.copy_engine import CopyEngine, CopyJob
from layerflow.transfer.copy_plan import plan_runs
from layerflow.transfer.cuda_copy import CudaCopyEngine, CudaTransfer, resolved_path

RUN_BINS = (1, 2, 4, 8, 16, 32, 64, 128)   # histogram bins: runs up to each bound (the last bin: above 128)


@dataclass(frozen=True)
class IssueRecord:
    """One transfer: direction, pages, runs, the path it took, and host seconds in the whole call, in the engine's
    issue, in the address set-up, in the copy calls, and from the call's start until layer 0's copies were issued."""

    to_gpu: bool
    pages: int
    runs: int
    path: str
    total_s: float
    issue_s: float
    setup_s: float
    calls_s: float
    layer0_s: float


class IssueTimedCopyEngine(CudaCopyEngine):
    """A CudaCopyEngine that appends an IssueRecord per transfer to `records` (clear it between measurements)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[IssueRecord] = []
        self._current = threading.local()

    def onboard(self, *args, **kwargs):
        return self._recorded(super().onboard, True, args, kwargs)

    def offload(self, *args, **kwargs):
        return self._recorded(super().offload, False, args, kwargs)

    def _onboard_run(self, gpu_layers, host, addresses, run, signal, first_layer):
        """A one-run onboarding issued as a job (CopyEngine's default): the steps this engine times are a job's."""
        return CopyEngine._onboard_run(self, gpu_layers, host, addresses, run, signal, first_layer)

    def _recorded(self, call: Callable, to_gpu: bool, args: tuple, kwargs: dict):
        current = self._current
        current.job, current.issue, current.setup, current.calls, current.layer0 = None, 0.0, 0.0, 0.0, 0.0
        current.start = start = time.perf_counter()
        transfer = call(*args, **kwargs)
        spent = time.perf_counter() - start
        plan = current.job.plan
        path = resolved_path(self.path, plan.num_runs).name.lower()
        self.records.append(IssueRecord(to_gpu, plan.num_pages, plan.num_runs, path, spent, current.issue,
                                        current.setup, current.calls, current.layer0))
        return transfer

    def _issue(self, job: CopyJob, stream: int, to_gpu: bool) -> CudaTransfer:
        self._current.job = job
        start = time.perf_counter()
        transfer = super()._issue(job, stream, to_gpu)
        self._current.issue = time.perf_counter() - start
        return transfer

    def _layer_copier(self, job: CopyJob, stream: int, to_gpu: bool) -> Callable[[int], None]:
        start = time.perf_counter()
        copy_layer = super()._layer_copier(job, stream, to_gpu)
        current = self._current
        current.setup = time.perf_counter() - start

        def timed(layer: int) -> None:
            began = time.perf_counter()
            try:
                copy_layer(layer)
            finally:
                ended = time.perf_counter()
                current.calls += ended - began
                if layer == 0:
                    current.layer0 = ended - current.start

        return timed


def placement_runs(placements: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    """Runs of each (GPU pages, host blocks) placement, paired up to the shorter list (a user's GPU pages also hold
    the tokens its batch appends, which its host copy does not have yet)."""
    out = []
    for gpu, host in placements:
        n = min(len(gpu), len(host))
        out.append(plan_runs(gpu[:n], host[:n]).num_runs if n else 0)
    return out


def histogram(values: Iterable[int], bins: tuple[int, ...] = RUN_BINS) -> dict[str, int]:
    """Counts of `values` per bin "<=b" (and ">last"), empty bins included."""
    counts = Counter(next((f"<={b}" for b in bins if v <= b), f">{bins[-1]}") for v in values)
    return {label: counts.get(label, 0) for label in [*(f"<={b}" for b in bins), f">{bins[-1]}"]}


def summarize_issue(records: list[IssueRecord]) -> dict:
    """Per direction: transfers, the paths taken, pages and runs per transfer (mean), host ms per transfer (median,
    mean, sum) of each IssueRecord time, and the histogram of runs per transfer."""
    out = {}
    for name, to_gpu in (("onboard", True), ("offload", False)):
        rows = [r for r in records if r.to_gpu is to_gpu]
        if not rows:
            continue
        out[name] = {"transfers": len(rows), "paths": dict(Counter(r.path for r in rows)),
                     "pages": statistics.fmean(r.pages for r in rows), "runs": statistics.fmean(r.runs for r in rows),
                     "runs_histogram": histogram(r.runs for r in rows)}
        for field in ("total", "issue", "setup", "calls", "layer0"):
            seconds = [getattr(r, f"{field}_s") for r in rows]
            out[name][f"{field}_ms"] = {"median": statistics.median(seconds) * 1e3,
                                        "mean": statistics.fmean(seconds) * 1e3, "sum": sum(seconds) * 1e3}
    return out
