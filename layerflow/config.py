"""The transfer tier's settings, loaded from one YAML file.

Keys FlexKV also has keep FlexKV's names and units (`cpu_cache_gb`, `ssd_cache_gb`, `ssd_cache_dir` with `;` between
several directories); the rest are layerflow's own. A value is taken from the file if the file sets it, else from the
environment fallback if the key has one, else the default. Unknown keys and bad values raise ValueError naming both.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

CONFIG_ENV = "LAYERFLOW_CONFIG"


class SignalMode(enum.Enum):
    """How a waiter learns that one layer's KV has landed on the GPU."""

    EVENTFD = "eventfd"
    EVENT = "event"
    WAITVALUE = "waitvalue"


@dataclass(frozen=True)
class Config:
    """Sizes of the KV tiers and how transfers are signalled. Sizes in GiB (2**30 bytes), as FlexKV."""

    cpu_cache_gb: float = 16.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: str | None = None
    enable_layerwise: bool = True
    signal: SignalMode = SignalMode.EVENTFD
    page_size: int = 32
    gpu_cache_gb: float = 8.0
    num_counters: int = 4
    transfer_timeout_s: float = 10.0
    server_socket: str | None = None
    ssd_io_threads: int = 4
    spawn_server: bool = False
    # The remote KV tier shared between hosts (docs/redis.md); off while remote_url is None.
    remote_url: str | None = None
    remote_password_file: str | None = None
    remote_password_env: str | None = None
    remote_timeout_s: float = 1.0
    remote_namespace: str = "layerflow"
    remote_write: str = "write_through"
    remote_connections: int = 4

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
        return tuple(d for d in self.ssd_cache_dir.split(";") if d)

    def to_dict(self) -> dict:
        """Plain values (the enum as its YAML string), e.g. to record a benchmark's settings."""
        out = asdict(self)
        out["signal"] = self.signal.value
        return out


def _number(name: str, value: object, minimum: float, inclusive: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{name}={value!r}: must be a number {bound} {minimum}")
    return float(value)


def _non_negative(name: str, value: object) -> float:
    return _number(name, value, 0.0, inclusive=True)


def _positive(name: str, value: object) -> float:
    return _number(name, value, 0.0, inclusive=False)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")
    return value


def _optional_str(name: str, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}={value!r}: must be a non-empty string or null")
    return value


def _signal(name: str, value: object) -> SignalMode:
    if isinstance(value, SignalMode):
        return value
    try:
        return SignalMode(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected one of {[m.value for m in SignalMode]}") from None


_CHECKS: dict[str, Callable[[str, object], object]] = {
    "cpu_cache_gb": _non_negative,
    "ssd_cache_gb": _non_negative,
    "ssd_cache_dir": _optional_str,
    "enable_layerwise": _bool,
    "signal": _signal,
    "page_size": _positive_int,
    "gpu_cache_gb": _positive,
    "num_counters": _positive_int,
    "transfer_timeout_s": _positive,
    "server_socket": _optional_str,
    "ssd_io_threads": _positive_int,
    "spawn_server": _bool,
}


def _remote_url(name: str, value: object) -> str | None:
    """A redis:// or rediss:// URL without a password in it (the error never repeats a password)."""
    from layerflow.tier.redis_store import check_url
    return None if value is None else check_url(value)


def _remote_namespace(name: str, value: object) -> str:
    from layerflow.tier.redis_store import check_namespace
    return check_namespace(value)


def _remote_choice(allowed: tuple[str, ...]) -> Callable[[str, object], str]:
    def check(name: str, value: object) -> str:
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {list(allowed)}")
        return value
    return check


_CHECKS.update({
    "remote_url": _remote_url,
    "remote_password_file": _optional_str,
    "remote_password_env": _optional_str,
    "remote_timeout_s": _positive,
    "remote_namespace": _remote_namespace,
    "remote_write": _remote_choice(("write_through", "on_evict")),
    "remote_connections": _positive_int,
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
}


def _read_file(path: Path) -> dict:
    with open(path) as fh:
        values = yaml.safe_load(fh)
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
