"""`layerflow bench --kv-cache-dtype` on the CPU path: the engines hold fp8 pages, the bound table and the JSON say
so, and the onboarded bytes shrink by the layouts' ratio."""

import json

import pytest

from layerflow.bench.cli import main
from layerflow.model.config import PRESETS
from layerflow.tier.layout import KVLayout
from tests.bench.test_cli import parse


def bench(tmp_path, *flags: str) -> dict:
    path = tmp_path / f"bench{len(list(tmp_path.iterdir()))}.json"
    main(parse("--seq-lens", "96", "--timed-iters", "1", "--warmup-iters", "0", "--scenarios",
               "gpu_hit,cpu_hit_layerwise", "--device", "cpu", "--out", str(path), *flags))
    return json.loads(path.read_text())


def test_an_fp8_bench_onboards_the_fp8_bytes(tmp_path, capsys):
    exact = bench(tmp_path)
    fp8 = bench(tmp_path, "--kv-cache-dtype", "fp8_e4m3")
    out = capsys.readouterr().out
    assert "KV cache fp8_e4m3: " in out and "KV cache auto: " in out
    assert fp8["transfer_config"]["kv_cache_dtype"] == fp8["settings"]["kv_cache_dtype"] == "fp8_e4m3"
    layouts = [KVLayout.for_hstu(PRESETS["tiny"], 32, name) for name in ("auto", "fp8_e4m3")]
    assert fp8["settings"]["kv_bytes_per_token"] == layouts[1].page_bytes / 32
    ratio = fp8["bounds"]["96"]["transfer_bytes"] / exact["bounds"]["96"]["transfer_bytes"]
    assert ratio == layouts[1].page_bytes / layouts[0].page_bytes == 33 / 128     # fp32 model, one scale row
    host_hit = next(r for r in fp8["results"] if r["scenario"] == "cpu_hit_layerwise")
    assert host_hit["max_abs_diff_vs_gpu_hit"] == 0.0         # the scales came back with their pages


def test_the_dtype_flag_is_the_default_mode_only():
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        main(parse("--throughput", "--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"))
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "fp16")
