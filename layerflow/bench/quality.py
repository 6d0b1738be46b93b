"""The fp8 KV cache's quality run: one fixed synthetic workload of many users scored by an engine whose cache holds the
model's dtype and by one whose cache holds fp8, on the same weights, then compared (`agreement`).

Every user has a cached history (its first visit, a miss the engine computes and caches) and comes back with new
items and candidates; the return visits' candidate scores are compared. A model whose caller brings the embeddings
(DLRMv3) returns candidate embeddings, not scores: they are scored by one fixed random linear head (seeded), a
stand-in for the caller's own head. The gate of the fp8 issue: mean top-10 overlap >= 0.98 and mean Kendall tau >=
0.98 (`GATE`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from layerflow.bench.agreement import Agreement
from layerflow.bench.settings import check_lengths, check_settings
from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS, HSTUConfig
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import EmbeddingRequest, Request
from layerflow.tier.layout import KV_CACHE_DTYPES, KVLayout

GATE = {"top10": 0.98, "tau": 0.98}
FP8_NAMES = tuple(name for name, dtype in KV_CACHE_DTYPES.items() if dtype is not None)


@dataclass(frozen=True)
class QualitySettings:
    """The workload (`users_per_length` users at each history length) and the fp8 dtype compared with `auto`."""

    preset: str
    history_lens: tuple[int, ...]
    users_per_length: int
    append_len: int
    num_candidates: int
    kv_cache_dtype: str = "fp8_e4m3"
    batch_size: int = 8
    page_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self, ("users_per_length", "append_len", "batch_size", "page_size"))
        if self.num_candidates < 2:
            raise ValueError(f"num_candidates={self.num_candidates!r}: a ranking needs at least 2")
        if self.kv_cache_dtype not in FP8_NAMES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {list(FP8_NAMES)}")
        check_lengths("history_lens", self.history_lens, self.append_len, self.num_candidates, self.model,
                      self.preset)

    @property
    def model(self) -> HSTUConfig:
        return PRESETS[self.preset]


@dataclass(frozen=True)
class Visits:
    """One user's first visit (its history) and return visit (new items and candidates)."""

    history_len: int
    first: Request | EmbeddingRequest
    again: Request | EmbeddingRequest


def workload(settings: QualitySettings) -> list[Visits]:
    """The fixed workload: random item ids, or random token embeddings, from the settings' seed."""
    model, rng = settings.model, random.Random(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)

    def items(n: int) -> list[int]:
        return [rng.randrange(model.item_vocab_size) for _ in range(n)]

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, model.embedding_dim, generator=gen).to(model.dtype)

    out = []
    for length in settings.history_lens:
        for _ in range(settings.users_per_length):
            user = len(out)
            if model.embedding_tables:
                first = Request(user, items(length), [])
                again = Request(user, items(settings.append_len), items(settings.num_candidates))
            else:
                history = rows(length)
                first = EmbeddingRequest(user, history, history[:0])
                again = EmbeddingRequest(user, rows(settings.append_len), rows(settings.num_candidates))
            out.append(Visits(length, first, again))
    return out


def engine_config(settings: QualitySettings, kv_cache_dtype: str, visits: list[Visits]) -> Config:
    """Pools that hold every user of the workload (no eviction is needed, though one would change nothing)."""
    layout = KVLayout.for_hstu(settings.model, settings.page_size, kv_cache_dtype)
    pages = sum(layout.pages_for_tokens(v.history_len + settings.append_len) for v in visits)
    gb = 1.25 * pages * layout.page_bytes / 2**30 + 0.05
    return Config(page_size=settings.page_size, gpu_cache_gb=gb, cpu_cache_gb=gb, kv_cache_dtype=kv_cache_dtype)


def scores_of(results: list, head: torch.Tensor | None) -> list[torch.Tensor]:
    """Candidate scores on the host (fp32): as they are, or the candidate embeddings through the fixed head."""
    if head is None:
        return [r.float() for r in results]
    return [r.candidates.float() @ head for r in results]


