"""Start a transfer server as its own process and wait until it listens (or say why it did not)."""

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
from layerflow.server.server import SOCKET_FILE

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
        """SIGTERM, then SIGKILL if it does not exit within `timeout`; remove the directory the launcher made."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def spawn_server(config: Config, run_dir: str | os.PathLike | None = None,
                 timeout_s: float = 60.0) -> ServerHandle:
    """Run `python -m layerflow.server` in a fresh private directory; raise RuntimeError if it fails to start."""
    owns_run_dir = run_dir is None
    run_dir = make_private_dir(run_dir)
    config_path = run_dir / "config.yaml"
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config.to_dict(), f)
    cmd = [sys.executable, "-m", "layerflow.server", "--config", str(config_path), "--run-dir", str(run_dir)]
    log_path = run_dir / "server.log"
    with open(log_path, "a") as log:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = process.stdout.readline()
        if line.startswith(READY):
            return ServerHandle(process, run_dir, owns_run_dir)
        if not line:
            process.wait()
            raise RuntimeError(f"transfer server exited with {process.returncode} during start-up: "
                               f"{log_path.read_text()[-2000:]}")
    process.kill()
    process.wait()
    raise RuntimeError(f"transfer server did not start within {timeout_s} s")
