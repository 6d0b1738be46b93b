"""GIL test for the eventfd wait node: does a busy Python main thread delay a graph's host wait nodes?

A captured graph holds one host wait node per layer, each followed by a small kernel. A native notifier
(C, called through ctypes so it runs without the GIL) writes layer l's eventfd at a known CLOCK_MONOTONIC
time; the node stamps the same clock when it releases. Release latency = released_ns - written_ns, over
many replays, with the main thread (a) idle in stream synchronize and (b) spinning in pure Python.

Controls, to show what the test can see:
- the same graph with a Python host function (ctypes callback): it needs the GIL, so (b) stalls it;
- the native node with a Python notifier thread: the posts themselves wait for the GIL in (b).
Also the per-node cost of an already-signalled wait node (graph with N nodes vs graph with none).

    PYTHONPATH=. python3 benchmarks/hostnode_gil.py --out hostnode-gil-h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from layerflow.bench.environment import results_header
from layerflow.runtime import hostfn
from layerflow.transfer import cudart
from layerflow.runtime.hostfn import WaitSlots, WaitStatus, post_eventfds_at

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
TIMEOUT_MS = 5_000


def summary(values_ns: list[int]) -> dict:
    """Median, p90 and max in microseconds."""
    us = sorted(v / 1e3 for v in values_ns)
    return {
        "n": len(us),
        "median_us": statistics.median(us),
        "p90_us": us[min(len(us) - 1, int(0.9 * len(us)))],
        "max_us": us[-1],
    }


class NativeWaits:
    """The product's wait node: the C shim reading per-layer slots."""

    def __init__(self, layers: int) -> None:
        self.slots = WaitSlots(layers)
        self.fn = hostfn.eventfd_wait_address()

    def arm(self, fds: list[int]) -> None:
        for layer, fd in enumerate(fds):
            self.slots.set(layer, fd, TIMEOUT_MS)
        self.slots.reset()

    def user_data(self, layer: int) -> int:
        return self.slots.address(layer)

    def released(self, layer: int) -> int:
        if self.slots.status(layer) is not WaitStatus.OK:
            raise RuntimeError(f"layer {layer}: wait ended with {self.slots.status(layer).name}")
        return self.slots.released_ns(layer)


class PythonWaits:
    """Control: the same wait written as a Python host function (what the design forbids)."""

    def __init__(self, layers: int) -> None:
        self.fds = [-1] * layers
        self.stamps = [0] * layers
        self.callback = HOST_FN(self._wait)
        self.fn = ctypes.cast(self.callback, ctypes.c_void_p).value

    def _wait(self, layer: int | None) -> None:
        layer = layer or 0
        fd = self.fds[layer]
        if fd >= 0 and select.select([fd], [], [], TIMEOUT_MS / 1e3)[0]:
            os.eventfd_read(fd)
            self.stamps[layer] = time.monotonic_ns()

    def arm(self, fds: list[int]) -> None:
        self.fds[:] = fds
        self.stamps[:] = [0] * len(fds)

    def user_data(self, layer: int) -> int:
        return layer

    def released(self, layer: int) -> int:
        if self.stamps[layer] == 0:
            raise RuntimeError(f"layer {layer}: Python wait timed out")
        return self.stamps[layer]


