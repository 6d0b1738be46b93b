"""One CUDA graph per (shape bucket, wait variant), captured once and replayed for every batch that fits.

Lengths, offsets and page tables live in the bucket's device buffers, so a replay serves any lengths up to the bucket
with no recapture. Graphs share one memory pool: they never run at the same time.
"""

from __future__ import annotations

import gc

import torch

from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.pipeline import LayerPipeline
from layerflow.runtime.waits import LayerWait, NoWait


class GraphRunner:
    def __init__(self, pipeline: LayerPipeline, device: torch.device):
        self.pipeline, self.device = pipeline, device
        self._graphs: dict[tuple[Bucket, type], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def captured(self, bufs: BatchBuffers, wait: LayerWait) -> bool:
        return (bufs.bucket, type(wait)) in self._graphs

    def capture(self, bufs: BatchBuffers, wait: LayerWait) -> None:
        """Capture the pipeline for `bufs`' bucket with `wait`'s nodes; `bufs` must hold an empty batch."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.pipeline.forward(bufs, NoWait())  # compile and autotune outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's own threads (signal notifiers, copy and serving threads) keep querying and
        # synchronizing events while a graph is captured; in the default global mode any of those calls, from any
        # thread of the process, invalidates the capture. No garbage collection inside it either (torch collects
        # just before): a collection there runs destructors on this thread, e.g. an old graph's reset, which is not
        # permitted while a stream captures and invalidates the capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self.pipeline.forward(bufs, wait)
        finally:
            if collecting:
                gc.enable()
        self._graphs[(bufs.bucket, type(wait))] = graph

    def release(self) -> None:
        """Destroy the graphs now (the engine closes), not whenever a collection finds them."""
        self._graphs.clear()

    def replay(self, bufs: BatchBuffers, wait: LayerWait) -> None:
        self._graphs[(bufs.bucket, type(wait))].replay()
