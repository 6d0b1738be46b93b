"""`layerflow serve` as a real process: SIGTERM with requests in flight answers every one of them (scores, or a
clean 503 once draining began), then the process exits 0; `--help` names every flag."""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from layerflow.serving.cli import READY, add_arguments, serving_config
from tests.serving.helpers import WAIT_S

ROOT = Path(__file__).resolve().parents[2]


def start_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"cpu_cache_gb": 0.05, "gpu_cache_gb": 0.02, "page_size": 16,
                                      "serve_deadline_ms": 0.0}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "layerflow.cli", "serve", "--config", str(config), "--port", "0",
                             "--max-batch-size", "2", "--no-warmup"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith(READY):
        proc.kill()
        raise AssertionError(f"no ready line: {line!r}, stderr: {proc.stderr.read()}")
    return proc, line.split()[-1]


def test_sigterm_answers_every_request_in_flight_then_exits(tmp_path):
    proc, url = start_server(tmp_path)
    answered_after_signal = []

    async def one(session, user: int, signalled: asyncio.Event) -> int:
        payload = {"user_id": user, "items": [(user * 7 + i) % 1000 for i in range(300)], "candidates": [1, 2, 3]}
        async with session.post(f"{url}/v1/score", json=payload) as response:
            await response.json()
            answered_after_signal.append(signalled.is_set())
            return response.status

    async def burst() -> list[int]:
        signalled = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(one(session, u, signalled)) for u in range(64)]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=WAIT_S)
            assert done, "no answer before the signal"
            proc.send_signal(signal.SIGTERM)
            signalled.set()
            return list(await asyncio.gather(*tasks))

    try:
        statuses = asyncio.run(burst())
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert set(statuses) <= {200, 503} and 200 in statuses
    assert any(answered_after_signal)
    assert "drained and stopped" in out


def test_help_documents_every_serve_flag(capsys):
    parser = argparse.ArgumentParser(prog="layerflow serve")
    add_arguments(parser)
    parser.print_help()
    text = capsys.readouterr().out
    actions = [a for a in parser._actions if a.dest != "help"]
    assert len(actions) > 10
    for action in actions:
        assert action.help, action.dest
        assert all(opt in text for opt in action.option_strings), action.option_strings


def test_serving_flags_override_the_config_files_keys_and_reach_the_queue(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"serve_paced_batches": True, "serve_max_batch_size": 4}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    unpaced = serving_config(parser.parse_args(["--config", str(config), "--no-paced-batches"]))
    assert (unpaced.serve_paced_batches, unpaced.serve_max_batch_size) == (False, 4)
    assert serving_config(parser.parse_args(["--config", str(config)])).serve_paced_batches is True
