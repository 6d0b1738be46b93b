"""The HTTP server's lifecycle: listen, serve, and drain on the way out.

`ServingServer` runs on the caller's event loop (`layerflow serve` runs it until SIGTERM/SIGINT). `BackgroundServer`
runs one on a thread and event loop of its own, so a process can embed the server beside other work (the serving
benchmark drives it from its own loop that way). Stopping drains: new requests are refused with 503, every queued one
is answered, then the listener closes. The server owns its AsyncEngine (stopping closes it); the Engine stays the
caller's to close, which finishes its offloads.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from layerflow.serving.async_engine import AsyncEngine
from layerflow.serving.http import make_app


class ServingServer:
    """`start()` listens on `host:port` (port 0: any free one; `port` tells which), `stop()` drains and closes."""

    def __init__(self, engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port={port!r}: must be an integer in [0, 65536)")
        self.engine, self.host, self.port = engine, host, port
        self._runner = web.AppRunner(make_app(engine), access_log=None)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Refuse new requests, answer every queued one (the scheduler drains in a worker thread, so this loop keeps
        answering meanwhile), then close the listener and the connections."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        await self._runner.cleanup()


class BackgroundServer:
    """A ServingServer on a thread of its own; a context manager (`close()` drains it)."""

    def __init__(self, engine: AsyncEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = ServingServer(engine, host, port)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="layerflow-http", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def url(self) -> str:
        return self.server.url

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._error = e
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    def close(self) -> None:
        """Drain and stop (once)."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
