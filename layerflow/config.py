"""The transfer tier's settings, loaded from one YAML file.

Keys FlexKV also has keep FlexKV's names and units (`cpu_cache_gb`, `ssd_cache_gb`, `ssd_cache_dir` with `;` between
several directories); the rest are layerflow's own. A value is taken from the file if the file sets it, else from the
environment fallback if the key has one, else the default. Unknown keys, keys given twice, malformed YAML and bad
values raise ValueError naming the key (and the file); every number is finite and bounded (the MAX_* constants).
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from layerflow.tier.redis_url import check_namespace, check_url

CONFIG_ENV = "LAYERFLOW_CONFIG"


class SignalMode(enum.Enum):
    """How a waiter learns that one layer's KV has landed on the GPU. AUTO is a choice, not a signal: the engine
    resolves it to the fastest mode its tier can serve (layerflow.runtime.tiers.resolve_signal)."""

    EVENTFD = "eventfd"
    EVENT = "event"
    WAITVALUE = "waitvalue"
    AUTO = "auto"


@dataclass(frozen=True)
class Config:
    """Sizes of the KV tiers and how transfers are signalled. Sizes in GiB (2**30 bytes), as FlexKV."""

    cpu_cache_gb: float = 16.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: str | None = None
    enable_layerwise: bool = True
    signal: SignalMode = SignalMode.AUTO
    page_size: int = 32
    gpu_cache_gb: float = 8.0
    num_counters: int = 4
    transfer_timeout_s: float = 10.0
    server_socket: str | None = None
    ssd_io_threads: int = 4
    spawn_server: bool = False
    # The serving layer (`layerflow serve`): batching, backpressure, deadlines, prefetch across batches.
    serve_max_batch_size: int = 8
    serve_max_wait_ms: float = 2.0
    serve_max_queue: int = 1024
    serve_deadline_ms: float = 1000.0
    serve_prefetch: bool = True
    serve_paced_batches: bool = True
    # Issue the in-process tier's default copy engine's copies on a thread of their own, off the scheduler thread
    # (layerflow.transfer.issue_thread; not applied with waitvalue signals and an SSD or remote tier, nor to a copy
    # engine given to the Engine: runtime/tiers.py).
    copy_thread: bool = True
    # The remote KV tier shared between hosts (docs/redis.md); off while remote_url is None.
    remote_url: str | None = None
    remote_password_file: str | None = None
    remote_password_env: str | None = None
    remote_timeout_s: float = 1.0
    remote_namespace: str = "layerflow"
    remote_write: str = "write_through"
    remote_connections: int = 4
    # What the KV pages hold (docs/fp8.md): `auto` the model's dtype; fp8_e4m3 / fp8_e5m2 fp8 codes with per-token
    # scales, about half the bytes of bf16 in every tier and every copy.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))
        if self.ssd_cache_gb > 0 and self.ssd_cache_dir is None:
            raise ValueError(f"ssd_cache_dir=None: required when ssd_cache_gb={self.ssd_cache_gb} > 0")
        if self.spawn_server and self.server_socket is not None:
            raise ValueError(f"spawn_server=True and server_socket={self.server_socket!r}: connect to a running "
                             f"server or spawn a private one, not both")

    @property
    def ssd_cache_dirs(self) -> tuple[str, ...]:
        """The SSD directories (FlexKV separates several with ';')."""
        if self.ssd_cache_dir is None:
            return ()
        return tuple(_split_dirs(self.ssd_cache_dir))

    def blocks(self, key: str, block_bytes: int, minimum: int = 1) -> int:
        """Whole blocks of `block_bytes` in the GiB of `key` (a `*_cache_gb` size); ValueError naming the key when
        they are fewer than `minimum`. Only the model's layout knows a block's bytes, so the engine and the server
        size their pools through this rather than trusting a size that may hold no page at all."""
        sizes = ("gpu_cache_gb", "cpu_cache_gb", "ssd_cache_gb")
        if key not in sizes:
            raise ValueError(f"key={key!r}: expected one of {sizes}")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes={block_bytes!r}: must be a positive integer")
        gb = getattr(self, key)
        count = int(gb * 2**30) // block_bytes
        if count < minimum:
            raise ValueError(f"{key}={gb!r} holds {count} blocks of {block_bytes} bytes, at least {minimum} needed")
        return count

    def to_dict(self) -> dict:
        """Plain values (the enum as its YAML string), e.g. to record a benchmark's settings."""
        out = asdict(self)
        out["signal"] = self.signal.value
        return out


