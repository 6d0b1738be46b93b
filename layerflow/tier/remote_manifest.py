"""What a shared remote store keeps per user besides its blocks: the manifest, and the fingerprint its keys carry.

A manifest is one value, written last, that makes a set of already written blocks a user's copy: the tokens and item-id
history they hold (so another host can adopt the user), the fingerprint of the model and KV layout they were computed
with, the KV dtypes, a version, each block's xxh3-64 checksum, and under which version each block was written (a new
version reuses the unchanged blocks of the one before, so the names come as runs `(version, count)` in block order).
A reader trusts nothing it did not check: a manifest that does not decode, is for another fingerprint or layout, or
does not add up is `None` to it (a miss), and every block is checked against its checksum before it is served.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
import xxhash

from layerflow.model.weights import HSTUWeights
from layerflow.tier.layout import KVLayout

FORMAT = 1


def layout_fingerprint(layout: KVLayout, model_key: str) -> str:
    """16 hex digits naming the model (`model_key`) and the KV layout: copies of different ones never meet."""
    if not isinstance(model_key, str) or not model_key:
        raise ValueError(f"model_key={model_key!r}: must be a non-empty string naming the model's weights")
    described = {"model": model_key, "page_size": layout.page_size,
                 "groups": [[g.num_layers, g.num_heads, g.head_dim, str(g.dtype)] for g in layout.groups]}
    return xxhash.xxh3_64_hexdigest(json.dumps(described, sort_keys=True).encode())


def model_key(weights: HSTUWeights) -> str:
    """A digest of the model's config and every weight's bytes: two checkpoints of one shape get different keys."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(weights.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(weights.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().view(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()


def block_checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def block_hasher() -> xxhash.xxh3_64:
    """`block_checksum` fed piece by piece (`update`, then `intdigest()`): a block checked as its bytes land."""
    return xxhash.xxh3_64()


def history_key(history: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """(length, xxh3-64 of the item ids): tells whether a copy was computed from exactly this history."""
    items = np.asarray(history, dtype="<i8")
    return len(items), xxhash.xxh3_64_intdigest(items.tobytes())


def _pack(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<u8" if array.dtype.kind == "u" else "<i8").tobytes()).decode()


def _unpack(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)


@dataclass(frozen=True, eq=False)
class Manifest:
    """One user's copy: `tokens` tokens of `history` in `num_blocks` blocks of `page_size` tokens."""

    fingerprint: str
    dtypes: tuple[str, ...]
    page_size: int
    block_bytes: int
    version: str
    tokens: int
    history: np.ndarray                  # int64 item ids, len == tokens
    checksums: np.ndarray                # uint64 xxh3-64 per block
    runs: tuple[tuple[str, int], ...]    # (version written under, blocks) in block order

    @property
    def num_blocks(self) -> int:
        return len(self.checksums)

    def block_versions(self) -> list[str]:
        """The version each block was written under, in block order."""
        return [version for version, count in self.runs for _ in range(count)]

    def prefix_runs(self, num_blocks: int) -> list[tuple[str, int]]:
        """The runs of the first `num_blocks` blocks."""
        runs, left = [], num_blocks
        for version, count in self.runs:
            if left > 0:
                runs.append((version, min(count, left)))
                left -= count
        return runs

    def truncated(self, tokens: int, version: str) -> "Manifest":
        """The copy of the first `tokens` tokens (a prefix of the blocks) under `version`."""
        n = -(-tokens // self.page_size)
        return Manifest(self.fingerprint, self.dtypes, self.page_size, self.block_bytes, version, tokens,
                        self.history[:tokens].copy(), self.checksums[:n].copy(), tuple(self.prefix_runs(n)))

    def history_key(self, tokens: int) -> tuple[int, int] | None:
        """`history_key` of the first `tokens` items of the history (None: the copy holds fewer)."""
        return history_key(self.history[:tokens]) if tokens <= self.tokens else None

    def encode(self) -> bytes:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc.update(format=FORMAT, history=_pack(self.history), checksums=_pack(self.checksums),
                   dtypes=list(self.dtypes), runs=[list(r) for r in self.runs])
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, fingerprint: str, page_size: int, block_bytes: int) -> "Manifest | None":
        """The manifest in `data`, or None when it does not decode or is not one this reader may use."""
        try:
            doc = json.loads(data)
            if doc.pop("format") != FORMAT or set(doc) != {f.name for f in fields(cls)}:
                return None
            manifest = cls(str(doc["fingerprint"]), tuple(str(d) for d in doc["dtypes"]), int(doc["page_size"]),
                           int(doc["block_bytes"]), str(doc["version"]), int(doc["tokens"]),
                           _unpack(doc["history"], "<i8"), _unpack(doc["checksums"], "<u8"),
                           tuple((str(v), int(c)) for v, c in doc["runs"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        same = (manifest.fingerprint, manifest.page_size, manifest.block_bytes) == (fingerprint, page_size, block_bytes)
        adds_up = (len(manifest.history) == manifest.tokens > 0
                   and manifest.num_blocks == -(-manifest.tokens // page_size)
                   and sum(c for _, c in manifest.runs) == manifest.num_blocks
                   and all(c > 0 for _, c in manifest.runs))
        return manifest if same and adds_up else None


def new_manifest(fingerprint: str, layout: KVLayout, version: str, history: Sequence[int] | np.ndarray,
                 checksums: Sequence[int] | np.ndarray, runs: Sequence[tuple[str, int]]) -> Manifest:
    """A manifest of `layout`'s blocks; `history` is every token's item id (its length is the token count)."""
    return Manifest(fingerprint, tuple(str(g.dtype).removeprefix("torch.") for g in layout.groups), layout.page_size,
                    layout.page_bytes, version, len(history), np.asarray(history, dtype=np.int64),
                    np.asarray(checksums, dtype=np.uint64), tuple((str(v), int(c)) for v, c in runs))
