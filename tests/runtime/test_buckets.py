"""Shape buckets: the token ladder bounds the padding, and every batch runs in the smallest bucket that fits."""

import pytest

from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.buffers import Bucket, token_ladder
from layerflow.runtime.engine import BATCH_BUCKETS, TOKEN_BUCKETS, Engine


LADDER = token_ladder(64, 2048)


@pytest.fixture(scope="module")
def engine():
    with Engine(HSTUWeights.init(PRESETS["tiny"], seed=0), Config(cpu_cache_gb=0.01, gpu_cache_gb=0.01),
                device="cpu", token_buckets=LADDER) as e:
        yield e


def test_the_ladder_steps_by_an_eighth_of_each_power_of_two():
    assert token_ladder(64, 256) == (64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160, 176, 192, 208, 224, 240, 256)
    assert token_ladder(64, 2048, steps=1) == (64, 128, 256, 512, 1024, 2048)
    assert token_ladder(16, 16) == (16,) and token_ladder(8, 32, steps=2) == (8, 12, 16, 24, 32)
    assert len(LADDER) == 41
    # the default: four steps per power of two, so hstu-bench's 64 + 256 tokens fill a bucket of their own
    assert TOKEN_BUCKETS[:10] == (64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
    assert len(TOKEN_BUCKETS) == 25 and TOKEN_BUCKETS[-1] == 4096


@pytest.mark.parametrize("kwargs, bad", [
    (dict(smallest=48, largest=2048), "smallest=48"), (dict(smallest=64, largest=3000), "largest=3000"),
    (dict(smallest=64, largest=2048, steps=6), "steps=6"), (dict(smallest=64, largest=2048, steps=True), "steps=True"),
    (dict(smallest=128, largest=64), "smallest=128, largest=64"), (dict(smallest=4, largest=64), "steps=8: need")])
def test_a_bad_ladder_is_refused_by_name(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        token_ladder(**kwargs)


def test_every_batch_gets_the_smallest_bucket_that_fits_with_bounded_padding(engine):
    assert engine.buckets == sorted(Bucket(b, t) for b in BATCH_BUCKETS for t in LADDER)
    for batch_size in range(1, max(BATCH_BUCKETS) + 1):
        for num_tokens in range(1, LADDER[-1] + 1):
            fitting = [b for b in engine.buckets if b.fits(batch_size, num_tokens)]
            bucket = engine._bucket(batch_size, num_tokens)
            assert bucket == min(fitting, key=lambda b: (b.max_tokens, b.max_batch)), (batch_size, num_tokens)
            if num_tokens > LADDER[0]:
                assert bucket.max_tokens - num_tokens < num_tokens / 8, (batch_size, num_tokens)


def test_a_batch_past_every_bucket_runs_in_a_power_of_two_one(engine):
    assert engine._bucket(1, 2049) == Bucket(1, 4096)
    assert engine._bucket(9, 100) == Bucket(16, 128) and engine._bucket(3, 5000) == Bucket(4, 8192)


@pytest.mark.parametrize("kwargs, bad", [(dict(token_buckets=()), "token_buckets=()"),
                                         (dict(batch_buckets=(1, 0)), r"batch_buckets=\(1, 0\)"),
                                         (dict(token_buckets=(64.0,)), r"token_buckets=\(64.0,\)")])
def test_bad_bucket_sizes_are_refused_by_name(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        Engine(HSTUWeights.init(PRESETS["tiny"], seed=0), Config(cpu_cache_gb=0.01, gpu_cache_gb=0.01), device="cpu",
               **kwargs)


def test_the_default_buckets_pick_the_smallest_size_of_four_per_power_of_two():
    with Engine(HSTUWeights.init(PRESETS["tiny"], seed=0), Config(cpu_cache_gb=0.01, gpu_cache_gb=0.01),
                device="cpu") as default:
        assert default._bucket(1, 320) == Bucket(1, 320) and default._bucket(1, 321) == Bucket(1, 384)
        assert default._bucket(3, 64) == Bucket(4, 64)
        assert default._bucket(5, 1025) == Bucket(8, 1280) and len(default.buckets) == 100
        # 8 users x (64 appended + 256 candidates) = 2560 query tokens: a captured bucket, not an eager one
        assert default._bucket(8, 8 * 320) == Bucket(8, 2560) and Bucket(8, 4096) in default.buckets
