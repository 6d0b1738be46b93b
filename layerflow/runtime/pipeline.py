"""The HSTU block rewritten as a per-layer pipeline: project, wait for the layer's KV, append, attend, project.

The wait comes after the input projection (which reads no KV) and before the KV append (which writes into the page
an onboarding may still be filling), so each layer's copy overlaps as much compute as the data allows. The same
`forward` runs eagerly or under CUDA-graph capture; it never synchronises with the host. The layer math is the model
family's (`weights.family`). On the GPU a layer outside attention is four kernels: the input LayerNorm, the uvqk GEMM
with its bias in the epilogue, the KV append applying the activation in place as it reads the rows, the output gate
writing the projection's whole input (it sums the attention's split partials as it reads them: no reduction kernel),
and the output GEMM adding the residual in its epilogue (the running rows are updated in place, so no copy or add
runs); five with `silu="separate"`, where the activation is a kernel of its own after the GEMM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

import torch

from layerflow.kernels.attention import PagedAttention
from layerflow.kernels.ends import candidate_dot, embed_rows
from layerflow.kernels.kv_append import activated_kv_append, kv_append
from layerflow.kernels.pointwise import gated_layer_norm, gated_split_norm, layer_norm
from layerflow.kernels.reference import kv_append_reference, paged_attention_reference
from layerflow.kernels.splits import SplitPartials
from layerflow.kernels.workspace import SplitWorkspace
from layerflow.model.embedding import candidate_scores, embed
from layerflow.model.family import layer_norm as layer_norm_reference
from layerflow.model.weights import HSTUWeights, LayerWeights
from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.waits import LayerWait

SILU_ENV = "LAYERFLOW_SILU"                       # where the GPU path applies the layer's SiLU
SILU_CHOICES = ("append", "separate")             # inside the KV append (the default) | its own kernel
WORKSPACE_ENV = "LAYERFLOW_SPLIT_WORKSPACE"       # where the attention's split partials live
WORKSPACE_CHOICES = ("shared", "bucket")          # one for all buckets (the default) | one workspace per bucket


def _choice(name: str, value: str | None, env: str, choices: tuple[str, ...]) -> str:
    """`value`, else the environment's `env`, else the first choice; ValueError naming a value not in `choices`."""
    chosen = value or os.environ.get(env) or choices[0]
    if chosen not in choices:
        raise ValueError(f"{name}={chosen!r} (argument or {env}): expected one of {choices}")
    return chosen