def capture(waits: NativeWaits | PythonWaits | None, nodes: int, kernels: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `kernels` small kernels with a wait node before each of the first `nodes`; and its buffer."""
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(max(nodes, kernels)):
            if i < nodes:
                cudart.launch_host_func(stream, waits.fn, waits.user_data(i))
            if i < kernels:
                x.add_(1.0)
    return graph, x


def spin_until(event: torch.cuda.Event, until_ns: int) -> int:
    """Run pure Python bytecode until until_ns (no call that drops the GIL), then until the graph is done."""
    acc = 0
    while time.monotonic_ns() < until_ns:
        acc = (acc * 31 + 7) & 0xFFFF
    while not event.query():
        for i in range(200):
            acc = (acc * 31 + i) & 0xFFFF
    return acc


def native_notifier(fds: list[int], at_ns: list[int], written: list[int]) -> Callable[[], None]:
    def run() -> None:
        written[:] = post_eventfds_at(fds, at_ns)

    return run


def python_notifier(fds: list[int], at_ns: list[int], written: list[int]) -> Callable[[], None]:
    def run() -> None:
        for i, (fd, at) in enumerate(zip(fds, at_ns)):
            time.sleep(max(0.0, (at - time.monotonic_ns()) / 1e9))
            written[i] = time.monotonic_ns()
            os.eventfd_write(fd, 1)

    return run


def replay_once(graph, waits, layers: int, notifier, spin: bool, lead_ns: int, spacing_ns: int):
    """One replay with fresh eventfds posted on a schedule; returns (target, written, released) per layer."""
    fds = [os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK) for _ in range(layers)]
    try:
        waits.arm(fds)
        start = time.monotonic_ns() + lead_ns
        at_ns = [start + layer * spacing_ns for layer in range(layers)]
        written = [0] * layers
        entered = threading.Event()
        body = notifier(fds, at_ns, written)

        def run() -> None:
            entered.set()
            body()

        thread = threading.Thread(target=run)
        thread.start()
        entered.wait()
        done = torch.cuda.Event()
        graph.replay()
        done.record()
        if spin:
            spin_until(done, at_ns[-1] + spacing_ns)
        torch.cuda.current_stream().synchronize()
        thread.join()
        return at_ns, written, [waits.released(layer) for layer in range(layers)]
    finally:
        for fd in fds:
            os.close(fd)


def latency_run(waits, notifier, layers: int, replays: int, spin: bool, lead_ns: int, spacing_ns: int) -> dict:
    graph, _buffer = capture(waits, layers, layers)
    replay_once(graph, waits, layers, notifier, spin, lead_ns, spacing_ns)
    release, end_to_end = [], []
    for _ in range(replays):
        at_ns, written, released = replay_once(graph, waits, layers, notifier, spin, lead_ns, spacing_ns)
        release += [r - w for r, w in zip(released, written)]
        end_to_end += [r - a for r, a in zip(released, at_ns)]
    return {"release_latency": summary(release), "target_to_release": summary(end_to_end)}


def idle_vs_spin(make_waits, notifier, layers, replays, lead_ns, spacing_ns, key: str) -> dict:
    waits = make_waits(layers)
    idle = latency_run(waits, notifier, layers, replays, False, lead_ns, spacing_ns)
    spin = latency_run(waits, notifier, layers, replays, True, lead_ns, spacing_ns)
    return {
        "idle_main": idle,
        "spinning_main": spin,
        "median_ratio_spin_over_idle": spin[key]["median_us"] / idle[key]["median_us"],
        "p90_ratio_spin_over_idle": spin[key]["p90_us"] / idle[key]["p90_us"],
    }


def replay_time_us(captured: tuple[torch.cuda.CUDAGraph, torch.Tensor], replays: int) -> float:
    graph = captured[0]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e6


def node_cost(nodes: int, replays: int) -> dict:
    """Per-node cost of wait nodes that never wait: eventfds pre-signalled, and fd < 0 ("no wait")."""
    base = replay_time_us(capture(None, 0, nodes), replays)
    waits = NativeWaits(nodes)
    fds = [os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK) for _ in range(nodes)]
    try:
        for fd in fds:
            os.eventfd_write(fd, replays + 10)
        waits.arm(fds)
        signalled = replay_time_us(capture(waits, nodes, nodes), replays)
        waits.arm([-1] * nodes)
        no_wait = replay_time_us(capture(waits, nodes, nodes), replays)
    finally:
        for fd in fds:
            os.close(fd)
    return {
        "nodes": nodes,
        "kernels": nodes,
        "graph_without_nodes_us": base,
        "graph_with_signalled_nodes_us": signalled,
        "graph_with_no_wait_nodes_us": no_wait,
        "per_signalled_node_us": (signalled - base) / nodes,
        "per_no_wait_node_us": (no_wait - base) / nodes,
    }


def toolchain() -> dict:
    """What this test depends on beyond the common environment: the CUDA runtime the native node is built against,
    the compiler that built it, the CPUs and the interpreter's thread switch interval."""
    runtime = ctypes.c_int()
    lib = cudart.lib()
    lib.cudaRuntimeGetVersion(ctypes.byref(runtime))
    compiler = subprocess.run([hostfn.find_compiler(), "--version"], capture_output=True, text=True)
    return {
        "cudart_version": runtime.value,
        "libcudart": lib._name,
        "compiler": compiler.stdout.splitlines()[0] if compiler.stdout else "",
        "cpu_count": os.cpu_count(),
        "switch_interval_s": sys.getswitchinterval(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=60)
    parser.add_argument("--lead-us", type=int, default=3000, help="first post this long after the launch")
    parser.add_argument("--spacing-us", type=int, default=500, help="time between two layers' posts")
    parser.add_argument("--cost-replays", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hostnode_gil.py needs a CUDA GPU")
    lead, spacing = args.lead_us * 1000, args.spacing_us * 1000
    common = (args.layers, args.replays, lead, spacing)
    native = idle_vs_spin(NativeWaits, native_notifier, *common, key="release_latency")
    results = {
        **results_header(torch.device("cuda")),
        "benchmark": "hostnode_gil",
        **toolchain(),
        "layers": args.layers,
        "replays": args.replays,
        "lead_us": args.lead_us,
        "spacing_us": args.spacing_us,
        "native_hostfn": native,
        "gil_test_within_20pct": abs(native["median_ratio_spin_over_idle"] - 1.0) <= 0.2,
        "control_python_hostfn": idle_vs_spin(PythonWaits, native_notifier, *common, key="release_latency"),
        "native_hostfn_python_notifier": idle_vs_spin(
            NativeWaits, python_notifier, *common, key="target_to_release"
        ),
        "node_cost": node_cost(args.layers, args.cost_replays),
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
