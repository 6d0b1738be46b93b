"""The HSTU model: config, layer families, weights, embeddings, jagged batches, masks and the reference math."""

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import PRESETS, HSTUConfig
from layerflow.model.family import LayerFamily, layer_family
from layerflow.model.mask import MaskRule, cached_read_range
from layerflow.model.reference import (CachedOutput, FullOutput, PrefillOutput, StepOutput, batch_n, cached_forward,
                                       cached_step, full_forward, prefill)
from layerflow.model.weights import HSTUWeights, LayerWeights

__all__ = ["PRESETS", "HSTUConfig", "HSTUWeights", "LayerWeights", "LayerFamily", "layer_family", "JaggedBatch",
           "MaskRule", "cached_read_range", "CachedOutput", "FullOutput", "PrefillOutput", "StepOutput", "batch_n",
           "cached_forward", "cached_step", "full_forward", "prefill"]
