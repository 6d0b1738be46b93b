"""Capture a step into a CUDA graph the way the runtime does: one warm-up run on a side stream, then the capture."""

from __future__ import annotations

from typing import Callable

import torch


def captured(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_on(graph: torch.cuda.CUDAGraph, static, fresh, out: torch.Tensor) -> None:
    """Replay `graph`, captured on the PagedBatch `static`, on the inputs of `fresh` (copied into `static`'s tensors),
    with `out` zeroed first; returns once the replay is done."""
    for name in ("q", "k", "v", "kv_cache", "page_table", "q_offsets", "history_lens", "appended_lens"):
        getattr(static, name).copy_(getattr(fresh, name))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
