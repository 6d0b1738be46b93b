"""The model's two ends: item ids + absolute positions in, candidate scores out."""

from __future__ import annotations

import torch

from layerflow.model.weights import HSTUWeights


def embed(weights: HSTUWeights, item_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Item embedding plus the absolute position embedding: position i stays i whatever is appended later,
    which keeps cached K/V valid."""
    if not weights.config.embedding_tables:
        raise ValueError("this model has no embedding tables: its caller brings the token embeddings")
    return weights.item_embedding[item_ids] + weights.position_embedding[positions]


def candidate_scores(weights: HSTUWeights, outputs: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """score(c) = <final output of candidate token c, item embedding of c>, accumulated in fp32."""
    return (outputs.float() * weights.item_embedding[candidate_ids].float()).sum(-1)
