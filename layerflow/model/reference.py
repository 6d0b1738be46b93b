"""Reference HSTU math in plain torch: the semantics every kernel and the runtime must reproduce.

Per layer on jagged tokens x [T, E] (the family's projections: layerflow.model.family):
  u, v, q, k = input_projection(x)
  A[i, j]    = SiLU(alpha * q_i . k_j) / N * mask[i, j]      (no softmax; the mask: layerflow.model.mask)
  out        = output(x, u, A @ V)

Two entry points take token embeddings (GR's interface): `prefill` runs whole sequences and returns the history
K/V to cache, `cached_step` runs each user's delta (new history tokens, then candidates) against its cached K/V.
`full_forward` and `cached_forward` are the item-id model's versions of the same two, built on them.

N is the config's rule (`batch_n`), or the `n` a caller passes. With the batch rule the cached step is not
cache-exact: the cached K/V of layer 1 on were computed under the prefill's N. With a contextual prefix neither
rule is: in a full run the contextual tokens see every history token, the delta's new ones included, while the
cached step reuses their K/V from a prefill that had not seen those. The cached step does what GR's does: it reads
the cached K/V as they are and never recomputes the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import HSTUConfig
from layerflow.model.embedding import candidate_scores, embed
from layerflow.model.family import layer_family
from layerflow.model.layer import LayerWeights
from layerflow.model.mask import MaskRule, attention_mask
from layerflow.model.weights import HSTUWeights

__all__ = ["CachedOutput", "FullOutput", "PrefillOutput", "StepOutput", "attention_mask", "batch_n",
           "cached_forward", "cached_step", "full_forward", "hstu_attention", "input_projection",
           "output_projection", "prefill"]


def input_projection(layer: LayerWeights, x: torch.Tensor, config: HSTUConfig):
    """The config's family's input projection, for callers holding only a config (HSTUWeights.family is resolved
    once; prefer it)."""
    return layer_family(config).input_projection(layer, x)


def output_projection(layer: LayerWeights, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor,
                      config: HSTUConfig) -> torch.Tensor:
    """The config's family's output step (see `input_projection`)."""
    return layer_family(config).output(layer, x, u, attn)


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, alpha: float,
                   n: float) -> torch.Tensor:
    """q [Lq, H, Dqk], k [Lk, H, Dqk], v [Lk, H, Dv], mask [Lq, Lk] -> [Lq, H, Dv], accumulated in fp32 (or wider)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc))
    weights = F.silu(alpha * scores) / n * mask.unsqueeze(0)
    return torch.einsum("hqk,khd->qhd", weights, v.to(acc)).to(q.dtype)


def batch_n(config: HSTUConfig, cached_lens: list[int], delta_lens: list[int]) -> int:
    """N of the 1/N: max_seq_len (`constant`), or the longest cached length plus the longest delta (`batch`)."""
    if config.attn_n_rule == "constant":
        return config.max_seq_len
    return max(cached_lens, default=0) + max(delta_lens, default=0)


def _check_lengths(config: HSTUConfig, x: torch.Tensor, rows: int, what: str, **lengths: list[int]) -> None:
    for name, values in lengths.items():
        for b, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"user {b}: {name}={value!r} must be a non-negative integer")
    if tuple(x.shape) != (rows, config.embedding_dim):
        raise ValueError(f"{what} shape {tuple(x.shape)}: expected {(rows, config.embedding_dim)}")
    if x.dtype != config.dtype:
        raise ValueError(f"{what} dtype {x.dtype}: expected {config.dtype}")


@dataclass
class PrefillOutput:
    outputs: torch.Tensor              # [sum lengths, E]: the last layer's output of every token, jagged like x
    history_k: list[torch.Tensor]      # per layer [sum (length - targets), H, dqk]: the non-target tokens, to cache
    history_v: list[torch.Tensor]      # per layer [sum (length - targets), H, dv]


