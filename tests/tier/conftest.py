"""Real redis-server processes on free localhost ports for the remote-tier tests (no fake Redis).

`redis_server` is one server for the whole session (each test starts on an empty database); tests that kill, freeze
or reconfigure a server start their own with `redis_process(...)`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server child on 127.0.0.1:`port` with no persistence; `args` are extra config options."""

    def __init__(self, directory: Path, password: str | None = None, args: tuple[str, ...] = ()) -> None:
        if REDIS_SERVER is None:
            pytest.fail("redis-server is not installed: `apt-get install -y redis-server` (.ci/run does it)")
        self.directory, self.password, self.args = directory, password, args
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> None:
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.directory), *self.args]
        if self.password is not None:
            command += ["--requirepass", self.password]
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(self.directory / 'redis.log').read_text()}")
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server and everything in it are gone at once."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (a server slow past any timeout)."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        if self.process.poll() is None:
            self.kill()
        self.start()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, its database emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def redis_process(tmp_path):
    """`redis_process(password=None, args=())` starts a server of the test's own; all are stopped after it."""
    servers = []

    def start(password: str | None = None, args: tuple[str, ...] = ()) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", password, args))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
