"""Two engine processes (one per GPU on a GPU host) share one transfer server: a user computed by engine A is adopted
by engine B from the shared host pool, onboarded layer by layer onto B's own device and scored exactly as A scores
it; then both serve their own users at the same time, each against a full recompute."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.server import spawn_server

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16
HISTORY = 300
SHARED = [1, 2, 3]          # computed by A, adopted by B
TWIN = 100                  # A's twin of a shared user: the same history, scored by A
OWN = {"a": 1000, "b": 2000}  # first user id of each engine's own users in the concurrent phase
MODELS = {
    "cpu": HSTUConfig(num_layers=3, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                      dtype=torch.float32, item_vocab_size=500, position_table_size=1024),
    "cuda": HSTUConfig(num_layers=3, num_heads=2, dqk=64, dv=64, embedding_dim=128, max_seq_len=1024,
                       dtype=torch.float32, item_vocab_size=500, position_table_size=1024),
}
TOLERANCE = {"cpu": 1e-5, "cuda": 2e-2}


def visit_items(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def wait_for(path: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def engine_main(role: str, socket_path: str, kind: str, out: str) -> None:
    """One engine process: `a` computes the shared users (and their twins), `b` adopts them; then each serves its own
    users (first visit, evicted to the server, return visit onboarded from it) while the other does the same."""
    from layerflow.model import full_forward
    from layerflow.runtime.engine import Engine
    from layerflow.runtime.request import Request

    out_dir = Path(out)
    model = MODELS[kind]
    weights = HSTUWeights.init(model, seed=3)
    block = weights.config.num_layers * 2 * PAGE * model.num_heads * model.dqk * 4
    config = Config(server_socket=socket_path, page_size=PAGE, enable_layerwise=True, transfer_timeout_s=30.0,
                    gpu_cache_gb=200 * block / 2**30)
    report: dict = {"role": role, "tiers": {}}
    with Engine(weights, config, device=kind, batch_buckets=(1, 4), token_buckets=(64, 512)) as engine:
        engine.warmup()
        returns = [Request(u, visit_items(50 + u, 5), visit_items(90 + u, 6)) for u in SHARED]
        if role == "a":
            for u in SHARED:
                for user in (u, TWIN + u):
                    engine.score([Request(user, visit_items(u, HISTORY), [])])
            engine.kv.wait_offloads()
            twins = [Request(TWIN + r.user_id, r.items, r.candidates) for r in returns]
            scores = engine.score(twins)
            (out_dir / "a_offloaded").write_text("")
        else:
            wait_for(out_dir / "a_offloaded")
            report["tiers"] = {str(u): engine.kv.tier(u).value for u in SHARED}
            scores = engine.score(returns)
        torch.save([s.cpu() for s in scores], out_dir / f"{role}_shared.pt")

        first = OWN[role]
        own = {first + i: visit_items(first + i, HISTORY - 10 * i) for i in range(4)}
        for u, history in own.items():
            engine.score([Request(u, history, [])])
        engine.kv.wait_offloads()
        for u in own:
            engine.kv.evict_from_gpu(u)
        report["own_tiers"] = [engine.kv.tier(u).value for u in own]
        batch = [Request(u, visit_items(7 * u, 4), visit_items(11 * u, 5)) for u in own]
        worst = 0.0
        for r, got in zip(batch, engine.score(batch)):
            ref = full_forward(engine.weights, [own[r.user_id] + r.items], [r.candidates]).scores
            worst = max(worst, (got.cpu().float() - ref.cpu().float()).abs().max().item())
        report["own_worst_error"] = worst
    print(json.dumps(report), flush=True)


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("kind, devices", [
    pytest.param("cpu", (None, None), id="cpu"),
    pytest.param("cuda", (0, 0), id="one_gpu", marks=pytest.mark.gpu),
    pytest.param("cuda", (0, 1), id="two_gpus",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")]),
])
def test_a_user_computed_by_one_engine_is_adopted_and_scored_alike_by_another(tmp_path, kind, devices):
    server = spawn_server(Config(cpu_cache_gb=0.1, page_size=PAGE), tmp_path / "run")
    procs = []
    try:
        for role, device in zip("ab", devices):
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(device)   # each engine process sees its own GPU as cuda:0
            procs.append(subprocess.Popen(
                [sys.executable, "-c", f"from tests.server.test_two_engines import engine_main; engine_main("
                 f"{role!r}, {str(server.socket_path)!r}, {kind!r}, {str(tmp_path)!r})"],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    reports = {}
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
        report = json.loads(out.strip().splitlines()[-1])
        reports[report["role"]] = report
    assert reports["b"]["tiers"] == {str(u): "host" for u in SHARED}   # adopted: held by the server, not recomputed
    a, b = torch.load(tmp_path / "a_shared.pt"), torch.load(tmp_path / "b_shared.pt")
    for twin_scores, adopted_scores in zip(a, b):
        assert torch.equal(twin_scores, adopted_scores)
    for report in reports.values():
        assert report["own_tiers"] == ["host"] * 4
        assert report["own_worst_error"] <= TOLERANCE[kind]
