"""Statistics of the inference benchmark: percentiles of timed samples and the layerwise pipeline's lower bound.

The bound says how fast a layer-by-layer onboarding overlapped with compute could possibly be: the last layer's KV
lands after the whole transfer, then the last layer still computes; and the block cannot end before the compute
itself, which starts only once the first layer's KV landed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty sample, linear between the closest ranks (numpy's default)."""
    if len(samples) == 0:
        raise ValueError("samples=[]: a percentile needs at least one sample")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r}: must be within [0, 100]")
    return float(np.percentile(samples, q))


@dataclass(frozen=True)
class Summary:
    """Median and p90 of one figure's timed samples (ms), the samples kept for the JSON."""

    median: float
    p90: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Summary":
        return cls(percentile(samples, 50), percentile(samples, 90), tuple(samples))

    def to_dict(self) -> dict:
        return asdict(self) | {"samples": list(self.samples)}


def lower_bound(t_transfer: float, t_compute: float, t_first_layer_transfer: float,
                t_last_layer_compute: float) -> float:
    """LB = max(T_transfer + t_last_layer_compute, T_compute + t_first_layer_transfer)."""
    for name, value in (("t_transfer", t_transfer), ("t_compute", t_compute),
                        ("t_first_layer_transfer", t_first_layer_transfer),
                        ("t_last_layer_compute", t_last_layer_compute)):
        if not value >= 0:
            raise ValueError(f"{name}={value!r}: must be a non-negative time")
    return max(t_transfer + t_last_layer_compute, t_compute + t_first_layer_transfer)


def layer_times(stamps: Sequence[float], end: float) -> list[float]:
    """Per-layer durations from each layer's start stamp and the end of the last layer."""
    marks = list(stamps) + [end]
    if any(b < a for a, b in zip(marks, marks[1:])):
        raise ValueError(f"stamps={list(stamps)}, end={end}: must not decrease")
    return [b - a for a, b in zip(marks, marks[1:])]


@dataclass(frozen=True)
class Bound:
    """The layerwise figure of one length beside what bounds it (ms), and the two efficiencies."""

    measured: float
    t_transfer: float
    t_compute: float
    transfer_layers: tuple[float, ...]
    compute_layers: tuple[float, ...]
    bulk_memcpy: float
    transfer_bytes: int

    @property
    def lower_bound(self) -> float:
        return lower_bound(self.t_transfer, self.t_compute, self.transfer_layers[0], self.compute_layers[-1])

    @property
    def pipeline_efficiency(self) -> float:
        """LB / measured: 1.0 means the pipeline hides everything that can be hidden."""
        return self.lower_bound / self.measured

    @property
    def transfer_efficiency(self) -> float:
        """Onboarding bandwidth / bulk pinned memcpy bandwidth of the same bytes = bulk time / onboarding time."""
        return self.bulk_memcpy / self.t_transfer

    def to_dict(self) -> dict:
        gbps = self.transfer_bytes / 1e6
        return asdict(self) | {
            "transfer_layers": list(self.transfer_layers), "compute_layers": list(self.compute_layers),
            "t_first_layer_transfer": self.transfer_layers[0], "t_last_layer_compute": self.compute_layers[-1],
            "lower_bound": self.lower_bound, "pipeline_efficiency": self.pipeline_efficiency,
            "transfer_efficiency": self.transfer_efficiency,
            "onboard_gb_per_s": gbps / self.t_transfer, "bulk_gb_per_s": gbps / self.bulk_memcpy,
        }
