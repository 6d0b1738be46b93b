"""The HSTU block rewritten as a per-layer pipeline: project, wait for the layer's KV, append, attend, project.

The wait comes after the input projection (which reads no KV) and before the KV append (which writes into the page
an onboarding may still be filling), so each layer's copy overlaps as much compute as the data allows. The same
`forward` runs eagerly or under CUDA-graph capture; it never synchronises with the host.
"""

from __future__ import annotations

from typing import Protocol

import torch

from layerflow.model.embedding import candidate_scores, embed
from layerflow.model.reference import input_projection
from layerflow.model.weights import HSTUWeights, LayerWeights
from layerflow.kernels.attention import PagedAttention
from layerflow.kernels.kv_append import kv_append
from layerflow.kernels.pointwise import gated_layer_norm, gated_layer_norm_reference
from layerflow.kernels.reference import kv_append_reference, paged_attention_reference
from layerflow.runtime.buffers import BatchBuffers
from layerflow.runtime.waits import LayerWait


class LayerKernels(Protocol):
    """The kernels of a layer: append the new tokens' K/V to their pages, attend over the pages, gate the output."""

    def append(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, bufs: BatchBuffers) -> None: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               bufs: BatchBuffers, out: torch.Tensor) -> None: ...

    def gate(self, u: torch.Tensor, attn: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """u * LayerNorm(attn) with the layer's attention LayerNorm ([T, H*dv])."""


class TritonKernels:
    """The Triton kernels, with one attention workspace per bucket (allocated once, graph capturable)."""

    def __init__(self, weights: HSTUWeights, page_size: int, max_pages: int):
        self.config, self.page_size, self.max_pages = weights.config, page_size, max_pages
        self._attention: dict[tuple[int, int], PagedAttention] = {}

    def _for(self, bufs: BatchBuffers) -> PagedAttention:
        key = (bufs.bucket.max_batch, bufs.bucket.max_tokens)
        if key not in self._attention:
            c = self.config
            self._attention[key] = PagedAttention(
                bufs.bucket.max_batch, bufs.bucket.max_tokens, self.max_pages, c.num_heads, c.dqk, self.page_size,
                c.dtype, bufs.device, c.alpha, c.max_seq_len)
        return self._attention[key]

    def append(self, k, v, kv_cache, bufs):
        kv_append(k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens, bufs.appended_lens)

    def attend(self, q, k, v, kv_cache, bufs, out):
        self._for(bufs).run(q, k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens,
                            bufs.appended_lens, out)

    def gate(self, u, attn, layer):
        return gated_layer_norm(u, attn, layer.ln_attn_weight, layer.ln_attn_bias, self.config.layer_norm_eps)


class ReferenceKernels:
    """The torch references: the CPU path (they read lengths on the host, which a CPU does anyway)."""

    def __init__(self, weights: HSTUWeights):
        self.config = weights.config

    def append(self, k, v, kv_cache, bufs):
        kv_append_reference(k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens, bufs.appended_lens)

    def attend(self, q, k, v, kv_cache, bufs, out):
        paged_attention_reference(q, k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens,
                                  bufs.appended_lens, out, alpha=self.config.alpha,
                                  max_seq_len=self.config.max_seq_len)

    def gate(self, u, attn, layer):
        return gated_layer_norm_reference(u, attn, layer.ln_attn_weight, layer.ln_attn_bias,
                                          self.config.layer_norm_eps)


class LayerPipeline:
    """Runs the whole block for the batch in `bufs`, writing candidate scores to `bufs.scores`."""

    def __init__(self, weights: HSTUWeights, kv_layers: list[torch.Tensor], kernels: LayerKernels):
        self.weights, self.kv_layers, self.kernels = weights, kv_layers, kernels

    def forward(self, bufs: BatchBuffers, wait: LayerWait) -> None:
        w, cfg = self.weights, self.weights.config
        x = embed(w, bufs.ids, bufs.positions)
        for layer, lw in enumerate(w.layers):
            u, v, q, k = input_projection(lw, x, cfg)   # views of one [T, 4 H D] tensor, read in place
            wait.layer(layer)
            kv = self.kv_layers[layer]
            self.kernels.append(k, v, kv, bufs)
            attn = torch.empty(v.shape, dtype=v.dtype, device=v.device)   # rows past the batch stay unused
            self.kernels.attend(q, k, v, kv, bufs, attn)
            x = x + self.kernels.gate(u, attn.view(attn.shape[0], -1), lw) @ lw.out_weight
        bufs.scores.copy_(candidate_scores(w, x[bufs.candidate_rows], bufs.candidate_ids))
