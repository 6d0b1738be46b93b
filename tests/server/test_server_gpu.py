"""GPU: two client processes share one transfer server, on one GPU or on two; onboarding is byte-exact and signalled
layer by layer."""

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layerflow.config import Config
from layerflow.tier.layout import KVLayout, LayerGroup

LAYOUT = KVLayout((LayerGroup(6, 2, 64, torch.bfloat16), LayerGroup(2, 1, 128, torch.float16)), 16)
NUM_PAGES = 96
ROOT = Path(__file__).resolve().parents[2]


def pool_data(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_PAGES, *LAYOUT.gpu_page_shape(gi)), generator=g).to(LAYOUT.groups[gi].dtype)
            for gi, _ in LAYOUT.layer_map]


def user_pages(rank: int) -> list[int]:
    """Scattered source pages (fragmented runs), different per rank."""
    return [p for p in range(rank, 64, 2)][:24]


def client_main(rank: int, socket_path: str, token_path: str, device: int = 0) -> None:
    """One inference process on GPU `device`: offload its own user, then onboard both users into other pages and
    check them."""
    from layerflow.tier.gpu_pool import GpuKVPool
    from layerflow.server import TransferClient

    pool = GpuKVPool(LAYOUT, NUM_PAGES, device=f"cuda:{device}")
    for dst, src in zip(pool.kv, pool_data(rank)):
        dst.copy_(src)
    client = TransferClient(socket_path, token_path, LAYOUT, pool.kv, rank=rank, num_counters=2)
    pages = user_pages(rank)
    client.offload(f"user{rank}", len(pages) * LAYOUT.page_size, pages).result(30)
    other = 1 - rank
    deadline = time.monotonic() + 60
    while client.lookup(f"user{other}")[0] == "none":
        if time.monotonic() > deadline:
            raise TimeoutError(f"user{other} never reached the server")
        time.sleep(0.01)
    report = {"rank": rank, "checks": []}
    for owner, layerwise in ((other, True), (rank, True), (other, False)):
        expected = pool_data(owner)
        dst = list(range(64, 64 + len(user_pages(owner))))
        for t in pool.kv:
            t[dst] = 0
        torch.cuda.synchronize(device)
        handle = client.onboard(f"user{owner}", dst, layerwise=layerwise)
        order = []
        for layer in range(LAYOUT.num_layers):
            handle.wait_layer(layer, 30)
            seen = [j for j in range(LAYOUT.num_layers)
                    if select.select([client.signals.eventfd(handle, j)], [], [], 0)[0]]
            assert seen[:layer + 1] == list(range(layer + 1)), f"layer {layer} signalled before {seen}"
            got = pool.kv[layer][dst].cpu()
            assert torch.equal(got, expected[layer][user_pages(owner)]), f"layer {layer} of user{owner} differs"
            order.append(layer)
        handle.release()
        report["checks"].append({"owner": owner, "layerwise": layerwise, "order": order})
    client.close()
    print(json.dumps(report), flush=True)


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [
    pytest.param((0, 0), id="one_gpu"),
    pytest.param((0, 1), id="two_gpus", marks=pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")),
])
def test_two_client_processes_onboard_byte_exact_in_layer_order(tmp_path, devices):
    """The server opens each pool's IPC handles on its own GPU and copies with that GPU's streams and events."""
    from layerflow.server import spawn_server

    server = spawn_server(Config(cpu_cache_gb=0.25), tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-c",
             f"from tests.server.test_server_gpu import client_main; client_main({rank}, {str(server.socket_path)!r}, "
             f"{str(server.token_path)!r}, {devices[rank]})"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        server.stop()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert [c["order"] for c in report["checks"]] == [list(range(LAYOUT.num_layers))] * 3
