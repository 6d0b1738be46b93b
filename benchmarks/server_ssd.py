"""Transfer server and SSD tier bandwidth, as ratios measured in one run.

1. server / in-process: onboarding one user's KV (all layers, layerwise signals) through the transfer
   server (another process, eventfds handed over) against the same copy engine called in-process.
2. SSD hit / disk: an ssd_hit onboarding through the server (SSD -> host in groups, each handed to the
   copy engine as it lands -> GPU; or -> the client's shared-memory pool on CPU) against a dd-like
   sequential read (O_DIRECT when the filesystem allows it) of a file of the same size in the same dir.

    PYTHONPATH=. python3 benchmarks/server_ssd.py --out $OUT/server-ssd-h200.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time

import torch

from layerflow.bench.environment import results_header
from layerflow.config import SignalMode, Config
from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.server import TransferClient, shared_cpu_pool, spawn_server
from layerflow.server.server import make_engine
from layerflow.transfer.signals import make_signals
from layerflow.tier.ssd import odirect_supported


def gpu_pool(layout: KVLayout, num_pages: int, cuda: bool):
    """(kv layers, shared memory or None): a CUDA pool, or on CPU a pool the server can map."""
    if cuda:
        return GpuKVPool(layout, num_pages, device="cuda").kv, None
    shm, layers = shared_cpu_pool(layout, num_pages)
    return layers, shm


def same_bytes(kv: list[torch.Tensor], a: list[int], b: list[int]) -> bool:
    """Pages `a` hold the same bytes as pages `b` in every layer (bytes: random bits include NaNs)."""
    return all(torch.equal(t[a].view(torch.uint8), t[b].view(torch.uint8)) for t in kv)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def in_process(layout, kv, user_blocks: int, reps: int, cuda: bool) -> list[float]:
    """Seconds per onboarding of `user_blocks` blocks with the engine and eventfd ring in this process."""
    host = HostKVPool(layout, num_blocks=user_blocks)
    for t in host.blocks:
        t.view(torch.uint8).random_()
    engine = make_engine(kv[0].device.index if kv[0].is_cuda else None)
    signals = make_signals(SignalMode.EVENTFD, layout.num_layers, 4, 60.0)
    blocks, pages = list(range(user_blocks)), list(range(user_blocks))
    times = []
    for _ in range(reps + 1):
        sync(cuda)
        t0 = time.perf_counter()
        handle = signals.acquire()
        transfers = [engine.onboard(kv, host.blocks[0], pages, blocks, handle)]
        handle.wait()
        times.append(time.perf_counter() - t0)
        for t in transfers:
            t.wait()
        handle.release()
    engine.close()
    signals.close()
    return times[1:]


def through_server(client, user, pages, reps: int) -> list[float]:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        handle = client.onboard(user, pages)
        handle.wait(60)
        times.append(time.perf_counter() - t0)
        handle.release()
    return times[1:]


def disk_read_gbps(directory: str, nbytes: int, chunk: int = 8 << 20) -> tuple[float, bool]:
    """dd-like: write `nbytes`, drop it from the page cache, read it back sequentially; (GB/s, O_DIRECT?)."""
    path = os.path.join(directory, "seqread.bin")
    direct = odirect_supported(directory)
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(nbytes // chunk):
        os.write(fd, buf)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    t0 = time.perf_counter()
    total = 0
    while (n := os.readv(fd, [buf])) > 0:
        total += n
    dt = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return total / dt / 1e9, direct


def ssd_hits(layout, kv, shm, user_blocks: int, reps: int, ssd_dir: str) -> tuple[list[float], bool]:
    """Seconds per ssd_hit onboarding through a server whose host holds two users."""
    page_bytes = layout.page_bytes
    config = Config(cpu_cache_gb=(2 * user_blocks + 0.5) * page_bytes / 2**30,
                            ssd_cache_gb=(4 * user_blocks + 1) * page_bytes / 2**30, ssd_cache_dir=ssd_dir)
    server = spawn_server(config)
    client = TransferClient(server.socket_path, server.token_path, layout, kv, shm=shm)
    src, dst = list(range(user_blocks)), list(range(user_blocks, 2 * user_blocks))
    try:
        client.offload("A", user_blocks * layout.page_size, src).result(120)
        client.offload("B", user_blocks * layout.page_size, src).result(120)
        times = []
        for _ in range(reps):
            client.offload("F", user_blocks * layout.page_size, src).result(120)  # evicts the LRU of A/B to SSD
            client.drop("F")  # room on the host, so the read below evicts nothing
            user = "A" if client.lookup("A")[0] == "ssd" else "B"
            assert client.lookup(user)[0] == "ssd"
            t0 = time.perf_counter()
            handle = client.onboard(user, dst)
            handle.wait(120)
            times.append(time.perf_counter() - t0)
            handle.release()
            assert same_bytes(kv, dst, src), "ssd_hit onboarding is not byte-exact"
        return times, True
    finally:
        client.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--tokens", type=int, default=16384 if cuda else 2048, help="tokens of one user")
    parser.add_argument("--reps", type=int, default=10 if cuda else 3)
    parser.add_argument("--ssd-reps", type=int, default=4 if cuda else 2)
    parser.add_argument("--ssd-dir", default=None, help="directory on the disk to test (default: a temp dir)")
    args = parser.parse_args(argv)

    layout = KVLayout((LayerGroup(8, 4, 256, torch.bfloat16),), 32)  # the benchmark model (design.md)
    user_blocks = layout.pages_for_tokens(args.tokens)
    nbytes = user_blocks * layout.page_bytes
    kv, shm = gpu_pool(layout, 2 * user_blocks, cuda)
    for t in kv:
        t.view(torch.uint8).random_()
    sync(cuda)

    local = in_process(layout, kv, user_blocks, args.reps, cuda)
    server = spawn_server(Config(cpu_cache_gb=(user_blocks + 0.5) * layout.page_bytes / 2**30))
    client = TransferClient(server.socket_path, server.token_path, layout, kv, shm=shm)
    try:
        client.offload("user", user_blocks * layout.page_size, list(range(user_blocks))).result(120)
        remote = through_server(client, "user", list(range(user_blocks, 2 * user_blocks)), args.reps)
        exact = same_bytes(kv, list(range(user_blocks, 2 * user_blocks)), list(range(user_blocks)))
    finally:
        client.close()
        server.stop()

    ssd_dir = tempfile.mkdtemp(prefix="layerflow-ssd-bench-", dir=args.ssd_dir)
    disk_gbps, disk_direct = disk_read_gbps(ssd_dir, nbytes)
    ssd_times, _ = ssd_hits(layout, kv, shm, user_blocks, args.ssd_reps, ssd_dir)

    def gbps(times: list[float]) -> float:
        return nbytes / statistics.median(times) / 1e9

    result = {
        **results_header(torch.device("cuda" if cuda else "cpu")),
        "benchmark": "server_ssd",
        "layout": {"layers": 8, "heads": 4, "head_dim": 256, "dtype": "bfloat16", "page_size": 32},
        "user_tokens": args.tokens,
        "user_bytes": nbytes,
        "server_onboard": {
            "in_process_gbps": gbps(local),
            "server_gbps": gbps(remote),
            "ratio": gbps(remote) / gbps(local),
            "in_process_ms": [t * 1e3 for t in local],
            "server_ms": [t * 1e3 for t in remote],
            "byte_exact": exact,
        },
        "ssd_hit": {
            "target": "gpu" if cuda else "host (client shared-memory pool)",
            "ssd_hit_gbps": gbps(ssd_times),
            "disk_seq_read_gbps": disk_gbps,
            "ratio": gbps(ssd_times) / disk_gbps,
            "ssd_hit_ms": [t * 1e3 for t in ssd_times],
            "odirect": disk_direct,
            "pipelining": "SSD reads in groups of 16 blocks on 4 I/O threads; each group handed to the copy "
                          "engine as it lands; layer signals after the last group",
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
