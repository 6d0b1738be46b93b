"""Remote-hit (Redis) fetch latency and bandwidth against a host hit, with Redis's own raw GET bandwidth for the same
bytes, measured in the same run as the bar.

Per user size (hstu-bench layout: 8 layers x 4 heads x 256, bf16, 32-token pages = 1 MiB blocks), on loopback:
- host hit: an onboarding of a host-resident user into the engine's pool (the copy engine only);
- remote hit: the same onboarding of a user found only in Redis (fetch, checksum, host blocks, copy engine);
- remote fetch: the store's read into host blocks alone (`RedisStore.load`: pipelined MGETs whose values are
  received straight into the host blocks and checksummed as they land);
- raw GET: the same block keys, values dropped: MGET with redis-py in the store's groups with as many in flight on as
  many connections, plain GETs one after another, and MGET over plain sockets (the store's groups, two in flight per
  connection, each value received into its own place of a buffer: Redis's delivery without a client library's copies); the
  fastest of the three is the bar (goal: fetch >= 0.8 of it).
The benchmark starts its own redis-server on a free port unless given --redis-url.

    PYTHONPATH=. python3 benchmarks/redis_tier.py --out benchmarks/results/redis-tier-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import redis
import torch

from layerflow.bench.environment import results_header
from layerflow.config import Config
from layerflow.model.config import PRESETS
from layerflow.runtime.tiers import build_kv
from layerflow.tier.base import Load, Tier
from layerflow.tier.copies import AllOf
from layerflow.tier.layout import KVLayout
from layerflow.tier.redis_reply import ReplyReader
from layerflow.tier.ssd import tensor_block_views

GiB = 2**30


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return server, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def onboard(tier, gpu, user: int, tokens: int, pages: list[int]) -> None:
    onboarding = tier.onboard([Load(user, tier.locate(user, tokens), tokens, tuple(pages))], layerwise=True)
    try:
        for layer in range(gpu.layout.num_layers):
            onboarding.handle.wait_layer(layer, 60)
    finally:
        onboarding.finish(wait=True)


def same_pages(gpu, a: list[int], b: list[int]) -> bool:
    return all(torch.equal(t[a].view(torch.uint8), t[b].view(torch.uint8)) for t in gpu.kv)


def raw_mget(url: str, keys: list[str], per: int, connections: int) -> float:
    """Seconds for the keys fetched as the store groups them, `connections + 1` groups in flight."""
    client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=connections + 1))
    groups = [keys[s:s + per] for s in range(0, len(keys), per)]
    with ThreadPoolExecutor(connections) as pool:
        seconds = timed(lambda: [len(v) for values in pool.map(client.mget, groups) for v in values])
    client.close()
    return seconds


class _Discard:
    """A digest that looks at nothing: the bar checksums no byte."""

    def update(self, data: memoryview, /) -> None:
        pass


def mget_command(keys: list[str]) -> bytes:
    parts = [b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1)]
    parts += [b"$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys]
    return b"".join(parts)


def raw_socket_mget(url: str, keys: list[str], per: int, connections: int, value_bytes: int) -> float:
    """Seconds for the keys fetched over plain sockets in the store's groups, `connections` in parallel with two
    MGETs in flight on each, every value received into its own place of a buffer allocated (and touched) before:
    the same bytes landed in memory, without a client library's copies and without a checksum."""
    where = urllib.parse.urlparse(url)
    groups = [keys[s:s + per] for s in range(0, len(keys), per)]
    socks = [socket.create_connection((where.hostname, where.port)) for _ in range(connections)]

    landing = [memoryview(bytearray(value_bytes * sum(map(len, groups[i::connections])))) for i in range(connections)]

    def run(i: int) -> None:
        sock, mine, at = socks[i], groups[i::connections], 0
        reader, discard = ReplyReader(sock), _Discard()
        for j, group in enumerate(mine):
            if j == 0:
                sock.sendall(mget_command(group))
            if j + 1 < len(mine):
                sock.sendall(mget_command(mine[j + 1]))
            for _ in range(reader.array()):
                reader.bulk_into([landing[i][at:at + value_bytes]], discard)
                at += value_bytes

    with ThreadPoolExecutor(connections) as pool:
        seconds = timed(lambda: list(pool.map(run, range(connections))))
    for sock in socks:
        sock.close()
    return seconds


