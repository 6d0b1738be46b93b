"""Open-loop load for the serving benchmark: every request is sent at its arrival time, whatever the server's pace.

Two drivers over the same arrivals: `in_process` submits to the AsyncEngine from this thread; `over_http` posts from
one aiohttp client session (one event loop, up to HTTP_CONNECTIONS connections; a request beyond them waits for one
at the client) to a running server. Each
request becomes a `Record`; latency runs from the request's scheduled arrival to its answer at the client, so a
driver that falls behind its schedule is charged for it rather than hiding it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import aiohttp

from layerflow.runtime.request import Request
from layerflow.serving.async_engine import AsyncEngine
from layerflow.serving.errors import error_kind

TRANSPORTS = ("inprocess", "http")
HTTP_CONNECTIONS = 256   # client and server sockets of one process stay well inside the usual 1024 descriptors


@dataclass(frozen=True)
class Record:
    """One request of a run: scheduled arrival and answer (s from the run's start), and what the answer said."""

    arrival_s: float
    answered_s: float
    tier: str | None = None
    batch_size: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        return (self.answered_s - self.arrival_s) * 1e3


def in_process(engine: AsyncEngine, arrivals: Sequence[tuple[float, Request]]) -> list[Record]:
    """Submit each request at its arrival time; wait for every answer."""
    records: list[Record | None] = [None] * len(arrivals)
    answered = threading.Semaphore(0)
    start = time.perf_counter()

    def note(i: int, arrival: float, future: Future) -> None:
        now = time.perf_counter() - start
        error = future.exception()
        if error is not None:
            records[i] = Record(arrival, now, error=error_kind(error))
        else:
            s = future.result()
            records[i] = Record(arrival, now, s.tier.value, s.batch_size, s.cached_tokens)
        answered.release()

    for i, (arrival, request) in enumerate(arrivals):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            future = engine.submit(request)
        except Exception as e:  # noqa: BLE001 - a refusal is this request's answer
            records[i] = Record(arrival, time.perf_counter() - start, error=error_kind(e))
            answered.release()
            continue
        future.add_done_callback(lambda f, i=i, arrival=arrival: note(i, arrival, f))
    for _ in arrivals:
        answered.acquire()
    return records


def over_http(url: str, arrivals: Sequence[tuple[float, Request]]) -> list[Record]:
    """Post each request at its arrival time to `url`'s /v1/score; wait for every answer."""
    return asyncio.run(_over_http(url, arrivals))


async def _over_http(url: str, arrivals: Sequence[tuple[float, Request]]) -> list[Record]:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(session: aiohttp.ClientSession, arrival: float, request: Request) -> Record:
        body = {"user_id": request.user_id, "items": request.items, "candidates": request.candidates}
        try:
            async with session.post(f"{url}/v1/score", json=body) as response:
                answer = await response.json()
        except aiohttp.ClientError:
            return Record(arrival, loop.time() - start, error="connection")
        now = loop.time() - start
        if response.status != 200:
            return Record(arrival, now, error=answer.get("error", str(response.status)))
        return Record(arrival, now, answer["tier"], answer["batch_size"], answer["cached_tokens"])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=HTTP_CONNECTIONS)) as session:
        tasks = []
        for arrival, request in arrivals:
            delay = start + arrival - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, arrival, request)))
        return list(await asyncio.gather(*tasks))
