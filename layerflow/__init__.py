"""layerflow: HSTU inference with a tiered, layer-by-layer onboarded KV cache."""

__version__ = "0.1.0"
