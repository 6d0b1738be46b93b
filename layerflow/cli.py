"""The `layerflow` command line."""

from __future__ import annotations

import argparse
import time

import torch

from layerflow.hstu import HSTUWeights, JaggedBatch, cached_forward
from layerflow.hstu.config import PRESETS
from layerflow.runtime.workload import Request, returning_users


class ReferenceScorer:
    """Scores requests through the model's reference cached path, keeping every user's K/V in memory."""

    def __init__(self, weights: HSTUWeights):
        self.weights = weights
        cfg = weights.config
        self.cache: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._empty = ([torch.zeros(0, cfg.num_heads, cfg.dqk, dtype=cfg.dtype)] * cfg.num_layers,
                       [torch.zeros(0, cfg.num_heads, cfg.dv, dtype=cfg.dtype)] * cfg.num_layers)

    def score(self, requests: list[Request]) -> list[torch.Tensor]:
        cfg = self.weights.config
        past = [self.cache.get(r.user_id, self._empty) for r in requests]
        batch = JaggedBatch.from_lists(cfg, [p[0][0].shape[0] for p in past], [r.items for r in requests],
                                       [r.candidates for r in requests])
        ks = [torch.cat([p[0][l] for p in past]) for l in range(cfg.num_layers)]
        vs = [torch.cat([p[1][l] for p in past]) for l in range(cfg.num_layers)]
        out = cached_forward(self.weights, batch, ks, vs)
        ao, co = batch.appended_offsets.tolist(), batch.candidate_offsets.tolist()
        for b, (r, p) in enumerate(zip(requests, past)):
            self.cache[r.user_id] = ([torch.cat([p[0][l], out.new_k[l][ao[b]:ao[b + 1]]]) for l in range(cfg.num_layers)],
                                     [torch.cat([p[1][l], out.new_v[l][ao[b]:ao[b + 1]]]) for l in range(cfg.num_layers)])
        return [out.scores[co[b]:co[b + 1]] for b in range(len(requests))]


def _weights(args: argparse.Namespace) -> HSTUWeights:
    config = PRESETS[args.preset]
    return HSTUWeights.load(args.weights, config) if args.weights else HSTUWeights.init(config, seed=args.seed)


def cmd_score(args: argparse.Namespace) -> None:
    weights = _weights(args)
    scorer = ReferenceScorer(weights)
    first, rounds = returning_users(args.users, args.history_len, args.append_len, args.num_candidates, args.rounds,
                                    weights.config.item_vocab_size, seed=args.seed)
    scorer.score(first)
    print(f"model {args.preset}: {args.users} users with {args.history_len} cached tokens each")
    for i, requests in enumerate(rounds):
        for r in requests:
            start = time.perf_counter()
            scores = scorer.score([r])[0]
            ms = (time.perf_counter() - start) * 1e3
            top = scores.topk(min(args.top_k, scores.numel()))
            best = ", ".join(f"{r.candidates[j]}:{s:.3f}" for s, j in zip(top.values.tolist(), top.indices.tolist()))
            print(f"round {i} user {r.user_id}: {ms:7.2f} ms  top-{args.top_k} [{best}]")


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
    score.set_defaults(func=cmd_score)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
