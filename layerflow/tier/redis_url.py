"""The Redis settings a config can check without a Redis client: the URL (never with a password in it, never shown
with one) and the key namespace."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+")


def redacted_url(url: str) -> str:
    """`url` as it may be shown: scheme, user, host, port and database only."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{parts.hostname or ''}{port}{parts.path}"


def check_url(url: str) -> str:
    """The URL if it is a plain `redis://` or `rediss://` URL with no password or query in it (ValueError)."""
    if not isinstance(url, str):
        raise ValueError(f"remote_url={url!r}: must be a redis:// or rediss:// URL")
    try:
        parts = urlsplit(url)
        parts.port
    except ValueError as e:
        raise ValueError(f"remote_url={redacted_url(url)!r}: {e}") from None
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"remote_url={redacted_url(url)!r}: expected redis://host:port/db or rediss://host:port/db")
    if parts.password is not None:
        raise ValueError(f"remote_url={redacted_url(url)!r}: has a password in it; give it in "
                         f"remote_password_file or remote_password_env instead")
    if parts.query or parts.fragment:
        raise ValueError(f"remote_url={redacted_url(url)!r}: no query or fragment allowed")
    if parts.path not in ("", "/") and not re.fullmatch(r"/\d+", parts.path):
        raise ValueError(f"remote_url={redacted_url(url)!r}: the path must be a database number, e.g. /0")
    return url


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise ValueError(f"remote_namespace={namespace!r}: letters, digits, '_', '.' and '-' only")
    return namespace
