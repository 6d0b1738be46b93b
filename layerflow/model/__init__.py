"""The HSTU model: config, weights, embeddings, jagged batches and the reference math."""

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import PRESETS, HSTUConfig
from layerflow.model.reference import CachedOutput, FullOutput, cached_forward, full_forward
from layerflow.model.weights import HSTUWeights, LayerWeights

__all__ = ["PRESETS", "HSTUConfig", "HSTUWeights", "LayerWeights", "JaggedBatch", "CachedOutput", "FullOutput",
           "cached_forward", "full_forward"]
