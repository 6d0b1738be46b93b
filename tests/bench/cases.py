"""The inference benchmark's settings for tests: the tiny model at two short lengths, every scenario in seconds on
the CPU path."""

import torch

from layerflow.bench.scenarios import DEFAULT_SCENARIOS
from layerflow.bench.settings import Settings

CPU = torch.device("cpu")
LENGTHS = (64, 96)


def small_settings(**overrides) -> Settings:
    values = dict(preset="tiny", seq_lens=LENGTHS, append_len=4, num_candidates=8, batch_size=1, timed_iters=2,
                  warmup_iters=1, scenarios=DEFAULT_SCENARIOS)
    values.update(overrides)
    return Settings(**values)
