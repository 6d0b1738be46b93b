"""One full CPU-path run of the inference benchmark, shared by the bench tests."""

import pytest

from layerflow.bench.measure import Results, run
from tests.bench.cases import CPU, small_settings


@pytest.fixture(scope="session")
def results() -> Results:
    return run(small_settings(), CPU)
