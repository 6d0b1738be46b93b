"""The eager PyTorch HSTU block on the benchmark's shapes: the baseline the GPU hit is judged against.

What a deployment without custom kernels would run: torch ops in the model's dtype (no fp32 upcast of the history),
one contiguous `[heads, keys, d]` K and V buffer per user and layer that already holds the cached history, the new
tokens' K/V written into it, dense scores against a precomputed mask. The history is gathered once (untimed) from the
engine's GPU pages, so the block reads the same cached K/V as the GPU hit and its scores can be compared with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerflow.model import JaggedBatch
from layerflow.model.embedding import candidate_scores, embed
from layerflow.model.reference import attention_mask, input_projection, output_projection
from layerflow.model.weights import HSTUWeights
from layerflow.runtime.kv_manager import KVManager
from layerflow.runtime.request import Request


class EagerBlock:
    """One batch of returning users (their histories resident in `kv`'s GPU pages), scored by plain torch ops."""

    def __init__(self, weights: HSTUWeights, kv: KVManager, requests: list[Request], seq_len: int) -> None:
        config = self.config = weights.config
        self.weights = weights
        self.batch = JaggedBatch.from_lists(config, [seq_len] * len(requests), [r.items for r in requests],
                                            [r.candidates for r in requests])
        device = weights.item_embedding.device
        ids, positions = self.batch.query_tokens()
        self.ids, self.positions = ids.to(device), positions.to(device)
        self.candidate_rows = self.batch.candidate_mask().nonzero().squeeze(1).to(device)
        self.candidate_ids = self.batch.candidate_ids.to(device)
        self.rows = self.batch.query_offsets.tolist()
        self.seq_len = seq_len
        appended, candidates = len(requests[0].items), len(requests[0].candidates)
        mask = attention_mask(seq_len + appended, appended, candidates).to(device)
        self.mask = (mask / config.max_seq_len).to(config.dtype)  # the constant 1/N folded into the mask
        self.k = [[self._history(kv, r.user_id, layer, 0) for layer in range(config.num_layers)] for r in requests]
        self.v = [[self._history(kv, r.user_id, layer, 1) for layer in range(config.num_layers)] for r in requests]

    def _history(self, kv: KVManager, user: int, layer: int, which: int) -> torch.Tensor:
        """`[heads, seq_len + query tokens, d]` with the user's cached K (which=0) or V (1) in front."""
        ps, n = kv.gpu.page_size, self.batch.query_lens[0]
        pages = torch.tensor(kv.gpu.pages(user)[:-(-self.seq_len // ps)], device=kv.gpu.device)
        cached = kv.gpu.kv[layer][pages, which].flatten(0, 1)[:self.seq_len]  # [seq_len, heads, d]
        out = torch.empty(cached.shape[1], self.seq_len + n, cached.shape[2], dtype=cached.dtype,
                          device=cached.device)
        out[:, :self.seq_len] = cached.transpose(0, 1)
        return out

    def scores(self) -> torch.Tensor:
        """Candidate scores (fp32, on the device) of the batch."""
        w, config, h = self.weights, self.config, self.seq_len
        x = embed(w, self.ids, self.positions)
        for layer, lw in enumerate(w.layers):
            u, v, q, k = input_projection(lw, x, config)
            attn = torch.empty_like(v)
            for b, (lo, hi) in enumerate(zip(self.rows, self.rows[1:])):
                keys, values = self.k[b][layer], self.v[b][layer]
                keys[:, h:] = k[lo:hi].transpose(0, 1)
                values[:, h:] = v[lo:hi].transpose(0, 1)
                a = F.silu(config.alpha * (q[lo:hi].transpose(0, 1) @ keys.transpose(1, 2))) * self.mask
                attn[lo:hi] = (a @ values).transpose(0, 1)
            x = output_projection(lw, x, u, attn, config)
        return candidate_scores(w, x[self.candidate_rows], self.candidate_ids)
