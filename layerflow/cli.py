"""The `layerflow` command line."""

from __future__ import annotations

import argparse
import time

from layerflow.model import HSTUWeights
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


def _weights(args: argparse.Namespace) -> HSTUWeights:
    config = PRESETS[args.preset]
    return HSTUWeights.load(args.weights, config) if args.weights else HSTUWeights.init(config, seed=args.seed)


def cmd_score(args: argparse.Namespace) -> None:
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
    score.add_argument("--users", type=int, default=4, help="returning users")
    score.add_argument("--history-len", type=int, default=256, help="history tokens cached per user before the rounds")
    score.add_argument("--append-len", type=int, default=8, help="new history items per user per visit")
    score.add_argument("--num-candidates", type=int, default=16, help="candidates scored per visit")
    score.add_argument("--rounds", type=int, default=2, help="return visits per user")
    score.add_argument("--top-k", type=int, default=3, help="best candidates printed per request")
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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