def run_engine(weights: HSTUWeights, settings: QualitySettings, kv_cache_dtype: str, visits: list[Visits],
               device: torch.device) -> list[torch.Tensor]:
    """Every user's return-visit scores from an engine whose cache holds `kv_cache_dtype`."""
    model = settings.model
    head = None if model.embedding_tables else \
        torch.randn(model.embedding_dim, generator=torch.Generator().manual_seed(settings.seed + 1))
    out: list[torch.Tensor] = []
    with Engine(weights, engine_config(settings, kv_cache_dtype, visits), device=device) as engine:
        for v in visits:
            engine.score([v.first])
        engine.kv.wait_offloads()
        for start in range(0, len(visits), settings.batch_size):
            batch = visits[start:start + settings.batch_size]
            out += scores_of(engine.score([v.again for v in batch]), head)
    return out


@dataclass
class QualityResults:
    settings: QualitySettings
    device: torch.device
    overall: Agreement
    per_length: dict[int, Agreement] = field(default_factory=dict)

    @property
    def passes(self) -> bool:
        return self.overall.passes(GATE["top10"], GATE["tau"])


def compare(settings: QualitySettings, device: torch.device) -> QualityResults:
    """The workload through an `auto` engine and an fp8 engine on the same weights, then their agreement."""
    weights = HSTUWeights.init(settings.model, seed=settings.seed)
    visits = workload(settings)
    reference = run_engine(weights, settings, "auto", visits, device)
    fp8 = run_engine(weights, settings, settings.kv_cache_dtype, visits, device)
    return results_of(settings, device, visits, fp8, reference)


def results_of(settings: QualitySettings, device: torch.device, visits: list[Visits], scores: list[torch.Tensor],
               reference: list[torch.Tensor]) -> QualityResults:
    """The agreement of `scores` with `reference` (one per visit of the workload), overall and per history length."""
    per_length = {}
    for length in settings.history_lens:
        users = [i for i, v in enumerate(visits) if v.history_len == length]
        per_length[length] = Agreement.of([scores[i] for i in users], [reference[i] for i in users])
    return QualityResults(settings, device, Agreement.of(scores, reference), per_length)


def markdown(results: QualityResults, where: str) -> str:
    """One row per history length and one for all users, then the gate's verdict."""
    s = results.settings
    rows = [(str(n), a) for n, a in results.per_length.items()] + [("all", results.overall)]
    lines = [f"### {where}: {s.kv_cache_dtype} vs the model's dtype ({s.model.to_dict()['dtype']}), {s.preset} model, "
             f"{s.users_per_length} users per length, {s.append_len} appended, {s.num_candidates} candidates",
             "", "| history | users | max rel err | mean rel err | top-10 | top-50 | Kendall tau | worst top-10 | "
             "worst tau |", "|" + "---|" * 9]
    lines += [f"| {name} | {a.users} | {a.max_relative_error:.2e} | {a.mean_relative_error:.2e} | "
              f"{a.top10_overlap:.4f} | {a.top50_overlap:.4f} | {a.kendall_tau:.4f} | {a.worst_top10_overlap:.2f} | "
              f"{a.worst_kendall_tau:.4f} |" for name, a in rows]
    verdict = "passes" if results.passes else "FAILS"
    lines += ["", f"Gate (mean top-10 overlap >= {GATE['top10']}, mean Kendall tau >= {GATE['tau']}): {verdict}."]
    return "\n".join(lines)


def to_dict(results: QualityResults) -> dict:
    s = results.settings
    return {"settings": {**{k: getattr(s, k) for k in ("preset", "users_per_length", "append_len", "num_candidates",
                                                       "kv_cache_dtype", "batch_size", "page_size", "seed")},
                         "history_lens": list(s.history_lens)},
            "model": s.model.to_dict(), "gate": GATE, "passes": results.passes,
            "overall": results.overall.to_dict(),
            "per_length": {str(n): a.to_dict() for n, a in results.per_length.items()}}