# Upper bounds: far beyond any machine this runs on, low enough that a typo fails here, naming its key, and not later
# as an allocation error (1e6 GiB of GPU memory) or a descriptor limit (100000 counters of eventfds).
MAX_GPU_CACHE_GB = 1024.0
MAX_CPU_CACHE_GB = 16384.0
MAX_SSD_CACHE_GB = float(2**20)
MAX_TRANSFER_TIMEOUT_S = 86400.0
MAX_PAGE_SIZE = 1024
MAX_COUNTERS = 64
MAX_SSD_IO_THREADS = 256
MAX_SERVE_BATCH = 1024
MAX_SERVE_QUEUE = 1 << 20
MAX_SERVE_WAIT_MS = 60_000.0
MAX_SERVE_DEADLINE_MS = 3_600_000.0
MAX_REMOTE_CONNECTIONS = 256
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def _number(name: str, value: object, minimum: float, inclusive: bool, maximum: float) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive else value > minimum) and value <= maximum
    if not ok:
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{name}={value!r}: must be a finite number {bound} {minimum} and <= {maximum:g}")
    return float(value)


def _size(maximum: float, positive: bool) -> Callable[[str, object], float]:
    return lambda name, value: _number(name, value, 0.0, not positive, maximum)


def _int_in(minimum: int, maximum: int) -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise ValueError(f"{name}={value!r}: must be an integer in [{minimum}, {maximum}]")
        return value
    return check


def _page_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PAGE_SIZE \
            or value & (value - 1):
        raise ValueError(f"{name}={value!r}: must be a power of two in [1, {MAX_PAGE_SIZE}] (the GPU kernels take "
                         f"16, 32, 64 or 128)")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")
    return value


def _optional_path(name: str, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or "\0" in value):
        raise ValueError(f"{name}={value!r}: must be a non-empty path without NUL bytes, or null")
    return value


def _ssd_dirs(name: str, value: object) -> str | None:
    """FlexKV's `;`-separated directory list: at least one directory, none twice."""
    if _optional_path(name, value) is None:
        return None
    seen: set[str] = set()
    for d in _split_dirs(value):
        if os.path.normpath(d) in seen:
            raise ValueError(f"{name}={value!r}: names {os.path.normpath(d)!r} twice")
        seen.add(os.path.normpath(d))
    if not seen:
        raise ValueError(f"{name}={value!r}: names no directory")
    return value


def _split_dirs(text: str) -> list[str]:
    return [d for d in text.split(";") if d]


def _socket_path(name: str, value: object) -> str | None:
    if _optional_path(name, value) is None:
        return None
    if value.endswith("/"):
        raise ValueError(f"{name}={value!r}: must name a socket file, not a directory")
    size = len(os.fsencode(value))
    if size > UNIX_PATH_MAX:
        raise ValueError(f"{name}={value!r}: {size} bytes, a Unix socket path holds at most {UNIX_PATH_MAX}")
    return value


