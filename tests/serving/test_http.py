"""The HTTP server on a free localhost port with a real aiohttp client: concurrent clients get the sequential scores,
bad requests 400 naming the field, a full queue 503 at once, a missed deadline 504, a failed transfer 502 for that
request alone while the server keeps serving, and the metrics say what happened."""

import asyncio
import contextlib

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from layerflow.runtime.request import Request
from layerflow.serving.async_engine import AsyncEngine
from layerflow.serving.server import BackgroundServer
from tests.faults import FaultyThreadCopyEngine
from tests.serving.helpers import MODEL, TOL, WAIT_S, HeldEngine, config, sequential_scores, visits, wait_until


@contextlib.contextmanager
def serving_stack(weights, **overrides):
    """(engine, async engine, server) with the engine's copies breakable through `engine.copies`."""
    copies = FaultyThreadCopyEngine()
    with HeldEngine(weights, config(**overrides), copy_engine=copies) as engine:
        engine.copies = copies
        serving = AsyncEngine(engine)
        with BackgroundServer(serving) as server:
            yield engine, serving, server


def body(r: Request, **extra) -> dict:
    return {"user_id": r.user_id, "items": r.items, "candidates": r.candidates, **extra}


async def post(session: aiohttp.ClientSession, url: str, payload) -> tuple[int, dict]:
    kwargs = {"data": payload} if isinstance(payload, (bytes, str)) else {"json": payload}
    async with session.post(f"{url}/v1/score", **kwargs) as response:
        return response.status, await response.json()


