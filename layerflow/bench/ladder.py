"""What a ladder of shape buckets costs the engine (`layerflow bench --ladder`): its buckets, the graphs warm-up
captures (two per bucket: with and without wait nodes), the distinct attention configurations (each a Triton
compile), and the bytes of every bucket's buffers and attention workspace.

Nothing is captured: the buffers are the engine's own `BatchBuffers`, the workspaces those of the Triton attention
(`PagedAttention.for_model`) with the split count it picks for `sms` streaming multiprocessors (default: the device's;
the CPU path's stand-in is 4, so pass the GPU's count, e.g. 132 for an H200, to size them as on that GPU).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from layerflow.bench.environment import device_name, results_header
from layerflow.kernels import attention
from layerflow.model.config import HSTUConfig
from layerflow.runtime.buffers import BatchBuffers, Bucket, token_ladder
from layerflow.tier.layout import KVLayout

WAIT_VARIANTS = 2   # Engine.warmup captures each bucket without and with the layers' wait nodes


@dataclass(frozen=True)
class LadderCost:
    steps: int
    token_sizes: tuple[int, ...]
    buckets: int
    graphs: int
    attention_configs: int
    buffer_bytes: int      # device + pinned host tensors of every bucket's BatchBuffers
    workspace_bytes: int   # the attention's split-K partials of every bucket


@contextmanager
def _sm_count(sms: int | None) -> Iterator[None]:
    """The attention sizes its split count for `sms` multiprocessors inside the block (None: the device's own)."""
    if sms is None:
        yield
        return
    real = attention.sm_count
    attention.sm_count = lambda device: sms
    try:
        yield
    finally:
        attention.sm_count = real


def _tensor_bytes(bufs: BatchBuffers) -> int:
    """Bytes of the tensors a bucket's buffers hold that own their storage, their own host slab's among them (views
    of a slab are counted once, in the slab)."""
    held = [*vars(bufs).values(), bufs._slab.host]
    return sum(t.nbytes for t in held if isinstance(t, torch.Tensor) and t._base is None)


def ladder_cost(model: HSTUConfig, page_size: int, batch_buckets: tuple[int, ...], steps: int, smallest: int,
                largest: int, device: torch.device, sms: int | None = None) -> LadderCost:
    """The cost of every batch bucket with every size of `token_ladder(smallest, largest, steps)` on `device`."""
    if sms is not None and sms <= 0:
        raise ValueError(f"sms={sms!r}: must be positive")
    max_pages = KVLayout.for_hstu(model, page_size).pages_for_tokens(model.max_seq_len)
    tokens = token_ladder(smallest, largest, steps)
    buckets = [Bucket(b, t) for b in sorted(set(batch_buckets)) for t in tokens]
    configs, buffer_bytes, workspace_bytes = set(), 0, 0
    with _sm_count(sms):
        for bucket in buckets:
            buffer_bytes += _tensor_bytes(BatchBuffers(bucket, max_pages, device, model))
            attn = attention.PagedAttention.for_model(model, bucket.max_batch, bucket.max_tokens, max_pages,
                                                      page_size, device)
            configs.add((attn.tiling, attn.num_splits, attn.chunk_pages, bucket.max_batch))
            workspace_bytes += 0 if attn.partials is None else attn.partials.nbytes
    return LadderCost(steps, tokens, len(buckets), WAIT_VARIANTS * len(buckets), len(configs), buffer_bytes,
                      workspace_bytes)


def markdown(preset: str, costs: list[LadderCost], device: torch.device, sms: int | None) -> str:
    where = device_name(device) + (f", attention sized for {sms} SMs" if sms is not None else "")
    lines = [f"### Bucket ladders: {preset} model, {where}",
             "Token sizes from the smallest to the largest, `steps` per power of two (1: powers of two); every batch "
             "bucket with every token size; two graphs per bucket; MiB over all buckets.", "",
             "| steps | token sizes | most padding | buckets | graphs | attention configs | buffers MiB | "
             "attention workspace MiB |", "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.steps} | {len(c.token_sizes)} | {100 / c.steps:.1f}% | {c.buckets} | {c.graphs} | "
                     f"{c.attention_configs} | {c.buffer_bytes / 2**20:.1f} | {c.workspace_bytes / 2**20:.0f} |")
    return "\n".join(lines)


def write_json(preset: str, costs: list[LadderCost], device: torch.device, sms: int | None, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**results_header(device), "preset": preset, "sms": sms,
            "ladders": [asdict(c) | {"token_sizes": list(c.token_sizes)} for c in costs],
            "table": markdown(preset, costs, device, sms)}
    path.write_text(json.dumps(data, indent=1) + "\n")