def _signal(name: str, value: object) -> SignalMode:
    if isinstance(value, SignalMode):
        return value
    try:
        return SignalMode(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected one of {[m.value for m in SignalMode]}") from None


_CHECKS: dict[str, Callable[[str, object], object]] = {
    "cpu_cache_gb": _size(MAX_CPU_CACHE_GB, positive=False),
    "ssd_cache_gb": _size(MAX_SSD_CACHE_GB, positive=False),
    "ssd_cache_dir": _ssd_dirs,
    "enable_layerwise": _bool,
    "signal": _signal,
    "page_size": _page_size,
    "gpu_cache_gb": _size(MAX_GPU_CACHE_GB, positive=True),
    "num_counters": _int_in(1, MAX_COUNTERS),
    "transfer_timeout_s": _size(MAX_TRANSFER_TIMEOUT_S, positive=True),
    "server_socket": _socket_path,
    "ssd_io_threads": _int_in(1, MAX_SSD_IO_THREADS),
    "spawn_server": _bool,
    "serve_max_batch_size": _int_in(1, MAX_SERVE_BATCH),
    "serve_max_wait_ms": _size(MAX_SERVE_WAIT_MS, positive=False),
    "serve_max_queue": _int_in(1, MAX_SERVE_QUEUE),
    "serve_deadline_ms": _size(MAX_SERVE_DEADLINE_MS, positive=False),
    "serve_prefetch": _bool,
    "serve_paced_batches": _bool,
    "copy_thread": _bool,
}


def _remote_url(name: str, value: object) -> str | None:
    """A redis:// or rediss:// URL without a password in it (the error never repeats a password)."""
    return None if value is None else check_url(value)


def _remote_namespace(name: str, value: object) -> str:
    return check_namespace(value)


def _remote_choice(allowed: tuple[str, ...]) -> Callable[[str, object], str]:
    def check(name: str, value: object) -> str:
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {list(allowed)}")
        return value
    return check


_CHECKS.update({
    "remote_url": _remote_url,
    "remote_password_file": _optional_path,
    "remote_password_env": _optional_path,
    "remote_timeout_s": _size(MAX_TRANSFER_TIMEOUT_S, positive=True),
    "remote_namespace": _remote_namespace,
    "remote_write": _remote_choice(("write_through", "on_evict")),
    "remote_connections": _int_in(1, MAX_REMOTE_CONNECTIONS),
    "kv_cache_dtype": _remote_choice(("auto", "fp8_e4m3", "fp8_e5m2")),
})

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


# Environment fallbacks: key -> (variable, parser of its text). Used only where the file does not set the key.
ENV_FALLBACKS: dict[str, tuple[str, Callable[[str], object]]] = {
    "enable_layerwise": ("LAYERFLOW_ENABLE_LAYERWISE", _env_bool),
    "signal": ("LAYERFLOW_SIGNAL", lambda text: _signal("signal", text.strip().lower())),
    "copy_thread": ("LAYERFLOW_COPY_THREAD", _env_bool),
}


class _StrictLoader(yaml.SafeLoader):
    """safe_load, but a key given twice is an error (PyYAML keeps the last silently) and `1e6` is a float as in
    YAML 1.2 (PyYAML's YAML 1.1 reads it as a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _read_file(path: Path) -> dict:
    with open(path) as fh:
        try:
            values = yaml.load(fh, Loader=_StrictLoader)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {err}") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: top level must be a mapping of keys to values, got {type(values).__name__}")
    known = {f.name for f in fields(Config)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{path}: unknown key {key!r} (value {value!r}); known keys: {sorted(known)}")
    return values


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] = os.environ) -> Config:
    """The config from `path` (or the file named by LAYERFLOW_CONFIG; none: defaults) with env fallbacks.

    Precedence per key: value set in the file > environment fallback > default.
    """
    if path is None and env.get(CONFIG_ENV):
        path = env[CONFIG_ENV]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{CONFIG_ENV}={path!r}: no such file")
    values = _read_file(Path(path)) if path is not None else {}
    for key, (variable, parse) in ENV_FALLBACKS.items():
        if key in values or variable not in env:
            continue
        try:
            values[key] = parse(env[variable])
        except ValueError as err:
            raise ValueError(f"{variable}={env[variable]!r} (fallback for {key}): {err}") from None
    try:
        return Config(**values)
    except ValueError as err:
        raise ValueError(f"{path}: {err}" if path is not None else str(err)) from None
