"""The transfer server's socket: a fresh token and a listening socket (0600) in its private directory, taking over
from a predecessor that died there, refusing to start beside one that still listens."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from layerflow.server import protocol
from layerflow.server.auth import TOKEN_FILE, read_token, write_token

SOCKET_FILE = "transfer.sock"
LISTEN_BACKLOG = 128   # connects queued before accept(): a burst of clients starting together is not refused


def listen(run_dir: Path, socket_name: str = SOCKET_FILE) -> tuple[socket.socket, Path, Path, str]:
    """(listening socket, its path, the token file, the token); on a failure nothing is left behind."""
    socket_path = run_dir / socket_name
    clear_stale(socket_path, run_dir / TOKEN_FILE)
    token_path = write_token(run_dir)
    listener = protocol.new_socket()
    try:
        token = read_token(token_path)
        listener.bind(str(socket_path))
        os.chmod(socket_path, 0o600)
        listener.listen(LISTEN_BACKLOG)
    except BaseException:
        listener.close()
        socket_path.unlink(missing_ok=True)
        token_path.unlink(missing_ok=True)
        raise
    return listener, socket_path, token_path, token


def clear_stale(socket_path: Path, token_path: Path) -> None:
    """Let a server restart in its directory: a dead predecessor's socket and token go; a live one's stay (refused)."""
    if socket_path.exists():
        probe = protocol.new_socket()
        try:
            probe.connect(str(socket_path))
        except ConnectionRefusedError:
            socket_path.unlink()
        else:
            raise FileExistsError(f"another transfer server listens on {socket_path}")
        finally:
            probe.close()
    token_path.unlink(missing_ok=True)
