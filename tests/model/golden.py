"""The STU golden fixtures (generative-recommenders' reference outputs): where they are and how to read a case.

They live in <repo root>/../shared/fixtures/stu_golden, the repo root being the main checkout (a git worktree's
shared/ is the main checkout's), or in $LAYERFLOW_FIXTURES. A missing folder fails the test, naming the path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = ("dlrmv3-small", "dlrmv3-small-ctx3", "dlrmv3-small-maxattn8", "dlrmv3-small-groupnorm", "dlrmv3-shape",
         "dlrmv3-small-ctx3-maxattn8-vartargets", "dlrmv3-small-1layer-f64")
LAYER_PREFIX = "_stu_layers."
SCALE_PREFIX = "param_scale."


def main_checkout(root: Path) -> Path:
    """The checkout holding the repository: `root` itself, or for a worktree (a `.git` file) the main one."""
    git = root / ".git"
    if not git.is_file():
        return root
    gitdir = Path(git.read_text().split("gitdir:", 1)[1].strip())
    common = gitdir / "commondir"
    return (gitdir / common.read_text().strip()).resolve().parent if common.is_file() else root


def fixtures_dir() -> Path:
    env = os.environ.get("LAYERFLOW_FIXTURES")
    path = Path(env) if env else main_checkout(REPO_ROOT).parent / "shared" / "fixtures" / "stu_golden"
    if not path.is_dir():
        pytest.fail(f"STU golden fixtures not found at {path} (set LAYERFLOW_FIXTURES to their folder)")
    return path


@dataclass
class GoldenCase:
    name: str
    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The STUStack parameters as the model ran with them: int8-stored ones times their power-of-two scale."""
        out = {}
        for name, t in self.tensors.items():
            if name.startswith(LAYER_PREFIX):
                scale = self.tensors.get(SCALE_PREFIX + name)
                out[name] = t if scale is None else t.to(scale.dtype) * scale
        return out

    def lengths(self) -> tuple[list[int], list[int], list[int]]:
        """(cached, appended, candidates) per user."""
        cached = self.tensors["inputs.history_lengths"].tolist()
        targets = self.tensors["inputs.num_targets"].tolist()
        return cached, [self.meta["delta_size"] - t for t in targets], targets


def load_case(name: str) -> GoldenCase:
    folder = fixtures_dir()
    meta = json.loads((folder / f"{name}.json").read_text())
    return GoldenCase(name, meta, load_file(str(folder / f"{name}.safetensors")))