class LayerKernels(Protocol):
    """The kernels of a layer: the input LayerNorm, append the new tokens' K/V to their pages, attend over the pages,
    the output projection's input Y from u and the attention output (the family's `output_input`); and the block's
    two ends for an item-id model: the token rows in, the candidate scores out (written to `out`)."""

    def embed(self, weights: HSTUWeights, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def scores(self, weights: HSTUWeights, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
               out: torch.Tensor) -> None: ...

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...

    def project(self, layer: LayerWeights,
                normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u, v, q, k: the family's input projection of LayerNorm(x), activated now or by `append`."""

    def append(self, u: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, kv_cache: torch.Tensor,
               bufs: BatchBuffers) -> None:
        """Write the new tokens' K/V to their pages; u, v, q, k are activated when it returns."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               bufs: BatchBuffers, out: torch.Tensor) -> torch.Tensor | SplitPartials:
        """The attention output for `output_input`: `out` filled, or what the kernels' gate reads instead of it (the
        attention's unsummed split partials)."""

    def output_input(self, layer: LayerWeights, u: torch.Tensor,
                     attn: torch.Tensor | SplitPartials) -> torch.Tensor: ...


class TritonKernels:
    """The Triton kernels, with an attention per bucket (allocated once, graph capturable); `kv_dtype`: the fp8 dtype
    of the pages, None when they hold the model's dtype. `silu` (SILU_CHOICES, None: $LAYERFLOW_SILU or "append"):
    the SiLU inside the KV append, or as its own kernel after the projection GEMM. `split_workspace`
    (WORKSPACE_CHOICES, None: $LAYERFLOW_SPLIT_WORKSPACE or "shared"): every bucket's attention over one split-K
    workspace (the engine runs one bucket's graph at a time), or each with its own."""

    def __init__(self, weights: HSTUWeights, page_size: int, max_pages: int, kv_dtype: torch.dtype | None = None, *,
                 silu: str | None = None, split_workspace: str | None = None):
        self.config, self.page_size, self.max_pages, self.kv_dtype = weights.config, page_size, max_pages, kv_dtype
        self.family = weights.family
        self._gate_groups = 1 if self.config.output_norm == "layer" else self.config.num_heads
        self._concat = weights.family.output_blocks == 3   # the stu family's Y = [u, attn, u * Norm(attn)]
        self._attention: dict[tuple[int, int], PagedAttention] = {}
        self.silu_in_append = _choice("silu", silu, SILU_ENV, SILU_CHOICES) == "append"
        workspace = _choice("split_workspace", split_workspace, WORKSPACE_ENV, WORKSPACE_CHOICES)
        self.shared_workspace = workspace == "shared"
        self.workspace: SplitWorkspace | None = None

    def reserve(self, buckets: Iterable[Bucket], device: torch.device) -> None:
        """Build every bucket's attention before the first batch. With the shared workspace they end up over one
        buffer of exactly the largest need (built once to learn the needs, then again over a buffer of that size), so
        no order of buckets or captures holds more; with a workspace per bucket this does nothing (they stay lazy)."""
        if not self.shared_workspace:
            return
        if self._attention:
            raise RuntimeError(f"reserve after {len(self._attention)} attentions were built: call it before any batch")
        keys = sorted({(b.max_batch, b.max_tokens) for b in buckets})
        self.workspace = SplitWorkspace(device)
        partials = (self._build(key, device).partials for key in keys)
        self.workspace = SplitWorkspace(device, max((p.numel() for p in partials if p is not None), default=0))
        for key in keys:
            self._attention[key] = self._build(key, device)

    def _build(self, key: tuple[int, int], device: torch.device) -> PagedAttention:
        return PagedAttention.for_model(self.config, *key, self.max_pages, self.page_size, device,
                                        kv_dtype=self.kv_dtype, workspace=self.workspace)

    def _for(self, bufs: BatchBuffers) -> PagedAttention:
        key = (bufs.bucket.max_batch, bufs.bucket.max_tokens)
        if key not in self._attention:
            if self.shared_workspace and self.workspace is None:
                self.workspace = SplitWorkspace(bufs.device)
            self._attention[key] = self._build(key, bufs.device)
        return self._attention[key]

    def embed(self, weights, ids, positions):
        return embed_rows(weights.item_embedding, weights.position_embedding, ids, positions)

    def scores(self, weights, x, rows, ids, out):
        candidate_dot(x, weights.item_embedding, rows, ids, out)

    def layer_norm(self, x, weight, bias):
        return layer_norm(x, weight, bias, self.config.layer_norm_eps)

    def project(self, layer, normed):
        return self.family.project(layer, normed, activate=not self.silu_in_append)

    def append(self, u, v, q, k, kv_cache, bufs):
        lengths = (bufs.page_table, bufs.q_offsets, bufs.history_lens, bufs.appended_lens)
        if self.silu_in_append:
            activated_kv_append(u, v, q, k, kv_cache, *lengths, self.kv_dtype, activate_qkv=self.family.activates_qkv)
        else:
            kv_append(k, v, kv_cache, *lengths, self.kv_dtype)

    def attend(self, q, k, v, kv_cache, bufs, out):
        return self._for(bufs).run(q, k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens,
                                   bufs.appended_lens, out, inv_n=bufs.inv_n, reduce=False)

    def output_input(self, layer, u, attn):
        """u * Norm(attn), where attn is the attention output [T, H, D] or its fp32 split partials."""
        norm = (layer.ln_attn_weight, layer.ln_attn_bias, self.config.layer_norm_eps)
        if isinstance(attn, SplitPartials):
            partials = attn.partials
            return gated_split_norm(u, partials.view(partials.shape[0], partials.shape[1], -1), *norm,
                                    groups=self._gate_groups, concat=self._concat, active_splits=attn.active)
        return gated_layer_norm(u, attn.view(attn.shape[0], -1), *norm, groups=self._gate_groups, concat=self._concat)


class ReferenceKernels:
    """The torch references: the CPU path (they read lengths on the host, which a CPU does anyway); `kv_dtype` as
    for TritonKernels."""

    def __init__(self, weights: HSTUWeights, kv_dtype: torch.dtype | None = None):
        self.config, self.family, self.kv_dtype = weights.config, weights.family, kv_dtype

    def embed(self, weights, ids, positions):
        return embed(weights, ids, positions)

    def scores(self, weights, x, rows, ids, out):
        out.copy_(candidate_scores(weights, x[rows], ids))

    def layer_norm(self, x, weight, bias):
        return layer_norm_reference(x, weight, bias, self.config.layer_norm_eps)

    def project(self, layer, normed):
        return self.family.project(layer, normed)

    def append(self, u, v, q, k, kv_cache, bufs):
        kv_append_reference(k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens, bufs.appended_lens,
                            self.kv_dtype)

    def attend(self, q, k, v, kv_cache, bufs, out):
        return paged_attention_reference(q, k, v, kv_cache, bufs.page_table, bufs.q_offsets, bufs.history_lens,
                                  bufs.appended_lens, out, alpha=self.config.alpha, inv_n=bufs.inv_n,
                                  max_seq_len=None if bufs.inv_n is not None else self.config.max_seq_len,
                                  mask=self.config.mask_rule, kv_dtype=self.kv_dtype)

    def output_input(self, layer, u, attn):
        return self.family.output_input(layer, u, attn)


class LayerPipeline:
    """Runs the whole block for the batch in `bufs`: an item-id model writes candidate scores to `bufs.scores`, an
    embeddings-in model (no tables) reads its token rows from `bufs.x` and writes every query row's output to
    `bufs.outputs`."""

    def __init__(self, weights: HSTUWeights, kv_layers: list[torch.Tensor], kernels: LayerKernels):
        self.weights, self.kv_layers, self.kernels = weights, kv_layers, kernels

    def forward(self, bufs: BatchBuffers, wait: LayerWait) -> None:
        w = self.weights
        tables = w.config.embedding_tables
        x = self.kernels.embed(w, bufs.ids, bufs.positions) if tables else bufs.x
        for layer, lw in enumerate(w.layers):
            normed = self.kernels.layer_norm(x, lw.ln_in_weight, lw.ln_in_bias)
            u, v, q, k = self.kernels.project(lw, normed)   # views of one [T, uvqk] tensor, read in place
            wait.layer(layer)
            kv = self.kv_layers[layer]
            self.kernels.append(u, v, q, k, kv, bufs)
            attn = torch.empty(v.shape, dtype=v.dtype, device=v.device)   # rows past the batch stay unused
            y = self.kernels.output_input(lw, u, self.kernels.attend(q, k, v, kv, bufs, attn))
            # x + Y @ W_out with the residual read by the GEMM; the caller's input rows (bufs.x) are left as they are.
            x = x.addmm_(y, lw.out_weight) if tables or layer else torch.addmm(x, y, lw.out_weight)
        if tables:
            self.kernels.scores(w, x, bufs.candidate_rows, bufs.candidate_ids, bufs.scores)
        else:
            bufs.outputs.copy_(x)
        bufs.send_results()
