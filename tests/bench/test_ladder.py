"""`layerflow bench --ladder` on the CPU path: the buckets and graphs a ladder makes, and the bytes they hold."""

import argparse
import json

import pytest
import torch

from layerflow.bench import ladder
from layerflow.bench.cli import add_arguments, main
from layerflow.kernels import attention
from layerflow.model.config import PRESETS
from layerflow.tier.layout import KVLayout

CPU = torch.device("cpu")
MODEL = PRESETS["hstu-bench"]


def test_one_bucket_holds_exactly_its_buffers_bytes():
    cost = ladder.ladder_cost(MODEL, 32, (2,), steps=1, smallest=64, largest=64, device=CPU)
    max_pages = KVLayout.for_hstu(MODEL, 32).pages_for_tokens(MODEL.max_seq_len)
    ints = 3 + 2 + 2 + 2 * max_pages + 4 * 64 + 1   # offsets, lengths, page table, per-token rows, 1/N
    assert (cost.buckets, cost.graphs, cost.token_sizes) == (1, 2, (64,))
    assert cost.buffer_bytes == 2 * (4 * ints + 4 * 64)   # host and device slabs, host and device scores
    assert cost.workspace_bytes == 0 and cost.attention_configs == 1   # 4 stand-in SMs: no split-K partials


def test_finer_ladders_cost_more_buckets_graphs_and_workspace():
    costs = [ladder.ladder_cost(MODEL, 32, (1, 2, 4, 8), steps, 64, 2048, CPU, sms=132) for steps in (1, 8)]
    assert [(c.buckets, c.graphs) for c in costs] == [(24, 48), (164, 328)]
    assert costs[0].buffer_bytes < costs[1].buffer_bytes and 0 < costs[0].workspace_bytes < costs[1].workspace_bytes
    assert attention.sm_count(CPU) == 4   # the SM count is the attention's own again afterwards
    with pytest.raises(ValueError, match="sms=0"):
        ladder.ladder_cost(MODEL, 32, (1,), 1, 64, 64, CPU, sms=0)


def test_ladder_mode_prints_the_table_and_writes_the_json(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    main(parser.parse_args(["--ladder", "--ladder-steps", "1,8", "--sms", "132", "--device", "cpu",
                            "--out", str(tmp_path / "l.json")]))
    out = capsys.readouterr().out
    assert "hstu-bench model" in out and "| 8 | 49 | 12.5% | 196 | 392 |" in out   # the default 64..4096
    data = json.loads((tmp_path / "l.json").read_text())
    assert data["environment"]["cpu_path"] is True and data["sms"] == 132
    assert [c["graphs"] for c in data["ladders"]] == [56, 392] and data["ladders"][1]["token_sizes"][:3] == [64, 72, 80]
