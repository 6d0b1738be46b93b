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
