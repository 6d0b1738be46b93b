"""Who may talk to a transfer server: a private directory, a secret token, and SO_PEERCRED.

The socket lives in a 0700 directory so other users cannot even connect; the server
still checks the peer's uid from the kernel (SO_PEERCRED cannot be forged) and a
per-server token in a 0600 file, so a same-host process that was merely handed the
socket path is refused unless it can also read the token.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOKEN_FILE = "token"
TOKEN_BYTES = 32


class AuthError(PermissionError):
    """A peer, file or directory failed an authentication or permission check."""


@dataclass(frozen=True)
class PeerCred:
    """Credentials the kernel reports for the other end of a Unix socket."""

    pid: int
    uid: int
    gid: int


def make_private_dir(path: str | os.PathLike | None = None) -> Path:
    """A directory only this uid can enter: a fresh temp dir for None; else `path`, created with mode 0700 (its
    parents as needed), or adopted only if it already is a real directory of ours with mode 0700 (a restart).

    Nothing that exists is changed: a shared directory such as /tmp, or a link planted at `path`, is refused rather
    than chmod-ed, so the server can never lock others out of a directory or follow a link to someone else's.
    """
    if path is None:
        return Path(tempfile.mkdtemp(prefix="layerflow-transfer-"))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise AuthError(f"{p}: is a symbolic link; the socket and token need a real directory of their own")
    if not stat.S_ISDIR(st.st_mode):
        raise AuthError(f"{p}: not a directory")
    try:
        check_private(p, 0o700)
    except AuthError as e:
        raise AuthError(f"{e}: the socket and token need a directory of their own (e.g. a new one such as "
                        f"/tmp/layerflow/kv.sock); an existing directory is never chmod-ed") from None
    return p


def check_private(path: str | os.PathLike, mode: int) -> None:
    """Raise AuthError unless `path` is owned by this uid and has exactly `mode` permissions."""
    st = os.stat(path, follow_symlinks=False)
    if st.st_uid != os.getuid():
        raise AuthError(f"{path}: owned by uid {st.st_uid}, expected {os.getuid()}")
    actual = stat.S_IMODE(st.st_mode)
    if actual != mode:
        raise AuthError(f"{path}: mode {actual:o}, expected {mode:o}")


def write_token(directory: str | os.PathLike) -> Path:
    """Write a fresh random token to `directory/token`, created 0600 and exclusively."""
    path = Path(directory) / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(TOKEN_BYTES).encode())
    finally:
        os.close(fd)
    return path


def read_token(path: str | os.PathLike) -> str:
    """Read a token file after checking it is ours and 0600 (a readable token is no secret)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no token file: no transfer server is running in {Path(path).parent}")
    check_private(path, 0o600)
    return Path(path).read_text().strip()


def tokens_match(expected: str, offered: object) -> bool:
    """Constant-time comparison, so the token cannot be guessed byte by byte from timing."""
    return isinstance(offered, str) and hmac.compare_digest(expected.encode(), offered.encode())


def peer_credentials(sock: socket.socket) -> PeerCred:
    """The connecting process's pid/uid/gid as recorded by the kernel at connect time."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def check_peer(cred: PeerCred, allowed_uid: int) -> None:
    """Refuse a peer whose uid is not the server owner's."""
    if cred.uid != allowed_uid:
        raise AuthError(f"peer pid {cred.pid} has uid {cred.uid}, only uid {allowed_uid} may connect")
