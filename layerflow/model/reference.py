"""Reference HSTU math in plain torch: the semantics every kernel and the runtime must reproduce.

Per layer on jagged tokens x [T, E]:
  u, v, q, k = split(SiLU(LayerNorm(x) @ W_uvqk + b_uvqk))
  A[i, j]    = SiLU(alpha * q_i . k_j) / N * mask[i, j]      (N = max_seq_len, no softmax)
  out        = x + (u * LayerNorm(A @ V)) @ W_out
History tokens attend causally (diagonal included); a candidate sees all history and itself, never another candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import HSTUConfig
from layerflow.model.embedding import candidate_scores, embed
from layerflow.model.weights import HSTUWeights, LayerWeights


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def input_projection(layer: LayerWeights, x: torch.Tensor, config: HSTUConfig):
    """x [T, E] -> u [T, H*dv], v [T, H, dv], q [T, H, dqk], k [T, H, dqk]."""
    h, dv, dqk = config.num_heads, config.dv, config.dqk
    uvqk = F.silu(layer_norm(x, layer.ln_in_weight, layer.ln_in_bias, config.layer_norm_eps) @ layer.uvqk_weight
                  + layer.uvqk_bias)
    u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
    return u, v.reshape(-1, h, dv), q.reshape(-1, h, dqk), k.reshape(-1, h, dqk)


def output_projection(layer: LayerWeights, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor,
                      config: HSTUConfig) -> torch.Tensor:
    """x + (u * LayerNorm(attn)) @ W_out, with attn [T, H, dv] flattened over heads."""
    a = layer_norm(attn.reshape(attn.shape[0], -1).to(x.dtype), layer.ln_attn_weight, layer.ln_attn_bias,
                   config.layer_norm_eps)
    return x + (u * a) @ layer.out_weight


def attention_mask(history_len: int, num_appended: int, num_candidates: int) -> torch.Tensor:
    """Bool [num_appended + num_candidates, history_len + num_candidates] for one user's cached-path queries.

    Keys are the user's history (cached + appended) followed by its candidates. Appended query j is history position
    history_len - num_appended + j and sees keys 0..that position; candidate c sees the history and key history_len + c.
    """
    rows = torch.arange(num_appended + num_candidates).unsqueeze(1)
    cols = torch.arange(history_len + num_candidates).unsqueeze(0)
    position = history_len - num_appended + rows
    history_query = rows < num_appended
    causal = (cols <= position) & (cols < history_len)
    candidate = (cols < history_len) | (cols - history_len == rows - num_appended)
    return torch.where(history_query, causal, candidate)


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, alpha: float,
                   max_seq_len: int) -> torch.Tensor:
    """q [Lq, H, D], k [Lk, H, D], v [Lk, H, Dv], mask [Lq, Lk] -> [Lq, H, Dv], accumulated in fp32."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float())
    weights = F.silu(alpha * scores) / max_seq_len * mask.unsqueeze(0)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


@dataclass
class CachedOutput:
    new_k: list[torch.Tensor]          # per layer [sum appended, H, dqk]: to append to the users' caches
    new_v: list[torch.Tensor]          # per layer [sum appended, H, dv]
    candidate_outputs: torch.Tensor    # [sum candidates, E]
    scores: torch.Tensor               # [sum candidates] fp32


def check_past_kv(config: HSTUConfig, batch: JaggedBatch, past_k: list[torch.Tensor],
                  past_v: list[torch.Tensor]) -> None:
    """Cached K/V must be one [sum cached, H, d] tensor per layer in the model's dtype."""
    if len(past_k) != config.num_layers or len(past_v) != config.num_layers:
        raise ValueError(f"cached K/V cover {len(past_k)}/{len(past_v)} layers, model has {config.num_layers}")
    total = sum(batch.cached_lens)
    for layer, (k, v) in enumerate(zip(past_k, past_v)):
        for name, t, d in (("K", k, config.dqk), ("V", v, config.dv)):
            if tuple(t.shape) != (total, config.num_heads, d):
                raise ValueError(f"layer {layer} cached {name} shape {tuple(t.shape)}, "
                                 f"expected {(total, config.num_heads, d)}")
            if t.dtype != config.dtype:
                raise ValueError(f"layer {layer} cached {name} dtype {t.dtype}, expected {config.dtype}")


