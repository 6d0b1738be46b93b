"""Start a transfer server as its own process and wait until it listens (or say why it did not).

The server is tied to the process that spawned it: its stdin is a pipe whose only write end this process holds, so
when this process dies, by SIGKILL too, the server reads EOF, stops, and cleans up what this process would have
(`--exit-with-parent`). A pipe, unlike PR_SET_PDEATHSIG, follows the process rather than the thread that spawned it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from layerflow.config import Config
from layerflow.server.auth import TOKEN_FILE, make_private_dir
from layerflow.server.listener import SOCKET_FILE

READY = "LAYERFLOW-TRANSFER-SERVER-READY"


@dataclass
class ServerHandle:
    """A running server process and where to reach it."""

    process: subprocess.Popen
    run_dir: Path
    owns_run_dir: bool = False   # the launcher made the directory, so `stop` removes it

    @property
    def socket_path(self) -> Path:
        return self.run_dir / SOCKET_FILE

    @property
    def token_path(self) -> Path:
        return self.run_dir / TOKEN_FILE

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within `timeout`; then remove what it left."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._clean_up()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as its clients can tell); then remove what it left."""
        self.process.kill()
        self.process.wait()
        self._clean_up()

    def _clean_up(self) -> None:
        """After a server that ran exited: its token and socket (one killed by SIGKILL removes neither), then
        `_release`."""
        self.token_path.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        """The pipes, and the directory if the launcher made it. Alone after a failed start-up: a token or socket in a
        given directory may then be another live server's."""
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def spawn_server(config: Config, run_dir: str | os.PathLike | None = None,
                 timeout_s: float = 60.0) -> ServerHandle:
    """Run `python -m layerflow.server` in a private directory (a fresh one by default; a given one must be new or
    already private, see `make_private_dir`) that exits with this process; raise RuntimeError if it fails to start
    (removing the directory if it made it; a server that got as far as its token removes it as it exits)."""
    owns_run_dir = run_dir is None
    run_dir = make_private_dir(run_dir)
    config_path = run_dir / "config.yaml"
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config.to_dict(), f)
    cmd = [sys.executable, "-m", "layerflow.server", "--config", str(config_path), "--run-dir", str(run_dir),
           "--exit-with-parent"] + (["--remove-run-dir"] if owns_run_dir else [])
    log_path = run_dir / "server.log"
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600), "a") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    handle = ServerHandle(process, run_dir, owns_run_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = process.stdout.readline()
        if line.startswith(READY):
            return handle
        if not line:
            process.wait()
            problem = f"transfer server exited with {process.returncode} during start-up: " \
                      f"{log_path.read_text()[-2000:]}"
            handle._release()
            raise RuntimeError(problem)
    process.terminate()  # SIGTERM first, so a server that did start removes its own token and socket
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    handle._release()
    raise RuntimeError(f"transfer server did not start within {timeout_s} s")
