"""The fp8 quality comparison: the agreement metrics on known orders, and a CPU run on a small model whose fp8
engine differs from the exact one by little and ranks its candidates nearly the same."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerflow.bench.agreement import Agreement, kendall_tau, relative_errors, top_k_overlap
from layerflow.bench.quality import QualitySettings, compare, markdown, to_dict

ROOT = Path(__file__).resolve().parents[2]


def test_kendall_tau_of_known_orders():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert kendall_tau(a, a * 10) == 1.0
    assert kendall_tau(a, -a) == -1.0
    assert kendall_tau(a, torch.tensor([2.0, 1.0, 3.0, 4.0])) == pytest.approx(4 / 6)   # one of six pairs swapped
    # tau-b: one tie on one side, (5 - 0) / sqrt(6 * 5)
    assert kendall_tau(a, torch.tensor([1.0, 1.0, 3.0, 4.0])) == pytest.approx(5 / 30 ** 0.5)
    with pytest.raises(ValueError, match="at least two"):
        kendall_tau(a[:1], a[:1])


def test_top_k_overlap_and_relative_errors():
    ref = torch.arange(20.0)
    swapped = ref.clone()
    swapped[[9, 10]] = swapped[[10, 9]]                      # the 10th and 11th best trade places
    assert top_k_overlap(swapped, ref, 10) == 0.9 and top_k_overlap(swapped, ref, 11) == 1.0
    assert top_k_overlap(ref, ref, 50) == 1.0                  # k capped at the candidates
    errors = relative_errors(ref + torch.tensor([0.0] * 19 + [1.9]), ref)
    assert errors.max().item() == pytest.approx(0.1) and errors[:19].eq(0).all()
    with pytest.raises(ValueError, match="k=0"):
        top_k_overlap(ref, ref, 0)
    with pytest.raises(ValueError, match="equal"):
        relative_errors(ref, ref[:5])


def test_agreement_averages_users_and_keeps_the_worst():
    ref = [torch.arange(20.0), torch.arange(20.0)]
    swapped = ref[0].clone()
    swapped[[9, 10]] = swapped[[10, 9]]
    agreement = Agreement.of([ref[0], swapped], ref)
    assert (agreement.users, agreement.candidates) == (2, 40)
    assert agreement.top10_overlap == pytest.approx(0.95) and agreement.worst_top10_overlap == 0.9
    assert agreement.passes(0.95, 0.9) and not agreement.passes(0.98, 0.9)


def test_fp8_engine_against_the_exact_one_on_a_small_model():
    settings = QualitySettings(preset="tiny", history_lens=(64, 200), users_per_length=4, append_len=8,
                               num_candidates=40)
    results = compare(settings, torch.device("cpu"))
    overall = results.overall
    assert overall.users == 8 and overall.candidates == 8 * 40
    assert 0 < overall.mean_relative_error <= overall.max_relative_error < 0.02
    assert overall.kendall_tau > 0.97 and overall.top10_overlap >= 0.9
    assert set(results.per_length) == {64, 200}
    assert "| all | 8 |" in markdown(results, "CPU") and to_dict(results)["overall"]["users"] == 8
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        QualitySettings(preset="tiny", history_lens=(64,), users_per_length=1, append_len=1, num_candidates=4,
                        kv_cache_dtype="auto")


def test_the_quality_script_writes_its_figures(tmp_path):
    out = tmp_path / "q.json"
    done = subprocess.run([sys.executable, "benchmarks/fp8_quality.py", "--history-lens", "64", "--users-per-length",
                           "2", "--num-candidates", "20", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert done.returncode in (0, 1), done.stderr
    data = json.loads(out.read_text())
    assert data["passes"] == (done.returncode == 0) and data["settings"]["kv_cache_dtype"] == "fp8_e4m3"
    assert data["environment"]["cpu_path"] is True and "Kendall tau" in done.stdout