def raw_get(url: str, keys: list[str]) -> float:
    client = redis.Redis.from_url(url)
    seconds = timed(lambda: [len(client.get(k)) for k in keys])
    client.close()
    return seconds


def measure(url: str, tokens_list: list[int], reps: int, connections: int) -> list[dict]:
    layout = KVLayout.for_hstu(PRESETS["hstu-bench"], 32)
    most = max(tokens_list) // layout.page_size
    config = Config(cpu_cache_gb=(most + 1) * layout.page_bytes / GiB, gpu_cache_gb=(2 * most + 1) * layout.page_bytes / GiB,
                    page_size=32, transfer_timeout_s=60.0, remote_url=url, remote_namespace="bench",
                    remote_timeout_s=30.0, remote_connections=connections)
    gpu, tier = build_kv(config, layout, torch.device("cpu"), model_key="bench")
    cache, store = tier.cache, tier.cache.remote
    views = tensor_block_views(cache.host.blocks)
    rows = []
    for user, tokens in enumerate(tokens_list):
        n = tokens // layout.page_size
        nbytes = n * layout.page_bytes
        source, target = list(range(n)), list(range(n, 2 * n))
        for t in gpu.kv:
            t[source].view(torch.uint8).random_()
        slot = cache.begin_offload(user, tokens, history=list(range(tokens)))
        AllOf(tier.copier.copy(source, slot.blocks[:n], to_gpu=False)).wait(60)
        write_s = timed(lambda: (cache.end_offload(user, ok=True), store.flush(600)))
        keys = [f"bench:{store.fingerprint}:{user}:{v}:{i}" for i, v in enumerate(store.lookup(user).block_versions())]
        per = store.blocks_per_mget
        times = {"host_hit": [], "remote_hit": [], "remote_fetch": [], "raw_mget": [], "raw_get": [], "raw_socket": []}
        for _ in range(reps):                                  # the fetch right after its bar, on the same machine load
            times["raw_mget"].append(raw_mget(url, keys, per, connections))
            times["raw_get"].append(raw_get(url, keys))
            times["raw_socket"].append(raw_socket_mget(url, keys, per, connections, layout.page_bytes))
            blocks = cache.host.pages(user)
            store.lookup(user)
            times["remote_fetch"].append(timed(lambda: store.load(user, views, blocks)))
            cache.evict(user)                                  # written through already: only the host copy goes
            assert tier.locate(user, tokens) is Tier.REMOTE
            times["remote_hit"].append(timed(lambda: onboard(tier, gpu, user, tokens, target)))
            assert same_pages(gpu, source, target)
            times["host_hit"].append(timed(lambda: onboard(tier, gpu, user, tokens, target)))
        median = {k: statistics.median(v) for k, v in times.items()}
        bars = [min(bar) for bar in zip(times["raw_mget"], times["raw_get"], times["raw_socket"])]

        def vs_bar(name: str) -> float:
            """The median over repetitions of (bar / time): each against the bar of its repetition."""
            return round(statistics.median(b / t for b, t in zip(bars, times[name])), 3)
        rows.append({
            "tokens": tokens, "bytes": nbytes, "write_s": write_s,
            **{f"{k}_ms": round(v * 1e3, 2) for k, v in median.items()},
            **{f"{k}_gbps": round(nbytes / v / 1e9, 3) for k, v in median.items()},
            "fetch_vs_raw_get": vs_bar("remote_fetch"),
            "remote_hit_vs_raw_get": vs_bar("remote_hit"),
            "remote_hit_vs_host_hit": round(median["remote_hit"] / median["host_hit"], 2),
        })
        print(json.dumps(rows[-1]))
        cache.drop(user)
        store.flush(600)
    tier.close()
    store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="an existing Redis (default: start one on a free port)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server, url = (None, args.redis_url) if args.redis_url else start_redis(directory)
        try:
            rows = measure(url, args.tokens, args.reps, args.connections)
        finally:
            if server is not None:
                server.terminate()
                server.wait()
    results = {**results_header("cpu"), "layout": "hstu-bench (8 layers, 4 heads x 256, bf16), 32-token pages",
               "redis": "redis-server on loopback" if args.redis_url is None else "given", "cpus": os.cpu_count(),
               "reps": args.reps,
               "connections": args.connections, "bar": "the fastest of raw MGET with redis-py (same groups and "
               "concurrency), raw sequential GET and raw MGET over plain sockets into a buffer of the same bytes, same keys", "goal": "fetch_vs_raw_get >= 0.8", "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
