"""The `layerflow` command line.

A user error (ValueError for a bad value, as the library raises it; OSError for a file, directory or socket it cannot
use) is one line on stderr and exit code 2, like argparse's own; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from safetensors import SafetensorError

from layerflow.model import HSTUWeights
from layerflow.model import checkpoint
from layerflow.model.config import PRESETS
from layerflow.bench.cli import add_arguments as add_bench_arguments
from layerflow.bench.cli import main as bench_main
from layerflow.runtime.engine import Engine
from layerflow.bench.workload import returning_users
from layerflow.config import load_config
from layerflow.server.main import DESCRIPTION as SERVER_DESCRIPTION
from layerflow.server.main import add_arguments as add_server_arguments
from layerflow.server.main import run as run_server
from layerflow.serving import cli as serving_cli


USER_ERRORS = (ValueError, OSError)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, refused with a message naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value
    return parse


def _weights(args: argparse.Namespace) -> HSTUWeights:
    config = PRESETS[args.preset]
    if not args.weights:
        return HSTUWeights.init(config, seed=args.seed)
    try:
        return HSTUWeights.load(args.weights, config)
    except SafetensorError as err:
        raise ValueError(f"--weights {args.weights}: not a safetensors file ({err})") from None


def _check_lengths(args: argparse.Namespace) -> None:
    """The longest visit (the last round's, or the first visit without rounds) must fit the model, checked before the
    workload's lists are built."""
    longest = args.history_len + args.rounds * args.append_len + (args.num_candidates if args.rounds else 0)
    limit = PRESETS[args.preset].max_seq_len
    if longest > limit:
        raise ValueError(f"--history-len {args.history_len} + --rounds {args.rounds} x --append-len "
                         f"{args.append_len} + --num-candidates {args.num_candidates} = {longest} tokens exceed "
                         f"max_seq_len={limit} of preset {args.preset!r}")


def cmd_score(args: argparse.Namespace) -> None:
    _check_lengths(args)
    weights = _weights(args)
    first, rounds = returning_users(args.users, args.history_len, args.append_len, args.num_candidates, args.rounds,
                                    weights.config.item_vocab_size, seed=args.seed)
    with Engine(weights, load_config(args.config), use_cuda_graph=not args.disable_cudagraph) as engine:
        engine.warmup()
        engine.score(first)
        print(f"model {args.preset} on {engine.device}: {args.users} users with {args.history_len} cached tokens each")
        for i, requests in enumerate(rounds):
            for r in requests:
                tier = engine.kv.tier(r.user_id).value
                start = time.perf_counter()
                scores = engine.score([r])[0]
                ms = (time.perf_counter() - start) * 1e3
                top = scores.topk(min(args.top_k, scores.numel()))
                best = ", ".join(f"{r.candidates[j]}:{s:.3f}" for s, j in zip(top.values.tolist(), top.indices.tolist()))
                print(f"round {i} user {r.user_id} ({tier} hit): {ms:7.2f} ms  top-{args.top_k} [{best}]")
            if args.evict_between_rounds:
                for r in requests:
                    engine.kv.evict_from_gpu(r.user_id)


def cmd_serve(args: argparse.Namespace) -> None:
    serving_cli.run(args, _weights(args))


def cmd_bench(args: argparse.Namespace) -> None:
    bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    score = sub.add_parser("score", help="score a synthetic returning-user workload through the cached path",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    score.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape")
    score.add_argument("--weights", help="safetensors file to load instead of seeded random weights")
    score.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    score.add_argument("--users", type=_at_least(1), default=4, help="returning users")
    score.add_argument("--history-len", type=_at_least(0), default=256,
                       help="history tokens cached per user before the rounds")
    score.add_argument("--append-len", type=_at_least(0), default=8, help="new history items per user per visit")
    score.add_argument("--num-candidates", type=_at_least(1), default=16, help="candidates scored per visit")
    score.add_argument("--rounds", type=_at_least(0), default=2, help="return visits per user")
    score.add_argument("--top-k", type=_at_least(1), default=3, help="best candidates printed per request")
    score.add_argument("--evict-between-rounds", action="store_true",
                       help="evict the users from the GPU after each round, so the next round is served from host")
    score.add_argument("--config", help="transfer YAML config (default: $LAYERFLOW_CONFIG, else built-in defaults)")
    score.add_argument("--disable-cudagraph", action="store_true", help="run the per-layer pipeline eagerly")
    score.set_defaults(func=cmd_score)

    server = sub.add_parser("transfer-server", description=SERVER_DESCRIPTION,
                            help="run the transfer server (one shared host KV cache for every process on the host)")
    add_server_arguments(server)
    server.set_defaults(func=run_server)

    serve = sub.add_parser("serve", description=serving_cli.DESCRIPTION, help="HTTP scoring server (batching, "
                           "per-user order, prefetch, backpressure, deadlines, Prometheus metrics)")
    serving_cli.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="inference benchmark: GPU/CPU/SSD hits, layerwise onboarding and its bound "
                           "(a small CPU-path run without a GPU)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    imports = sub.add_parser("import-checkpoint", help="convert a generative-recommenders STU stack or a "
                             "recsys-examples HSTU stack into a layerflow weights file",
                             description=checkpoint.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint.add_arguments(imports)
    imports.set_defaults(func=checkpoint.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except USER_ERRORS as err:
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
