"""The serving tests' model weights (one set for the whole package)."""

import pytest

from layerflow.model import HSTUWeights
from tests.serving.helpers import MODEL


@pytest.fixture(scope="session")
def weights() -> HSTUWeights:
    return HSTUWeights.init(MODEL, seed=3)
