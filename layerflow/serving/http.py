"""The HTTP routes of `layerflow serve` (aiohttp): score, health and metrics over one AsyncEngine.

- `POST /v1/score`: body as in layerflow.serving.validation; 200 with `scores` (in the order of the candidates),
  `tier` (gpu, host, ssd or none: where the user's KV came from), `latency_ms` (arrival to answer inside the server),
  `batch_size` and `cached_tokens`. Errors answer `{"error": kind, "message": ..., "field": ...}` with the status of
  their kind (STATUS): 400 for a bad field or request, 503 when the queue is full, the server is draining or the GPU
  cannot hold the request, 504 past the deadline, 502 when the request's KV transfer failed, 500 otherwise. A failure
  is that request's alone: the server keeps serving.
- `GET /healthz`: 200 while serving, 503 while draining.
- `GET /metrics`: Prometheus text of the server's own registry.
"""

from __future__ import annotations

import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from layerflow.serving.async_engine import AsyncEngine
from layerflow.serving.errors import BadField, error_kind
from layerflow.serving.validation import parse_score_request

STATUS: dict[str, int] = {"bad_request": 400, "queue_full": 503, "shutting_down": 503, "capacity": 503,
                          "deadline": 504, "transfer": 502, "internal": 500}

ENGINE_KEY = web.AppKey("async_engine", AsyncEngine)


def error_response(error: BaseException) -> web.Response:
    kind = error_kind(error)
    body = {"error": kind, "message": str(error)}
    if isinstance(error, BadField):
        body["field"] = error.field
    return web.json_response(body, status=STATUS[kind])


async def score(request: web.Request) -> web.Response:
    engine: AsyncEngine = request.app[ENGINE_KEY]
    try:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadField("body", f"not valid JSON ({e})") from None
        parsed, deadline_s = parse_score_request(body, engine.engine.weights.config)
    except BadField as e:
        engine.metrics.request_failed("bad_request")
        return error_response(e)
    try:
        scored = await engine.score(parsed, deadline_s)
    except Exception as e:  # noqa: BLE001 - counted by the engine; the answer names its kind
        return error_response(e)
    return web.json_response({"user_id": parsed.user_id, "scores": scored.scores.tolist(), "tier": scored.tier.value,
                              "latency_ms": scored.latency_ms, "batch_size": scored.batch_size,
                              "cached_tokens": scored.cached_tokens})


async def healthz(request: web.Request) -> web.Response:
    engine: AsyncEngine = request.app[ENGINE_KEY]
    if engine.closing:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok", "queue_depth": len(engine.queue)})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ENGINE_KEY].metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(engine: AsyncEngine) -> web.Application:
    app = web.Application()
    app[ENGINE_KEY] = engine
    app.add_routes([web.post("/v1/score", score), web.get("/healthz", healthz), web.get("/metrics", metrics)])
    return app
