"""What every benchmark's JSON results say about where and how they were measured, in one place and one format.

`results_header(device)` gives the two keys each results file starts with: "command", the exact command line
(`sys.orig_argv`: the interpreter, its flags and the script, as typed), and "environment": the device (the GPU's name,
or the CPU path), the versions of torch, CUDA (torch's build and the driver), triton, cuda-bindings and Python, the
platform string, the host clock the wall and per-phase figures are read from, and the UTC date. The host's name is
never written.
"""

from __future__ import annotations

import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from importlib import metadata

import torch
from cuda.bindings import runtime as rt

from layerflow.transfer.cuda_api import check


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or the processor with a note that the CPU path ran."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"CPU ({platform.processor() or platform.machine()}), CPU path"
    return torch.cuda.get_device_name(device)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict[str, object]:
    """The device and the software the figures were measured with (the keys of the committed inference results,
    plus "cuda_driver", "host_clock" and "date")."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    clock = time.get_clock_info("perf_counter")
    return {
        "device": device_name(device),
        "cpu_path": not cuda,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_driver": check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion") if cuda else None,
        "triton": _version("triton"),
        "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host_clock": f"perf_counter: {clock.implementation}, resolution {clock.resolution:g} s",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def command_line() -> str:
    """The command that started this process, quoted so it can be pasted back into a shell."""
    return shlex.join(sys.orig_argv)


def results_header(device: torch.device | str) -> dict[str, object]:
    """{"command": ..., "environment": ...}: what every benchmark's results JSON begins with."""
    return {"command": command_line(), "environment": environment(device)}
