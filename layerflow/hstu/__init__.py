"""The HSTU model: config, weights, embeddings, jagged batches and the reference math."""

from layerflow.hstu.batch import JaggedBatch
from layerflow.hstu.config import HSTUConfig
from layerflow.hstu.reference import CachedOutput, FullOutput, cached_forward, full_forward
from layerflow.hstu.weights import HSTUWeights, LayerWeights

__all__ = ["HSTUConfig", "HSTUWeights", "LayerWeights", "JaggedBatch", "CachedOutput", "FullOutput",
           "cached_forward", "full_forward"]
