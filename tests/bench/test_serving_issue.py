"""The copy-issue figures of the serving benchmark: runs per placement, their histogram, the copy-path settings, and
on the GPU the issue-timed engine's records."""

import pytest
import torch

from layerflow.bench.serving import ServingSettings
from layerflow.bench.serving_issue import histogram, placement_runs
from layerflow.bench.throughput import ThroughputSettings


def test_placement_runs_pair_pages_up_to_the_shorter_list():
    placements = [((0, 1, 2, 3), (7, 8, 9)),          # the GPU side holds one page more (the append): one run
                  ((5, 6, 9, 10), (0, 1, 2, 3)),      # the GPU side breaks once
                  ((0, 2, 4), (1, 3, 5)),             # every page its own run
                  ((3,), ())]
    assert placement_runs(placements) == [1, 2, 3, 0]


def test_the_histogram_counts_every_bin_and_the_overflow():
    counts = histogram([1, 1, 2, 3, 16, 17, 200], bins=(1, 2, 16))
    assert counts == {"<=1": 2, "<=2": 1, "<=16": 2, ">16": 2}
    assert histogram([], bins=(4,)) == {"<=4": 0, ">4": 0}


def workload() -> ThroughputSettings:
    return ThroughputSettings(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=8,
                              gpu_users=2, num_requests=4, rate=1.0, zipf=1.0, batch_size=2)


def test_bad_copy_paths_and_blocks_are_refused():
    with pytest.raises(ValueError, match=r"copy_paths=\('warp',\): expected some of .*'run_batch'"):
        ServingSettings(workload(), (1.0,), copy_paths=("warp",))
    with pytest.raises(ValueError, match="blocks=0: must be an integer >= 1"):
        ServingSettings(workload(), (1.0,), blocks=0)
    assert ServingSettings(workload(), (1.0,), copy_paths=("auto", "run_batch"), blocks=2,
                           copy_threads=(False,)).to_dict()["blocks"] == 2


@pytest.mark.gpu
def test_the_issue_timed_engine_records_each_transfer_and_its_parts():
    from layerflow.bench.serving_issue import IssueTimedCopyEngine, summarize_issue
    from layerflow.transfer.cuda_copy import CopyPath
    from tests.transfer.pages import check_onboarded, make_tensors

    engine = IssueTimedCopyEngine(path=CopyPath.RUN_BATCH)
    try:
        gpu, host = make_tensors("cuda", pages=64, blocks=64, layers=2, page=16, heads=2, dim=32)
        pages, blocks = [0, 1, 2, 9, 10], [5, 6, 7, 8, 20]
        engine.onboard(gpu, host, pages, blocks).wait(10)
        check_onboarded(gpu, host, pages, blocks)
        engine.offload(gpu, host, [4], [30]).wait(10)
        assert torch.equal(host[30, 0], gpu[0][4].cpu())
        gpu, host = make_tensors("cuda", pages=64, blocks=64, layers=2, page=16, heads=2, dim=32, seed=1)
        engine.onboard(gpu, host, [20, 21], [40, 41]).wait(10)   # one run: timed as a job all the same
        check_onboarded(gpu, host, [20, 21], [40, 41])
        onboard, offload, one_run = engine.records
        assert (one_run.to_gpu, one_run.pages, one_run.runs, one_run.path) == (True, 2, 1, "run_batch")
        assert (onboard.to_gpu, onboard.pages, onboard.runs, onboard.path) == (True, 5, 3, "run_batch")
        assert (offload.to_gpu, offload.pages, offload.runs) == (False, 1, 1)
        assert all(0 < r.calls_s < r.issue_s < r.total_s and 0 < r.setup_s < r.issue_s for r in engine.records)
        assert all(r.setup_s < r.layer0_s < r.total_s for r in engine.records)
        summary = summarize_issue(engine.records)
        assert summary["onboard"]["transfers"] == 2 and summary["onboard"]["runs_histogram"]["<=4"] == 1
    finally:
        engine.close()
