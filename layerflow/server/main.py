"""Command line of the transfer server (the lead wires `layerflow transfer-server` to `main`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from layerflow.config import load_config
from layerflow.server.launcher import READY
from layerflow.server.server import TransferServer


DESCRIPTION = "Serve a shared host (and SSD) KV cache to inference processes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="transfer YAML (cpu_cache_gb, ssd_cache_gb, ssd_cache_dir, ...)")
    parser.add_argument("--run-dir", help="private directory for the socket and token (default: the directory of "
                                          "the config's server_socket, else a new temp dir)")
    parser.add_argument("--log-level", default="INFO")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerflow transfer-server", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    if args.run_dir is None and config.server_socket is not None:
        socket_path = Path(config.server_socket)
        server = TransferServer(config, socket_path.parent, socket_name=socket_path.name)
    else:
        server = TransferServer(config, args.run_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    accept = threading.Thread(target=server.serve_forever, daemon=True, name="layerflow-server-accept")
    accept.start()
    print(f"{READY} socket={server.socket_path} token={server.token_path}", flush=True)
    stop.wait()
    server.close()
    accept.join(timeout=5)
    return 0