def prefill(weights: HSTUWeights, x: torch.Tensor, lengths: list[int], num_targets: list[int] | None = None, *,
            n: float | None = None) -> PrefillOutput:
    """Full forward of B users' sequences x [sum lengths, E], user after user; user b's last num_targets[b] tokens
    are its targets (candidates), none by default.

    N is `n` when given, else the config's rule over the lengths (targets included) with nothing cached. It is
    the cached step of users with nothing cached whose delta is the whole sequence.
    """
    config = weights.config
    targets = [0] * len(lengths) if num_targets is None else list(num_targets)
    _check_lengths(config, x, sum(lengths), "x", lengths=list(lengths), num_targets=targets)
    if len(targets) != len(lengths):
        raise ValueError(f"{len(lengths)} lengths but {len(targets)} num_targets")
    for b, (length, t) in enumerate(zip(lengths, targets)):
        if t > length or length > config.max_seq_len:
            raise ValueError(f"user {b}: num_targets={t}, length={length}: need num_targets <= length <= "
                             f"max_seq_len={config.max_seq_len}")
    empty = [x.new_zeros(0, config.num_heads, d) for d in (config.dqk, config.dv)]
    step = _step(weights, [empty[0]] * config.num_layers, [empty[1]] * config.num_layers, [0] * len(lengths), x,
                 [length - t for length, t in zip(lengths, targets)], targets, n)
    return PrefillOutput(step.outputs, step.new_k, step.new_v)


@dataclass
class StepOutput:
    outputs: torch.Tensor              # [sum delta, E]: every delta row's output, in delta order
    new_k: list[torch.Tensor]          # per layer [sum appended, H, dqk]: the new history tokens', to cache
    new_v: list[torch.Tensor]          # per layer [sum appended, H, dv]


def check_past_kv(config: HSTUConfig, cached_lens: list[int], past_k: list[torch.Tensor],
                  past_v: list[torch.Tensor]) -> None:
    """Cached K/V must be one [sum cached, H, d] tensor per layer in the model's dtype."""
    if len(past_k) != config.num_layers or len(past_v) != config.num_layers:
        raise ValueError(f"cached K/V cover {len(past_k)}/{len(past_v)} layers, model has {config.num_layers}")
    total = sum(cached_lens)
    for layer, (k, v) in enumerate(zip(past_k, past_v)):
        for name, t, d in (("K", k, config.dqk), ("V", v, config.dv)):
            if tuple(t.shape) != (total, config.num_heads, d):
                raise ValueError(f"layer {layer} cached {name} shape {tuple(t.shape)}, "
                                 f"expected {(total, config.num_heads, d)}")
            if t.dtype != config.dtype:
                raise ValueError(f"layer {layer} cached {name} dtype {t.dtype}, expected {config.dtype}")


def cached_step(weights: HSTUWeights, past_k: list[torch.Tensor], past_v: list[torch.Tensor],
                cached_lens: list[int], delta_x: torch.Tensor, appended_lens: list[int], candidate_lens: list[int],
                *, n: float | None = None) -> StepOutput:
    """Run each user's delta rows delta_x [sum (appended + candidates), E] (its new history tokens, then its
    candidates) against its cached K/V (per layer [sum cached_lens, H, d], users concatenated).

    The delta rows use the last rows of each user's full-length mask. N is `n` when given, else the config's rule.
    The cache is not extended: new_k/new_v are the appended tokens' K/V for the caller to append.
    """
    config = weights.config
    if not len(cached_lens) == len(appended_lens) == len(candidate_lens):
        raise ValueError(f"batch sizes disagree: cached_lens={len(cached_lens)}, appended_lens="
                         f"{len(appended_lens)}, candidate_lens={len(candidate_lens)}")
    delta_lens = [a + c for a, c in zip(appended_lens, candidate_lens)]
    _check_lengths(config, delta_x, sum(delta_lens), "delta_x", cached_lens=list(cached_lens),
                   appended_lens=list(appended_lens), candidate_lens=list(candidate_lens))
    for b, (cached, delta) in enumerate(zip(cached_lens, delta_lens)):
        if cached + delta > config.max_seq_len:
            raise ValueError(f"user {b}: cached {cached} + delta {delta} exceeds max_seq_len={config.max_seq_len}")
    check_past_kv(config, cached_lens, past_k, past_v)
    return _step(weights, past_k, past_v, list(cached_lens), delta_x, list(appended_lens), list(candidate_lens), n)


