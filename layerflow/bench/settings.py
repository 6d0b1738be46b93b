"""What one inference benchmark run is asked to do: the model preset, the request shape, the history lengths, the
scenarios and the transfer config, validated up front; the per-device defaults the command line starts from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from layerflow.bench.scenarios import SCENARIOS, Scenario
from layerflow.config import SignalMode
from layerflow.model.config import PRESETS, HSTUConfig
from layerflow.tier.layout import KV_CACHE_DTYPES


def parse_length(text: str) -> int:
    """'2K' -> 2048, '512' -> 512."""
    word = text.strip().upper()
    scale = 1024 if word.endswith("K") else 1
    digits = word[:-1] if word.endswith("K") else word
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"sequence length {text!r}: expected a positive integer, optionally with a K suffix")
    return int(digits) * scale


def parse_lengths(text: str) -> tuple[int, ...]:
    return tuple(parse_length(t) for t in text.split(",") if t.strip())


def check_settings(settings: object, positive: tuple[str, ...]) -> None:
    """What every benchmark mode's settings need: a known model preset and the named fields > 0."""
    if settings.preset not in PRESETS:
        raise ValueError(f"preset={settings.preset!r}: expected one of {sorted(PRESETS)}")
    for name in positive:
        if getattr(settings, name) <= 0:
            raise ValueError(f"{name}={getattr(settings, name)!r}: must be positive")


def check_lengths(name: str, lengths: tuple[int, ...], append_len: int, num_candidates: int, model: HSTUConfig,
                  preset: str) -> None:
    """History lengths (the field `name`) are positive and the longest request fits the model's max_seq_len."""
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"{name}={lengths!r}: must be positive lengths")
    longest = max(lengths) + append_len + num_candidates
    if longest > model.max_seq_len:
        raise ValueError(f"{name.removesuffix('s')} {max(lengths)} + append {append_len} + candidates "
                         f"{num_candidates} = {longest} exceeds the {preset} model's max_seq_len {model.max_seq_len}")


@dataclass(frozen=True)
class Settings:
    """One benchmark run: the model, the request shape, the lengths, the scenarios and the transfer config."""

    preset: str
    seq_lens: tuple[int, ...]
    append_len: int
    num_candidates: int
    batch_size: int
    timed_iters: int
    warmup_iters: int
    scenarios: tuple[str, ...]
    use_cuda_graph: bool = True
    only_onboard: bool = False
    timeline: bool = False
    signal: SignalMode | None = None
    config_path: str | None = None
    seed: int = 0
    max_attn_len: int | None = None   # overrides the preset's sliding window (0: none)
    kv_cache_dtype: str | None = None   # overrides the config's kv_cache_dtype
    profile: bool = False   # host time per phase of every timed request (bench.phases)
    token_bucket: int | None = None   # the graph bucket's tokens; None: the batch's query tokens rounded up to 64

    def __post_init__(self) -> None:
        check_settings(self, ("append_len", "num_candidates", "batch_size", "timed_iters"))
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise ValueError(f"scenarios={list(self.scenarios)!r}: expected some of {list(SCENARIOS)}")
        if "torch_eager" in self.scenarios and not (self.model.family == "hstu" and self.model.embedding_tables):
            raise ValueError(f"scenarios: torch_eager is the hstu item-id block only, not the {self.preset} model")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {list(KV_CACHE_DTYPES)}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters={self.warmup_iters!r}: must be >= 0")
        if self.timeline and (self.batch_size != 1 or "cpu_hit_layerwise" not in self.scenarios):
            raise ValueError(f"timeline=True: needs batch_size=1 (got {self.batch_size}) and cpu_hit_layerwise")
        tokens = self.batch_size * (self.append_len + self.num_candidates)
        if self.token_bucket is not None and self.token_bucket < tokens:
            raise ValueError(f"token_bucket={self.token_bucket!r}: the batch has {tokens} query tokens")
        check_lengths("seq_lens", self.seq_lens, self.append_len, self.num_candidates, self.model, self.preset)

    @property
    def model(self) -> HSTUConfig:
        preset = PRESETS[self.preset]
        return preset if self.max_attn_len is None else replace(preset, max_attn_len=self.max_attn_len)

    @property
    def query_tokens(self) -> int:
        """The graph bucket of the benchmark's request: `token_bucket`, else appended + candidates of the whole batch
        rounded up to 64 (a larger `token_bucket` measures what padding a request costs)."""
        if self.token_bucket is not None:
            return self.token_bucket
        return -(-self.batch_size * (self.append_len + self.num_candidates) // 64) * 64

    def scenario_list(self) -> list[Scenario]:
        """The requested scenarios, plus the GPU hit whenever a layerwise bound needs its T_compute."""
        names = list(self.scenarios)
        if any(SCENARIOS[n].bounded for n in names) and "gpu_hit" not in names:
            names.insert(0, "gpu_hit")
        return [SCENARIOS[n] for n in names]


# Defaults per device: the seed's benchmark on a GPU, a small configuration that ends in seconds on the CPU path.
GPU_DEFAULTS = dict(preset="hstu-bench", seq_lens=(2048, 4096, 8192, 16384), append_len=64, num_candidates=256,
                    timed_iters=20, warmup_iters=5)
CPU_DEFAULTS = dict(preset="tiny", seq_lens=(256, 512), append_len=8, num_candidates=16, timed_iters=5,
                    warmup_iters=2)
