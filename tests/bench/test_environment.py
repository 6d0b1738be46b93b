"""The header every benchmark's results JSON starts with: each value from its source, and nothing else."""

import json
import platform
import shlex
import sys
import time
from datetime import datetime, timedelta, timezone
from importlib import metadata

import torch

from layerflow.bench.environment import command_line, device_name, environment, results_header


def test_cpu_environment_names_its_sources_and_nothing_else():
    env = environment("cpu")
    assert set(env) == {"device", "cpu_path", "torch", "cuda", "cuda_driver", "triton", "cuda_bindings", "python",
                        "platform", "host_clock", "date"}
    assert env["device"] == device_name(torch.device("cpu")) and env["device"].endswith("CPU path")
    assert env["cpu_path"] is True and env["cuda_driver"] is None
    assert (env["torch"], env["cuda"], env["python"]) == (torch.__version__, torch.version.cuda,
                                                         platform.python_version())
    assert env["triton"] == metadata.version("triton") and env["platform"] == platform.platform()
    clock = time.get_clock_info("perf_counter")
    assert env["host_clock"] == f"perf_counter: {clock.implementation}, resolution {clock.resolution:g} s"
    stamped = datetime.strptime(env["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(datetime.now(timezone.utc) - stamped) < timedelta(hours=1)
    json.dumps(env)  # every value is plain JSON


def test_command_line_is_the_exact_one_and_pastes_back():
    assert shlex.split(command_line()) == sys.orig_argv
    header = results_header(torch.device("cpu"))
    assert list(header) == ["command", "environment"] and header["command"] == command_line()
