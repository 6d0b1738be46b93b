"""layerflow: HSTU inference with a tiered KV cache onboarded layer by layer under CUDA graphs."""

from layerflow.config import Config, load_config
from layerflow.model import PRESETS, HSTUConfig, HSTUWeights
from layerflow.runtime.engine import Engine, TokenOutputs
from layerflow.runtime.request import EmbeddingRequest, Request

__all__ = ["PRESETS", "Config", "EmbeddingRequest", "Engine", "HSTUConfig", "HSTUWeights", "Request", "TokenOutputs",
           "load_config"]
__version__ = "0.1.0"
