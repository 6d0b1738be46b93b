"""Two GPUs of one host sharing one transfer server: onboarding bandwidth of both GPUs at once against each alone,
and a CPU hit + layerwise request's latency on each GPU, alone and while the other GPU onboards without pause.

One worker process per GPU (CUDA_VISIBLE_DEVICES pins it, as one engine process per GPU runs in production), each
with a raw transfer client (the bandwidth) and an engine (the latency) on one server; the main process sends them
commands over their stdin and reads one JSON line back per command.

    PYTHONPATH=. python3 benchmarks/two_gpus.py --out $OUT/two-gpus-h200.json

With one GPU both workers share it and the JSON says `"gpus": 1`: a run of the script, not the two-GPU figure.
On a CPU machine (`--cpu`) the workers use shared-memory pools and the CPU engine: a smoke test, no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from layerflow.bench.environment import results_header
from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.server import TransferClient, shared_cpu_pool, spawn_server
from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.tier.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]


class Worker:
    """The commands of one worker process: `onboard reps`, `load_start`, `load_stop`, `latency reps`, `quit`."""

    def __init__(self, socket_path: str, preset: str, tokens: int, device: str) -> None:
        self.device = torch.device(device)
        self.weights = HSTUWeights.init(PRESETS[preset], seed=0)
        self.config = Config(server_socket=socket_path, enable_layerwise=True, transfer_timeout_s=60.0)
        self.layout = KVLayout.for_hstu(self.weights.config, self.config.page_size)
        self.tokens = tokens
        self.blocks = self.layout.pages_for_tokens(tokens)
        if self.device.type == "cuda":
            self.shm, self.kv = None, GpuKVPool(self.layout, 2 * self.blocks, device=self.device).kv
        else:
            self.shm, self.kv = shared_cpu_pool(self.layout, 2 * self.blocks)
        for t in self.kv:
            t.view(torch.uint8).random_()
        self.client = TransferClient.from_config(self.config, self.layout, self.kv, shm=self.shm)
        self.user = f"bandwidth-{os.getpid()}"
        self.client.offload(self.user, tokens, list(range(self.blocks))).result(120)
        self._loading = threading.Event()
        self._load_thread: threading.Thread | None = None
        self._load_count = 0
        self.engine = None

    def onboard(self, reps: int) -> dict:
        """Seconds per onboarding of the whole user (all layers, layerwise signals) into the pool's second half."""
        times = [self._onboard_once() for _ in range(reps)]
        return {"seconds": times, "bytes": self.blocks * self.layout.page_bytes}

    def _onboard_once(self) -> float:
        t0 = time.perf_counter()
        handle = self.client.onboard(self.user, list(range(self.blocks, 2 * self.blocks)))
        handle.wait(120)
        elapsed = time.perf_counter() - t0
        handle.release()
        return elapsed

    def load_start(self) -> dict:
        self._loading.set()
        self._load_count = 0

        def run() -> None:
            while self._loading.is_set():
                self._onboard_once()
                self._load_count += 1

        self._load_thread = threading.Thread(target=run, daemon=True)
        self._load_thread.start()
        return {}

    def load_stop(self) -> dict:
        self._loading.clear()
        self._load_thread.join()
        return {"onboardings": self._load_count}

    def latency(self, reps: int) -> dict:
        """Milliseconds of a return visit whose user the server holds (a CPU hit, onboarded layer by layer)."""
        from layerflow.runtime.engine import Engine
        from layerflow.runtime.request import Request

        if self.engine is None:
            self.engine = Engine(self.weights, self.config, device=self.device)
            self.engine.warmup()
        user = 1 + os.getpid() % 10**6 * 1000
        vocab = self.weights.config.item_vocab_size
        self.engine.score([Request(user, [i % vocab for i in range(self.tokens)], [])])
        times = []
        for rep in range(reps + 1):
            self.engine.kv.wait_offloads()
            self.engine.kv.evict_from_gpu(user)
            request = Request(user, [rep % vocab] * 64, list(range(256)))
            t0 = time.perf_counter()
            self.engine.score([request])
            times.append(time.perf_counter() - t0)
        return {"ms": [t * 1e3 for t in times[1:]]}


def worker_main(socket_path: str, preset: str, tokens: int, device: str) -> None:
    worker = Worker(socket_path, preset, tokens, device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        reply = getattr(worker, command)(*map(int, args))
        print(json.dumps(reply), flush=True)
    worker.client.close()
    if worker.engine is not None:
        worker.engine.close()


class Handle:
    """The main process's end of one worker."""

    def __init__(self, gpu: int | None, socket_path: str, args) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        device = "cpu" if gpu is None else "cuda"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", socket_path, "--preset", args.preset, "--tokens",
             str(args.tokens), "--device", device],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, command: str) -> dict:
        self.send(command)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            self.proc.wait(60)


def gbps(reply: dict) -> float:
    return reply["bytes"] / statistics.median(reply["seconds"]) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--preset", default="hstu-bench")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each GPU's user")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="smoke test on a CPU machine (no figures)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.preset, args.tokens, args.device)
        return 0

    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus == 0:
        parser.error("no GPU: run with --cpu for a smoke test")
    layout = KVLayout.for_hstu(PRESETS[args.preset], Config().page_size)
    user_bytes = layout.pages_for_tokens(args.tokens) * layout.page_bytes
    server = spawn_server(Config(cpu_cache_gb=(2 * user_bytes * 2 + 2**26) / 2**30))
    ranks = [None, None] if args.cpu else [0, 1 % gpus]
    workers = []
    try:
        workers = [Handle(gpu, str(server.socket_path), args) for gpu in ranks]
        alone = [w.call(f"onboard {args.reps}") for w in workers]
        for w in workers:
            w.send(f"onboard {args.reps}")
        together = [w.read() for w in workers]
        latency_alone = [w.call(f"latency {args.reps}") for w in workers]
        latency_loaded = []
        for i, w in enumerate(workers):
            other = workers[1 - i]
            other.call("load_start")
            latency_loaded.append(w.call(f"latency {args.reps}"))
            latency_loaded[-1]["other_onboardings"] = other.call("load_stop")["onboardings"]
    finally:
        for w in workers:
            w.close()
        server.stop()

    result = {
        **results_header(torch.device("cpu" if args.cpu else "cuda")),
        "benchmark": "two_gpus",
        "gpus": gpus,
        "workers_on": ranks,
        "preset": args.preset,
        "user_tokens": args.tokens,
        "user_bytes": user_bytes,
        "onboard_gbps": {
            "alone": [gbps(r) for r in alone],
            "together": [gbps(r) for r in together],
            "together_sum": sum(gbps(r) for r in together),
        },
        "cpu_hit_layerwise_ms": {
            "alone_median": [statistics.median(r["ms"]) for r in latency_alone],
            "other_gpu_onboarding_median": [statistics.median(r["ms"]) for r in latency_loaded],
            "other_gpu_onboardings_meanwhile": [r["other_onboardings"] for r in latency_loaded],
        },
        "raw": {"alone": alone, "together": together, "latency_alone": latency_alone,
                "latency_loaded": latency_loaded},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