def _step(weights: HSTUWeights, past_k: list[torch.Tensor], past_v: list[torch.Tensor], cached_lens: list[int],
          delta_x: torch.Tensor, appended_lens: list[int], candidate_lens: list[int], n: float | None) -> StepOutput:
    """`cached_step` on checked inputs."""
    config, family = weights.config, weights.family
    delta_lens = [a + c for a, c in zip(appended_lens, candidate_lens)]
    n = batch_n(config, cached_lens, delta_lens) if n is None else n
    rule: MaskRule = config.mask_rule
    qo, co = [0], [0]
    for cached, delta in zip(cached_lens, delta_lens):
        qo.append(qo[-1] + delta)
        co.append(co[-1] + cached)
    device = delta_x.device
    masks = [attention_mask(c + a, a, k, rule).to(device) for c, a, k in zip(cached_lens, appended_lens,
                                                                            candidate_lens)]
    appended = torch.cat([torch.arange(lo, lo + a) for lo, a in zip(qo, appended_lens)]
                         + [torch.zeros(0, dtype=torch.int64)]).to(device)
    x, new_k, new_v = delta_x, [], []
    for layer, lw in enumerate(weights.layers):
        u, v, q, k = family.input_projection(lw, x)
        attn = torch.empty_like(v)
        for b, mask in enumerate(masks):
            rows, cached = slice(qo[b], qo[b + 1]), slice(co[b], co[b + 1])
            keys = torch.cat([past_k[layer][cached], k[rows]])
            values = torch.cat([past_v[layer][cached], v[rows]])
            attn[rows] = hstu_attention(q[rows], keys, values, mask, config.alpha, n)
        new_k.append(k[appended])
        new_v.append(v[appended])
        x = family.output(lw, x, u, attn)
    return StepOutput(x, new_k, new_v)


@dataclass
class CachedOutput:
    new_k: list[torch.Tensor]          # per layer [sum appended, H, dqk]: to append to the users' caches
    new_v: list[torch.Tensor]          # per layer [sum appended, H, dv]
    candidate_outputs: torch.Tensor    # [sum candidates, E]
    scores: torch.Tensor               # [sum candidates] fp32


def cached_forward(weights: HSTUWeights, batch: JaggedBatch, past_k: list[torch.Tensor],
                   past_v: list[torch.Tensor]) -> CachedOutput:
    """The item-id model's cached step: embed the batch's query tokens, run `cached_step`, score the candidates."""
    device = weights.device
    ids, positions = batch.query_tokens()
    x = embed(weights, ids.to(device), positions.to(device))
    step = cached_step(weights, past_k, past_v, batch.cached_lens, x, batch.appended_lens, batch.candidate_lens)
    outputs = step.outputs[batch.candidate_mask().to(device)]
    return CachedOutput(step.new_k, step.new_v, outputs,
                        candidate_scores(weights, outputs, batch.candidate_ids.to(device)))


@dataclass
class FullOutput:
    history_k: list[torch.Tensor]      # per layer [sum history, H, dqk], users concatenated
    history_v: list[torch.Tensor]
    candidate_outputs: torch.Tensor
    scores: torch.Tensor


def full_forward(weights: HSTUWeights, histories: list[list[int]], candidates: list[list[int]]) -> FullOutput:
    """Recompute everything: each user's history + candidates as one sequence through `prefill`, the candidates
    as its targets (no cache, no appended split, so tests can compare the cached path with it)."""
    config = weights.config
    batch = JaggedBatch.from_lists(config, [0] * len(histories), histories, candidates)
    device = weights.device
    ids, positions = [], []
    for hist, cands in zip(histories, candidates):
        ids += hist + cands
        positions += list(range(len(hist))) + [len(hist)] * len(cands)
    x = embed(weights, torch.tensor(ids, dtype=torch.int64, device=device),
              torch.tensor(positions, dtype=torch.int64, device=device))
    lengths = [len(h) + len(c) for h, c in zip(histories, candidates)]
    out = prefill(weights, x, lengths, batch.candidate_lens)
    is_candidate = torch.tensor([i >= len(h) for h, c in zip(histories, candidates) for i in range(len(h) + len(c))],
                                dtype=torch.bool, device=device)
    outputs = out.outputs[is_candidate]
    return FullOutput(out.history_k, out.history_v, outputs,
                      candidate_scores(weights, outputs, batch.candidate_ids.to(device)))
