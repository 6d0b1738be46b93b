"""Command line of the transfer server (the lead wires `layerflow transfer-server` to `main`)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from layerflow.config import load_config
from layerflow.server.launcher import READY
from layerflow.server.server import TransferServer


DESCRIPTION = "Serve a shared host (and SSD) KV cache to inference processes."
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="transfer YAML (cpu_cache_gb, ssd_cache_gb, ssd_cache_dir, ...)")
    parser.add_argument("--run-dir", help="private directory for the socket and token (default: the directory of "
                                          "the config's server_socket, else a new temp dir); created 0700, or an "
                                          "existing one that is already 0700 and this user's")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stdin is a pipe held by the process that spawned this server: stop when it closes "
                             "(that process died, however it died)")
    parser.add_argument("--remove-run-dir", action="store_true",
                        help="with --exit-with-parent: the run directory is the parent's throwaway; remove it when "
                             "stopping because the parent died")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerflow transfer-server", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _watch_parent(parent_gone: threading.Event, stop: threading.Event) -> None:
    """Block on stdin until EOF: the write end closes when the parent exits, even by SIGKILL."""
    while os.read(sys.stdin.fileno(), 4096):
        pass
    parent_gone.set()
    stop.set()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM, SIGINT or SIGHUP (or, with --exit-with-parent, the parent's death); remove the token and
    the socket whichever way it stops."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop, parent_gone = threading.Event(), threading.Event()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: stop.set())
    if args.exit_with_parent:  # watched from the start: a parent that died during start-up is seen too
        threading.Thread(target=_watch_parent, args=(parent_gone, stop), daemon=True,
                         name="layerflow-server-parent").start()
    config = load_config(args.config)
    if args.run_dir is None and config.server_socket is not None:
        socket_path = Path(config.server_socket)
        server = TransferServer(config, socket_path.parent, socket_name=socket_path.name)
    else:
        server = TransferServer(config, args.run_dir)
    try:
        def serve() -> None:
            try:
                server.serve_forever()
            finally:
                stop.set()  # the listener failed: stop rather than idle without accepting

        accept = threading.Thread(target=serve, daemon=True, name="layerflow-server-accept")
        accept.start()
        print(f"{READY} socket={server.socket_path} token={server.token_path}", flush=True)
        stop.wait()
        server.close()
        accept.join(timeout=5)
    finally:
        server.token_path.unlink(missing_ok=True)
        server.socket_path.unlink(missing_ok=True)
        if parent_gone.is_set() and args.remove_run_dir:
            logging.getLogger(__name__).info("the spawning process is gone; removing %s", server.run_dir)
            shutil.rmtree(server.run_dir, ignore_errors=True)
    return 0