def cached_forward(weights: HSTUWeights, batch: JaggedBatch, past_k: list[torch.Tensor],
                   past_v: list[torch.Tensor]) -> CachedOutput:
    """Compute only the appended tokens and candidates, reading each user's cached history K/V per layer."""
    config = weights.config
    check_past_kv(config, batch, past_k, past_v)
    ids, positions = batch.query_tokens()
    device = weights.item_embedding.device
    x = embed(weights, ids.to(device), positions.to(device))
    qo, co = batch.query_offsets.tolist(), batch.cached_offsets.tolist()
    is_candidate = batch.candidate_mask().to(device)
    new_k, new_v = [], []
    for layer, lw in enumerate(weights.layers):
        u, v, q, k = input_projection(lw, x, config)
        attn = torch.empty_like(v)
        for b in range(batch.batch_size):
            a, n = batch.appended_lens[b], batch.candidate_lens[b]
            q_b, k_b, v_b = q[qo[b]:qo[b + 1]], k[qo[b]:qo[b + 1]], v[qo[b]:qo[b + 1]]
            keys = torch.cat([past_k[layer][co[b]:co[b + 1]], k_b])
            values = torch.cat([past_v[layer][co[b]:co[b + 1]], v_b])
            mask = attention_mask(batch.history_lens[b], a, n).to(device)
            attn[qo[b]:qo[b + 1]] = hstu_attention(q_b, keys, values, mask, config.alpha, config.max_seq_len)
        new_k.append(k[~is_candidate])
        new_v.append(v[~is_candidate])
        x = output_projection(lw, x, u, attn, config)
    outputs = x[is_candidate]
    return CachedOutput(new_k, new_v, outputs, candidate_scores(weights, outputs, batch.candidate_ids.to(device)))


@dataclass
class FullOutput:
    history_k: list[torch.Tensor]      # per layer [sum history, H, dqk], users concatenated
    history_v: list[torch.Tensor]
    candidate_outputs: torch.Tensor
    scores: torch.Tensor


def full_forward(weights: HSTUWeights, histories: list[list[int]], candidates: list[list[int]]) -> FullOutput:
    """Recompute everything, one user at a time over history + candidates with an explicit dense mask.

    Written independently of the cached path (no jagged batch, no appended split) so tests can compare the two.
    """
    config = weights.config
    batch = JaggedBatch.from_lists(config, [0] * len(histories), histories, candidates)
    device = weights.item_embedding.device
    hist_k = [[] for _ in range(config.num_layers)]
    hist_v = [[] for _ in range(config.num_layers)]
    outputs = []
    for hist, cands in zip(histories, candidates):
        n_h, n_c = len(hist), len(cands)
        ids = torch.tensor(hist + cands, dtype=torch.int64, device=device)
        positions = torch.tensor(list(range(n_h)) + [n_h] * n_c, dtype=torch.int64, device=device)
        mask = torch.zeros(n_h + n_c, n_h + n_c, dtype=torch.bool, device=device)
        mask[:n_h, :n_h] = torch.ones(n_h, n_h, dtype=torch.bool, device=device).tril()
        mask[n_h:, :n_h] = True
        mask[n_h:, n_h:] = torch.eye(n_c, dtype=torch.bool, device=device)
        x = embed(weights, ids, positions)
        for layer, lw in enumerate(weights.layers):
            u, v, q, k = input_projection(lw, x, config)
            attn = hstu_attention(q, k, v, mask, config.alpha, config.max_seq_len)
            hist_k[layer].append(k[:n_h])
            hist_v[layer].append(v[:n_h])
            x = output_projection(lw, x, u, attn, config)
        outputs.append(x[n_h:])
    out = torch.cat(outputs)
    return FullOutput([torch.cat(t) for t in hist_k], [torch.cat(t) for t in hist_v], out,
                      candidate_scores(weights, out, batch.candidate_ids.to(device)))
