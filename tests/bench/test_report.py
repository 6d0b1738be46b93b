"""The inference benchmark's outputs of a CPU run: the markdown tables, the JSON and the PNG plot."""

import json
import shlex
import sys

import torch

from layerflow.bench import report
from layerflow.bench.scenarios import SCENARIOS
from tests.bench.cases import LENGTHS


def test_report_table_json_and_plot(results, tmp_path):
    table = report.markdown(results)
    assert "CPU path" in table
    rows = [line for line in table.splitlines() if line.startswith("| 64 ") or line.startswith("| 96 ")]
    assert len(rows) == 3 * len(LENGTHS)  # main, bound detail, other scenarios
    assert "| seq_len | GPU hit ms | CPU hit ms | CPU hit + layerwise ms | LB ms | pipeline eff | transfer eff |" \
        in table
    path = tmp_path / "out" / "r.json"
    report.write_json(results, path)
    data = json.loads(path.read_text())
    assert data["command"] == shlex.join(sys.orig_argv)
    assert data["environment"]["cpu_path"] is True and data["environment"]["torch"] == torch.__version__
    assert data["model"]["num_layers"] == 2 and data["transfer_config"]["page_size"] == 32
    assert {(r["scenario"], r["seq_len"]) for r in data["results"]} == \
        {(n, s) for n in SCENARIOS for s in LENGTHS}
    assert set(data["bounds"]) == {str(s) for s in LENGTHS}
    assert data["seed_reference"]["median_ms"]["16384"]["cpu_hit_layerwise"] == 13.42
    assert data["table"] == table
    png = tmp_path / "r.png"
    report.plot(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_compares_with_the_seed_only_on_the_seed_shape(results):
    assert "seed " not in report.markdown(results)  # the tiny model: no published figures to stand beside