def metric_values(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_concurrent_http_clients_get_the_sequential_scores(weights):
    requests = visits(seed=4, users=list(range(8)), rounds=3)
    expected = sequential_scores(weights, requests)

    async def client(url: str, users: set[int]) -> dict[int, list[float]]:
        out = {}
        async with aiohttp.ClientSession() as session:
            for i, r in enumerate(requests):
                if r.user_id in users:
                    status, answer = await post(session, url, body(r))
                    assert status == 200, answer
                    out[i] = answer["scores"]
        return out

    async def all_clients(url: str) -> dict[int, list[float]]:
        parts = await asyncio.gather(*(client(url, {u, u + 4}) for u in range(4)))
        return {i: s for part in parts for i, s in part.items()}

    with serving_stack(weights, serve_max_batch_size=4) as (_, _, server):
        scores = asyncio.run(all_clients(server.url))
    assert sorted(scores) == list(range(len(requests)))
    for i, e in enumerate(expected):
        assert torch.allclose(torch.tensor(scores[i]), e, atol=TOL, rtol=TOL), i


BAD = [
    (b"{not json", "body"),
    ([1, 2], "body"),
    ({"items": [1], "candidates": [2]}, "user_id"),
    ({"user_id": "7", "items": [1], "candidates": [2]}, "user_id"),
    ({"user_id": True, "items": [1], "candidates": [2]}, "user_id"),
    ({"user_id": 7, "items": 3, "candidates": [2]}, "items"),
    ({"user_id": 7, "items": [1, MODEL.item_vocab_size], "candidates": [2]}, "items"),
    ({"user_id": 7, "items": [1], "candidates": [True]}, "candidates"),
    ({"user_id": 7, "items": [1], "candidates": [2], "deadline_ms": -5}, "deadline_ms"),
    ({"user_id": 7, "items": [1], "candidates": [2], "colour": "red"}, "colour"),
]


def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(weights):
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            for payload, field in BAD:
                status, answer = await post(session, url, payload)
                assert (status, answer["error"], answer["field"]) == (400, "bad_request", field), payload
                assert answer["message"].startswith(f"{field}:")
            long_history = {"user_id": 7, "items": [i % MODEL.item_vocab_size for i in range(1000)], "candidates": []}
            assert (await post(session, url, long_history))[0] == 200
            status, answer = await post(session, url, {"user_id": 7, "items": list(range(30)), "candidates": [1]})
            assert (status, answer["error"]) == (400, "bad_request")
            assert "exceeds max_seq_len" in answer["message"]
            status, answer = await post(session, url, {"user_id": 7, "items": [3], "candidates": [1, 2]})
            assert status == 200 and len(answer["scores"]) == 2 and answer["tier"] == "gpu"
            async with session.get(f"{url}/metrics") as response:
                values = metric_values(await response.text())
        assert values[("layerflow_request_errors_total", (("kind", "bad_request"),))] == len(BAD) + 1

    with serving_stack(weights) as (_, _, server):
        asyncio.run(check(server.url))


async def held_posts(engine: HeldEngine, serving: AsyncEngine, session, url: str, payloads: list) -> list:
    """Post `payloads` while a first request's launch is held, and return their tasks once all are queued."""
    engine.launch_gate.close()
    blocker = asyncio.create_task(post(session, url, {"user_id": 99, "items": [1], "candidates": [2]}))
    await asyncio.get_running_loop().run_in_executor(None, engine.launch_gate.entered.wait, WAIT_S)
    tasks = [asyncio.create_task(post(session, url, p)) for p in payloads]
    await asyncio.get_running_loop().run_in_executor(
        None, wait_until, lambda: len(serving.queue) == len(payloads), "every request queued")
    return [blocker, *tasks]


def test_a_full_queue_answers_503_at_once_and_the_queued_requests_are_served(weights):
    async def check(engine, serving, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            queued = [{"user_id": u, "items": [1, 2], "candidates": [3]} for u in (1, 2)]
            tasks = await held_posts(engine, serving, session, url, queued)
            status, answer = await post(session, url, {"user_id": 3, "items": [1], "candidates": [2]})
            assert (status, answer["error"]) == (503, "queue_full")
            assert "serve_max_queue=2" in answer["message"]
            engine.launch_gate.open()
            assert [s for s, _ in await asyncio.gather(*tasks)] == [200, 200, 200]

    with serving_stack(weights, serve_max_queue=2) as (engine, serving, server):
        asyncio.run(check(engine, serving, server.url))


def test_a_deadline_passed_in_the_queue_answers_504(weights):
    async def check(engine, serving, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            late = {"user_id": 1, "items": [1], "candidates": [2], "deadline_ms": 50}
            tasks = await held_posts(engine, serving, session, url, [late, {"user_id": 2, "items": [1],
                                                                           "candidates": [2]}])
            await asyncio.sleep(0.06)
            engine.launch_gate.open()
            (s0, _), (s1, a1), (s2, _) = await asyncio.gather(*tasks)
            assert (s0, s1, a1["error"], s2) == (200, 504, "deadline", 200)

    with serving_stack(weights) as (engine, serving, server):
        asyncio.run(check(engine, serving, server.url))


def test_a_failed_transfer_answers_502_for_that_request_alone_and_the_server_keeps_serving(weights):
    async def check(engine, serving, url: str) -> None:
        async with aiohttp.ClientSession() as session:
            for u in (1, 2, 3):
                assert (await post(session, url, {"user_id": u, "items": list(range(40)), "candidates": []}))[0] == 200
            engine.kv.evict_from_gpu(1)     # the scheduler is idle: every request so far was answered
            engine.copies.fail_at_layer = 1
            tasks = await held_posts(engine, serving, session, url,
                                     [{"user_id": u, "items": [u], "candidates": [5]} for u in (1, 2, 3)])
            engine.launch_gate.open()
            (_, _), (s1, a1), (s2, a2), (s3, a3) = await asyncio.gather(*tasks)
            assert (s1, a1["error"]) == (502, "transfer") and "injected failure" in a1["message"]
            assert (s2, a2["tier"], s3, a3["tier"]) == (200, "gpu", 200, "gpu")
            engine.copies.fail_at_layer = None
            status, answer = await post(session, url, {"user_id": 1, "items": [7], "candidates": [5]})
            assert (status, answer["tier"]) == (200, "host")
            async with session.get(f"{url}/metrics") as response:
                values = metric_values(await response.text())
        assert values[("layerflow_request_errors_total", (("kind", "transfer"),))] == 1
        assert values[("layerflow_failed_batches_total", ())] == 1
        assert values[("layerflow_onboard_bytes_total", ())] > 0
        assert values[("layerflow_request_latency_seconds_count", (("tier", "host"),))] == 1

    with serving_stack(weights, serve_max_batch_size=3) as (engine, serving, server):
        asyncio.run(check(engine, serving, server.url))


def test_health_and_metrics_pages(weights):
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/healthz") as response:
                assert response.status == 200 and (await response.json())["status"] == "ok"
            for r in visits(seed=5, users=[1, 2], rounds=2):
                assert (await post(session, url, body(r)))[0] == 200
            async with session.get(f"{url}/metrics") as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                values = metric_values(await response.text())
        assert values[("layerflow_request_latency_seconds_count", (("tier", "none"),))] == 2
        assert values[("layerflow_request_latency_seconds_count", (("tier", "gpu"),))] == 2
        assert values[("layerflow_batch_size_count", ())] >= 2
        assert values[("layerflow_queue_depth", ())] == 0
        assert values[("layerflow_gpu_pool_pages", (("state", "total"),))] == 200
        assert ("layerflow_host_pool_blocks", (("state", "used"),)) in values
        assert ("layerflow_gpu_evictions_total", ()) in values

    with serving_stack(weights) as (_, _, server):
        asyncio.run(check(server.url))


def test_a_stopped_server_refuses_connections(weights):
    with serving_stack(weights) as (_, serving, server):
        url = server.url
    assert serving.closing

    async def check() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(session, url, {"user_id": 1, "items": [1], "candidates": [2]})

    asyncio.run(check())
