"""The release A/B (`python -m layerflow.bench.paths`) on the CPU path: both releases timed on one engine in
alternated blocks, each scoring exactly like the GPU hit, against one bound built from the same run."""

import json

import pytest

from layerflow.bench.paths import PROFILE_ROWS, main, run_dtype, table
from layerflow.bench.settings import Settings
from tests.bench.cases import CPU


def test_both_releases_are_timed_against_one_bound_and_score_exactly():
    settings = Settings(preset="tiny", seq_lens=(128,), append_len=8, num_candidates=16, batch_size=1, timed_iters=2,
                        warmup_iters=1, scenarios=("gpu_hit", "cpu_hit_layerwise"), profile=True)
    (row,) = run_dtype(settings, ["early", "deferred"], blocks=2, device=CPU)
    assert row["seq_len"] == 128 and row["lower_bound_ms"] > 0
    assert row["lower_bound_ms"] >= row["t_transfer_ms"] and row["lower_bound_ms"] >= row["t_compute_ms"]
    assert list(row["variants"]) == ["early", "deferred"]
    for name, v in row["variants"].items():
        assert len(v["layerwise_ms"]["samples"]) == len(v["gpu_hit_ms"]["samples"]) == 4   # 2 blocks x 2 requests
        assert v["max_abs_diff_vs_gpu_hit"] == 0.0, name
        assert v["pipeline_efficiency"] == pytest.approx(row["lower_bound_ms"] / v["layerwise_ms"]["median"])
        lw, hit = v["layerwise_phases_ms"], v["gpu_hit_phases_ms"]
        assert 0 < lw["collect.fetch"] < lw["wall"] and 0 < lw["prepare.onboard"] < lw["prepare"]
        assert hit["prepare.onboard"] < lw["prepare.onboard"]
        assert set(PROFILE_ROWS) <= set(lw)
    assert table([row]).count("| auto | 128 |") == 2 + 2 * 2   # the latency table; two scenarios in the phase table


def test_the_command_writes_its_rows(tmp_path):
    out = tmp_path / "paths.json"
    main(["--preset", "tiny", "--seq-lens", "64", "--append-len", "4", "--num-candidates", "8", "--device", "cpu",
          "--kv-cache-dtypes", "auto", "--variants", "deferred,early", "--blocks", "1", "--iters", "1",
          "--out", str(out)])
    written = json.loads(out.read_text())
    assert [list(r["variants"]) for r in written["rows"]] == [["deferred", "early"]]


def test_an_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="--variants 'later'"):
        main(["--variants", "later", "--device", "cpu"])
