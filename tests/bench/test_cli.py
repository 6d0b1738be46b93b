"""`layerflow bench` on the CPU path, both modes, through the same argument parser the command line uses."""

import argparse
import json

import pytest
import torch

from layerflow.bench.cli import add_arguments, main, settings_from_args, throughput_settings_from_args
from layerflow.bench.settings import CPU_DEFAULTS, GPU_DEFAULTS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_unset_flags_take_the_device_defaults():
    cpu = settings_from_args(parse(), CPU)
    assert (cpu.preset, cpu.seq_lens, cpu.timed_iters) == (CPU_DEFAULTS["preset"], CPU_DEFAULTS["seq_lens"],
                                                           CPU_DEFAULTS["timed_iters"])
    gpu = settings_from_args(parse("--history-len", "1K", "--signal", "event"), CUDA)
    assert (gpu.preset, gpu.seq_lens, gpu.append_len) == (GPU_DEFAULTS["preset"], (1024,), GPU_DEFAULTS["append_len"])
    assert gpu.signal.value == "event"
    stream = throughput_settings_from_args(parse("--seq-lens", "2K,4K", "--rate", "7"), CPU)
    assert (stream.history_len, stream.rate, stream.preset) == (2048, 7.0, "tiny")


def test_bench_command_on_cpu_says_it_ran_the_cpu_path(capsys, tmp_path):
    main(parse("--seq-lens", "64", "--timed-iters", "1", "--warmup-iters", "0", "--scenarios", "gpu_hit,cpu_hit",
               "--device", "cpu", "--profile", "--out", str(tmp_path / "b.json")))
    out = capsys.readouterr().out
    assert "ran the CPU path" in out and "| 64 |" in out and "| GPU hit: phase | 64 |" in out
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["settings"]["preset"] == "tiny" and data["environment"]["cpu_path"] is True
    assert data["settings"]["profile"] is True


def test_timeline_needs_a_gpu():
    with pytest.raises(ValueError, match="--timeline"):
        main(parse("--seq-lens", "64", "--scenarios", "cpu_hit_layerwise", "--timeline", "--device", "cpu"))


def test_throughput_command_on_cpu_serves_the_stream_twice(capsys, tmp_path):
    main(parse("--throughput", "--history-len", "32", "--num-requests", "6", "--num-users", "3", "--gpu-users", "1",
               "--rate", "500", "--device", "cpu", "--out", str(tmp_path / "t.json")))
    out = capsys.readouterr().out
    assert "ran the CPU path" in out and "### Throughput on CPU" in out
    data = json.loads((tmp_path / "t.json").read_text())
    assert [r["layerwise"] for r in data["runs"]] == [False, True]
    assert all(r["num_requests"] == 6 and sum(r["tiers"].values()) == 6 for r in data["runs"])
    assert data["settings"]["history_len"] == 32 and data["environment"]["cpu_path"] is True
    assert data["command"] and data["table"].startswith("### Throughput on CPU")


def test_profile_is_refused_outside_the_default_mode():
    for mode in ("--throughput", "--serve"):
        with pytest.raises(ValueError, match="--profile"):
            main(parse(mode, "--profile", "--device", "cpu"))
