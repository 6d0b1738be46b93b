"""The serving behaviours the serving benchmark compares in one process, on one engine: the library's and the ones it
replaced, as a TimedAsyncEngine subclass whose instances switch a library rule off (on the instances, never by
patching the library's classes).

- "library": the AsyncEngine as it is: a queue deeper than a batch goes out in shares of its longest per-user backlog
  (serving/queue.py, paced batches), and the in-process tier orders page reuse on the copy engine (runtime/kv_manager.py);
- "s15": the oldest requests up to the batch cap (session 15's batches);
- "host-waits": the KV manager waits on the host for a user's previous offload before the next one, and evicts only
  users whose offload landed (session 17's rule: the tier's `orders_reuse` off on its instance).
"""

from __future__ import annotations

from dataclasses import dataclass

from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.runtime.engine import Engine


@dataclass(frozen=True)
class Variant:
    paced: bool = True          # paced batches (serving/queue.py)
    ordered_reuse: bool = True  # the tier's own `orders_reuse`; False: the host waits for offloads


VARIANTS: dict[str, Variant] = {"library": Variant(), "s15": Variant(paced=False),
                                "host-waits": Variant(ordered_reuse=False)}


class VariantAsyncEngine(TimedAsyncEngine):
    """A TimedAsyncEngine whose queue paces its batches or not and whose engine's tier orders page reuse or not."""

    def __init__(self, engine: Engine, policy: str | None, variant: Variant) -> None:
        engine.kv.wait_offloads()   # the previous run's offloads land under the rule they were issued with
        tier = engine.kv.below
        vars(tier).pop("orders_reuse", None)
        if not variant.ordered_reuse:
            tier.orders_reuse = False
        super().__init__(engine, policy=policy)
        self.queue.paced = variant.paced


def scheduler(name: str, engine: Engine, policy: str) -> VariantAsyncEngine:
    """The scheduler of variant `name` (one of VARIANTS) on `engine`."""
    if name not in VARIANTS:
        raise ValueError(f"variant={name!r}: expected one of {tuple(VARIANTS)}")
    return VariantAsyncEngine(engine, policy, VARIANTS[name])
