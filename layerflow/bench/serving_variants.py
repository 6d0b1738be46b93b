"""The serving behaviours the serving benchmark compares in one process, on one engine: the library's and the one it
replaced, as a TimedAsyncEngine subclass whose instances switch the library's rule off (on the instance, never by
patching the library's classes).

- "library": the AsyncEngine as it is: a queue deeper than a batch goes out in shares of its longest per-user backlog
  (serving/queue.py, paced batches);
- "s15": the oldest requests up to the batch cap (session 15's batches).
"""

from __future__ import annotations

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.runtime.engine import Engine

VARIANTS: dict[str, bool] = {"library": True, "s15": False}   # name -> paced batches


class VariantAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine whose queue paces its batches or not (`paced`)."""

    def __init__(self, engine: Engine, policy: str | None, paced: bool) -> None:
        super().__init__(engine, policy=policy)
        self.queue.paced = paced


def scheduler(name: str, engine: Engine, policy: str) -> VariantAsyncEngine:
    """The scheduler of variant `name` (one of VARIANTS) on `engine`."""
    if name not in VARIANTS:
        raise ValueError(f"variant={name!r}: expected one of {tuple(VARIANTS)}")
    return VariantAsyncEngine(engine, policy, VARIANTS[name])
