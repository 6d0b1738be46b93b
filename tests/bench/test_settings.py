"""The inference benchmark's settings: lengths parsed, bad values refused, the scenarios a bound needs added."""

import pytest

from layerflow.bench.settings import Settings, parse_length, parse_lengths
from tests.bench.cases import small_settings


def test_lengths_parse_with_an_optional_k():
    assert parse_lengths("2K, 4k,512") == (2048, 4096, 512)
    assert parse_length(" 16K ") == 16384
    for bad in ("2M", "0", "-4", "K"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_length(bad)


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="warm_hit"):
        small_settings(scenarios=("warm_hit",))
    with pytest.raises(ValueError, match="max_seq_len"):
        small_settings(seq_lens=(4096,))
    with pytest.raises(ValueError, match="timed_iters=0"):
        small_settings(timed_iters=0)
    with pytest.raises(ValueError, match="preset='huge'"):
        small_settings(preset="huge")
    with pytest.raises(ValueError, match="warmup_iters=-1"):
        small_settings(warmup_iters=-1)
    with pytest.raises(ValueError, match="timeline=True"):
        small_settings(timeline=True, batch_size=2)


def test_layerwise_scenarios_bring_the_gpu_hit_they_are_bounded_by():
    names = [s.name for s in small_settings(scenarios=("cpu_hit_layerwise",)).scenario_list()]
    assert names == ["gpu_hit", "cpu_hit_layerwise"]
    assert [s.name for s in small_settings(scenarios=("cpu_hit",)).scenario_list()] == ["cpu_hit"]


def test_query_tokens_round_the_batch_up_to_the_graph_bucket():
    s = small_settings(batch_size=3)  # 3 x (4 appended + 8 candidates) = 36 tokens
    assert isinstance(s, Settings) and s.query_tokens == 64
    assert small_settings(batch_size=6).query_tokens == 128
    assert small_settings(batch_size=3, token_bucket=512).query_tokens == 512   # a padded bucket, on request
    with pytest.raises(ValueError, match="token_bucket=35: the batch has 36 query tokens"):
        small_settings(batch_size=3, token_bucket=35)
