"""The serving layer: an asynchronous engine over `Engine` and the HTTP server of `layerflow serve`.

Modules, each importing only those above it:
- `errors`: the serving layer's refusals (QueueFull, DeadlineExceeded, ShuttingDown, BadField) and `error_kind`.
- `queue`: the bounded request queue and the rule that forms batches (per-user order, caps, max wait).
- `metrics`: the Prometheus metrics, in a registry per server.
- `flights`: a prepared batch and a launched one (its completion polled through a CUDA event).
- `async_engine`: `AsyncEngine` (submit / await score) and its scheduler thread: prefetch, deadlines, failures.
- `validation`: the JSON body of `POST /v1/score`, checked field by field.
- `http`: the aiohttp routes (score, healthz, metrics) and the HTTP status of each error kind.
- `server`: the server's lifecycle (listen, drain) on the caller's event loop or a thread of its own.
- `cli`: `layerflow serve`.
"""

from layerflow.serving.async_engine import AsyncEngine, Scored
from layerflow.serving.errors import BadField, DeadlineExceeded, QueueFull, ServingError, ShuttingDown
from layerflow.serving.metrics import ServingMetrics

__all__ = ["AsyncEngine", "BadField", "DeadlineExceeded", "QueueFull", "Scored", "ServingError", "ServingMetrics",
           "ShuttingDown"]
