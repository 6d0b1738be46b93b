"""Build a C source of runtime/csrc/ into a shared library on first use, cached by its source and flags.

The runtime's native helpers (the eventfd wait node, loaded with ctypes; the slab packer, an extension module built
against the running interpreter's headers) are single C files needing nothing beyond libc and Python: compiling them
with the system C compiler on first use keeps the package free of a build step. The library lands in the cache dir
under a name keyed by the source and the flags, so an edited source is rebuilt and concurrent builders never see a
partial file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c11", "-Wall", "-Werror")

_build_lock = threading.Lock()


def cache_dir() -> Path:
    """Where compiled libraries live: $LAYERFLOW_CACHE_DIR, else ~/.cache/layerflow."""
    configured = os.environ.get("LAYERFLOW_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "layerflow"


def find_compiler() -> str:
    """The C compiler to use: $CC, else cc, else gcc; RuntimeError naming what was tried."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(
        f"layerflow needs a C compiler to build its native helpers; none of {candidates} was found "
        "on PATH (install gcc or set CC)"
    )


def build_library(source: Path, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile `source` into the cache dir, keyed by its text and `cflags`, unless already there; RuntimeError with
    the compiler's message when the build fails."""
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join(cflags).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    compiler = find_compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock:
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        os.close(fd)
        try:
            done = subprocess.run([compiler, *cflags, str(source), "-o", tmp], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {source.name} with {compiler} failed:\n{done.stderr}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
