"""layerflow: HSTU inference with a tiered KV cache onboarded layer by layer under CUDA graphs."""

from layerflow.config import Config, load_config
from layerflow.model import PRESETS, HSTUConfig, HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request

__all__ = ["PRESETS", "Config", "Engine", "HSTUConfig", "HSTUWeights", "Request", "load_config"]
__version__ = "0.1.0"
