"""The native slab packer: `stage_items` in one C call (csrc/pack_slab.c), the numpy packer's twin.

Packing a GPU hit's request into its slab is a dozen small numpy and Python steps, and per request the host's caches
are cold: each step then costs a fixed few microseconds whatever its size (docs/performance.md). The native packer
writes the same bytes in one call that reads the request's lists themselves (no conversion to arrays crosses the
boundary), so the packing costs one call of an extension module's function plus the batch's record. The module is
built for the running interpreter with the system compiler on first use (runtime/native_build.py; Python's headers
are needed, as Triton's launchers need them); `native_available` says whether that works here.

A slab is packed by one packer for its life (an engine picks this one where `native_available`, else the numpy one):
the native packer remembers what the last batch wrote in its own per-slab state.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Hashable, Sequence
from types import ModuleType

from layerflow.model.batch import check_item_ids
from layerflow.model.config import HSTUConfig
from layerflow.runtime.native_build import CFLAGS, CSRC, build_library
from layerflow.runtime.staging import HostSlab, StagedBatch

SOURCE = CSRC / "pack_slab.c"
MODULE = "layerflow_pack_slab"
FIELDS = ("q_offsets", "history_lens", "appended_lens", "page_table", "ids", "positions", "candidate_rows",
          "candidate_ids", "inv_n")


class PackStatus(enum.IntEnum):
    """Why a call of the C packer failed (it returns this int instead of the batch's record); csrc/pack_slab.c's
    values."""

    BAD_ID = 1
    BAD_INPUT = 2
    TOO_LARGE = 3
    NO_TOKENS = 4


class SlabState(ctypes.Structure):
    """Mirror of `layerflow_slab` in csrc/pack_slab.c (same field order and widths)."""

    _fields_ = [("slab", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("max_batch", ctypes.c_int32),
                ("max_tokens", ctypes.c_int32), ("max_pages", ctypes.c_int32), ("batch_n", ctypes.c_int32),
                *[(name, ctypes.c_int32) for name in FIELDS],
                ("tokens_written", ctypes.c_int32), ("candidates_written", ctypes.c_int32)]


def _python_include() -> str:
    """This interpreter's C header directory (the Debian `posix_local` scheme's headers are `posix_prefix`'s)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


@functools.cache
def library() -> ModuleType:
    """The packer extension module, built for this interpreter on first use (RuntimeError without a C compiler or
    Python's headers)."""
    include = _python_include()
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise RuntimeError(f"the native packer needs Python's C headers; {include}/Python.h is missing")
    # The define keys the cached build to this interpreter: a module built for another Python does not load.
    path = build_library(SOURCE, (*CFLAGS, f"-I{include}", f"-DLAYERFLOW_PYTHON={sys.implementation.cache_tag}"))
    spec = importlib.util.spec_from_file_location(MODULE, path,
                                                  loader=importlib.machinery.ExtensionFileLoader(MODULE, str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def native_available() -> bool:
    """Whether the native packer builds and loads on this machine."""
    try:
        library()
    except (OSError, ImportError, RuntimeError):
        return False
    return True


class NativePacker:
    """One slab's native packing state: its layout for the C packer, made once (`for_slab`)."""

    def __init__(self, slab: HostSlab, model: HSTUConfig):
        self.slab, self.model = slab, model
        self._pack = library().pack
        base = slab.host.data_ptr()
        rows, max_pages = slab.table.shape
        self.state = SlabState(slab=base, vocab=model.item_vocab_size, max_batch=rows,
                               max_tokens=len(slab.views["ids"]), max_pages=max_pages,
                               batch_n=model.attn_n_rule == "batch",
                               **{name: (slab.views[name].ctypes.data - base) // 4 for name in FIELDS})
        self._address = ctypes.addressof(self.state)

    @staticmethod
    def for_slab(slab: HostSlab, model: HSTUConfig) -> "NativePacker":
        """The slab's packer, made on its first use and kept on the slab."""
        if slab.packer is None:
            slab.packer = NativePacker(slab, model)
        return slab.packer

    def pack(self, users: list[int], cached_lens: list[int], appended: list[list[int]],
             candidates: list[list[int]], page_rows: list[tuple[int, ...]]) -> tuple:
        """Write the batch into the slab (what `staging.stage_items` writes, byte for byte); returns the batch's
        record: (a copy of cached_lens, appended lengths, candidate lengths, query tokens, candidates). The lists
        must be lists of ints and the page rows tuples (what the KV manager passes). A bad id raises ValueError
        naming the user and the id; a batch past the slab's bucket, a bad type or length ValueError naming it."""
        record = self._pack(self._address, cached_lens, appended, candidates, page_rows, self.slab.held)
        if type(record) is int:
            self._raise(PackStatus(record), users, cached_lens, appended, candidates, page_rows)
        return record

    def _raise(self, status: PackStatus, users: list[int], cached_lens: list[int], appended: list[list[int]],
               candidates: list[list[int]], page_rows: list[tuple[int, ...]]) -> None:
        if status is PackStatus.BAD_ID:
            check_item_ids(self.model, users, appended, candidates)   # raises, naming the user and the id
            raise ValueError(f"users {users}: the item ids failed their range check")
        shape = (f"users {users}: cached {cached_lens}, appended {[len(a) for a in appended]}, candidates "
                 f"{[len(k) for k in candidates]}, pages {[len(p) for p in page_rows]}")
        if status is PackStatus.TOO_LARGE:
            s = self.state
            raise ValueError(f"{shape}: past the slab's {s.max_batch} users, {s.max_tokens} tokens, {s.max_pages} "
                             "pages a user")
        if status is PackStatus.NO_TOKENS:
            raise ValueError(f"{shape}: N of the batch rule is 0 (no history and no query tokens)")
        raise ValueError(f"{shape}: expected lists of ints (ids, cached lengths >= 0) and tuples of page ids "
                         f"(types {type(cached_lens).__name__}, {type(appended).__name__}, "
                         f"{type(candidates).__name__}, {type(page_rows).__name__})")


def stage_items_native(slab: HostSlab, model: HSTUConfig, users: list[int], cached_lens: list[int],
                       appended: list[list[int]], candidates: list[list[int]], page_rows: Sequence[tuple[int, ...]],
                       bucket: Hashable) -> StagedBatch:
    """`staging.stage_items` by the native packer: the same slab bytes, the same StagedBatch, the same errors for
    ids out of the vocabulary or not numbers (an id that is a float is refused by name, where numpy truncates it)."""
    cached, appended_lens, candidate_lens, tokens, num_candidates = \
        NativePacker.for_slab(slab, model).pack(users, cached_lens, appended, candidates, page_rows)
    return StagedBatch(cached, appended_lens, candidate_lens, bucket, slab, tokens, num_candidates)
