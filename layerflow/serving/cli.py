"""`layerflow serve`: the HTTP scoring server, until SIGTERM or SIGINT, which drain it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from layerflow.config import Config, load_config
from layerflow.model.config import PRESETS
from layerflow.model.weights import HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.serving.async_engine import AsyncEngine
from layerflow.serving.server import ServingServer

DESCRIPTION = ("Serve candidate scores over HTTP: POST /v1/score {user_id, items, candidates[, deadline_ms]}, "
               "GET /healthz, GET /metrics (Prometheus). Requests are batched, each user's in arrival order; the "
               "next batch's KV is onboarded while the current one computes (unless --no-prefetch). SIGTERM/SIGINT "
               "drain the queue, finish the offloads and exit.")
READY = "layerflow serve: listening on"

# Flags that override a config key of the serving layer: flag dest -> config key.
OVERRIDES = {"max_batch_size": "serve_max_batch_size", "max_wait_ms": "serve_max_wait_ms",
             "max_queue": "serve_max_queue", "deadline_ms": "serve_deadline_ms", "prefetch": "serve_prefetch",
             "paced_batches": "serve_paced_batches"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--weights", help="safetensors file to load instead of seeded random weights")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--config", help="YAML config: KV tiers and the serve_* keys (default: $LAYERFLOW_CONFIG, "
                                         "else built-in defaults)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on; 0 = any free one, printed (default: 8000)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--disable-cudagraph", action="store_true", help="run the per-layer pipeline eagerly")
    parser.add_argument("--no-warmup", action="store_true", help="do not capture every bucket's graphs at start "
                                                                 "(the first request of each shape pays it)")
    parser.add_argument("--max-batch-size", type=int, help="most requests per batch (config: serve_max_batch_size)")
    parser.add_argument("--max-wait-ms", type=float, help="longest wait of a batch's oldest request for the batch "
                                                          "to fill (config: serve_max_wait_ms)")
    parser.add_argument("--max-queue", type=int, help="requests queued before new ones get 503 "
                                                      "(config: serve_max_queue)")
    parser.add_argument("--deadline-ms", type=float, help="default request deadline, 0 = none "
                                                          "(config: serve_deadline_ms)")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare the next batch while one computes (config: serve_prefetch, default on)")
    parser.add_argument("--paced-batches", action=argparse.BooleanOptionalAction, default=None,
                        help="while the queue is deeper than a batch, size batches by the deepest user's backlog "
                             "(config: serve_paced_batches, default on)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")


def serving_config(args: argparse.Namespace) -> Config:
    """The config file's values with the flags that were given on top."""
    config = load_config(args.config)
    given = {key: getattr(args, dest) for dest, key in OVERRIDES.items() if getattr(args, dest) is not None}
    return dataclasses.replace(config, **given)


async def serve(engine: Engine, host: str, port: int) -> None:
    """Serve `engine` until SIGTERM or SIGINT, then drain."""
    server = ServingServer(AsyncEngine(engine), host, port)
    await server.start()
    print(f"{READY} {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger(__name__).info("draining: answering the queued requests, then closing")
    await server.stop()


def run(args: argparse.Namespace, weights: HSTUWeights) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with Engine(weights, serving_config(args), device=args.device,
                use_cuda_graph=not args.disable_cudagraph) as engine:
        if not args.no_warmup:
            engine.warmup()
        asyncio.run(serve(engine, args.host, args.port))
    print("layerflow serve: drained and stopped", flush=True)
    return 0
