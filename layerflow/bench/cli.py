"""`layerflow bench` (and benchmarks/inference_benchmark.py): the flags, their per-device defaults, and the modes.

The default mode times one returning user's request per scenario and history length (`measure.run`, `report`;
`--profile` splits each into its host phases, `phases`); `--throughput` serves a Zipf stream of returning users
open-loop (`throughput`); `--serve` sends that stream through the serving layer at rising rates, in process and over
HTTP, prefetch off and on (`serving`, `serving_report`); `--ladder` tells what token-bucket ladders cost (`ladder`).
Unset flags take the device's defaults: the seed benchmark on a GPU, a small run that ends in seconds on the CPU path.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

from layerflow.bench import ladder, report, serving, serving_report, throughput
from layerflow.bench.environment import device_name
from layerflow.bench.measure import run
from layerflow.bench.scenarios import DEFAULT_SCENARIOS, SCENARIOS
from layerflow.bench.serving import ServingSettings
from layerflow.bench.serving_load import TRANSPORTS
from layerflow.bench.settings import CPU_DEFAULTS, GPU_DEFAULTS, Settings, parse_length, parse_lengths
from layerflow.bench.throughput import ThroughputSettings
from layerflow.config import Config, SignalMode, load_config
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import BATCH_BUCKETS, TOKEN_BUCKETS
from layerflow.tier.layout import KV_CACHE_DTYPES

CPU_NOTE = ("NOTE: no CUDA GPU: this ran the CPU path (tiny model, short histories, eager torch kernels, a copy "
            "thread instead of the GPU's copy engines). Its figures check the benchmark, not the runtime's speed.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by `layerflow bench` and benchmarks/inference_benchmark.py)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model shape (GPU: hstu-bench, CPU: tiny)")
    parser.add_argument("--seq-lens", type=parse_lengths, help="cached history lengths, e.g. 2K,4K,8K,16K")
    parser.add_argument("--history-len", type=parse_length, help="one cached history length (same as --seq-lens N)")
    parser.add_argument("--append-len", "--append-history-len", dest="append_len", type=int,
                        help="items appended to the history per request (GPU: 64)")
    parser.add_argument("--num-candidates", type=int, help="candidates scored per request (GPU: 256)")
    parser.add_argument("--batch-size", type=int, default=1, help="users per batch")
    parser.add_argument("--timed-iters", type=int, help="timed iterations per scenario and length (GPU: 20)")
    parser.add_argument("--warmup-iters", type=int, help="untimed iterations before them (GPU: 5)")
    parser.add_argument("--scenarios", type=lambda t: tuple(s.strip() for s in t.split(",") if s.strip()),
                        help=f"comma-separated, of {','.join(SCENARIOS)} (default: all that apply to the model: "
                             f"torch_eager is the hstu item-id block only)")
    parser.add_argument("--max-attn-len", type=int, help="sliding window W of the model's attention (0: none); a "
                        "windowed step onboards only the pages it reads")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                        help="what the KV pages hold (default: the config's, auto = the model's dtype); fp8_* halve "
                             "the bytes onboarded (docs/fp8.md). The default mode only: elsewhere set it in --config")
    parser.add_argument("--token-bucket", type=int, help="the graph bucket's query tokens (default: the batch's, rounded "
                        "up to 64); a larger one measures what padding a request costs")
    parser.add_argument("--disable-cudagraph", action="store_true", help="run the per-layer pipeline eagerly")
    parser.add_argument("--config", help="transfer YAML config (default: pools sized for the run)")
    parser.add_argument("--only-onboard", action="store_true",
                        help="skip the offload after each timed request: onboarding + block only")
    parser.add_argument("--timeline", action="store_true",
                        help="GPU only: split each layerwise request into issue / transfer / tail on the device clock")
    parser.add_argument("--profile", action="store_true",
                        help="host time per phase of every timed request (prepare / launch / collect and their parts)")
    parser.add_argument("--signal", choices=[m.value for m in SignalMode], help="per-layer signal (default: config)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    parser.add_argument("--out", help="write every figure as JSON here")
    parser.add_argument("--plot", help="write latency vs seq_len (PNG) here")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--throughput", action="store_true",
                        help="throughput mode: Zipf returning users beyond the GPU pool, open-loop arrivals")
    parser.add_argument("--rate", type=float, help="throughput mode: offered requests/s (GPU: 150)")
    parser.add_argument("--num-requests", type=int, help="throughput mode: requests in the stream (GPU: 1000)")
    parser.add_argument("--num-users", type=int, help="throughput mode: distinct returning users (GPU: 64)")
    parser.add_argument("--gpu-users", type=int, help="throughput mode: users the GPU pool holds (GPU: 16)")
    parser.add_argument("--zipf", type=float, default=1.0, help="throughput mode: Zipf exponent of popularity")
    parser.add_argument("--serve", action="store_true",
                        help="serving mode: the throughput stream through the serving layer (in process and over "
                             "HTTP, prefetch off and on) at rising offered rates, with the copy-engine/GPU bound")
    parser.add_argument("--rates", type=lambda t: tuple(float(r) for r in t.split(",") if r.strip()),
                        help="serving mode: offered requests/s, e.g. 100,200,400 (GPU: 100,200,400,800,1600)")
    parser.add_argument("--transports", type=lambda t: tuple(s.strip() for s in t.split(",") if s.strip()),
                        default=TRANSPORTS, help=f"serving mode: comma-separated, of {','.join(TRANSPORTS)}")
    parser.add_argument("--max-batch-size", type=int, help="serving mode: most requests per batch (GPU: 8)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0,
                        help="serving mode: how long a batch's oldest request waits for the batch to fill")
    parser.add_argument("--ladder", action="store_true",
                        help="ladder mode: what token-bucket ladders cost (buckets, graphs, attention configurations, "
                             "buffer and workspace bytes), nothing timed")
    parser.add_argument("--ladder-steps", type=lambda t: tuple(int(s) for s in t.split(",") if s.strip()),
                        default=(1, 2, 4, 8), help="ladder mode: token sizes per power of two, e.g. 1,4,8")
    parser.add_argument("--sms", type=int, help="ladder mode: size the attention workspaces for this many SMs "
                        "(default: the device's; 132 on an H200)")


def _picker(args: argparse.Namespace, defaults: dict[str, object]) -> Callable[[str], object]:
    """`pick(name)`: the flag's value, or the device default when the flag was not given."""
    def pick(name: str):
        value = getattr(args, name)
        return defaults[name] if value is None else value
    return pick


def _signal(args: argparse.Namespace) -> SignalMode | None:
    return None if args.signal is None else SignalMode(args.signal)


def settings_from_args(args: argparse.Namespace, device: torch.device) -> Settings:
    pick = _picker(args, GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    seq_lens = args.seq_lens or ((args.history_len,) if args.history_len else pick("seq_lens"))
    preset = pick("preset")
    model = PRESETS[preset]
    scenarios = args.scenarios or tuple(s for s in DEFAULT_SCENARIOS
                                        if s != "torch_eager" or (model.family == "hstu" and model.embedding_tables))
    return Settings(preset=preset, seq_lens=tuple(seq_lens), append_len=pick("append_len"),
                    num_candidates=pick("num_candidates"), batch_size=args.batch_size,
                    timed_iters=pick("timed_iters"), warmup_iters=pick("warmup_iters"), scenarios=scenarios,
                    use_cuda_graph=not args.disable_cudagraph, only_onboard=args.only_onboard,
                    timeline=args.timeline, profile=args.profile, signal=_signal(args), config_path=args.config,
                    seed=args.seed, max_attn_len=args.max_attn_len, token_bucket=args.token_bucket,
                    kv_cache_dtype=args.kv_cache_dtype)


def throughput_settings_from_args(args: argparse.Namespace, device: torch.device) -> ThroughputSettings:
    defaults = throughput.GPU_DEFAULTS if device.type == "cuda" else throughput.CPU_DEFAULTS
    pick = _picker(args, defaults)
    history = args.history_len or (args.seq_lens[0] if args.seq_lens else defaults["history_len"])
    return ThroughputSettings(preset=pick("preset"), history_len=history, append_len=pick("append_len"),
                              num_candidates=pick("num_candidates"), num_users=pick("num_users"),
                              gpu_users=pick("gpu_users"), num_requests=pick("num_requests"), rate=pick("rate"),
                              zipf=args.zipf, batch_size=args.batch_size, use_cuda_graph=not args.disable_cudagraph,
                              signal=_signal(args), config_path=args.config, seed=args.seed)


def serving_settings_from_args(args: argparse.Namespace, device: torch.device) -> ServingSettings:
    """Users default to four times the GPU pool's; the rest as in throughput mode, with the serving defaults."""
    defaults = serving.GPU_DEFAULTS if device.type == "cuda" else serving.CPU_DEFAULTS
    pick = _picker(args, defaults)
    gpu_users = pick("gpu_users")
    history = args.history_len or (args.seq_lens[0] if args.seq_lens else defaults["history_len"])
    rates = pick("rates")
    workload = ThroughputSettings(preset=pick("preset"), history_len=history, append_len=pick("append_len"),
                                  num_candidates=pick("num_candidates"),
                                  num_users=args.num_users or serving.USERS_PER_GPU_USER * gpu_users,
                                  gpu_users=gpu_users, num_requests=pick("num_requests"), rate=rates[0],
                                  zipf=args.zipf, batch_size=pick("max_batch_size"),
                                  use_cuda_graph=not args.disable_cudagraph, signal=_signal(args),
                                  config_path=args.config, seed=args.seed)
    return ServingSettings(workload, tuple(rates), tuple(args.transports), args.max_wait_ms)


def _publish(args: argparse.Namespace, cpu_path: bool, table: str, write_json: Callable[[Path], None],
             plot: Callable[[Path], None] | None = None) -> None:
    """The table (and the CPU-path note after it), then the JSON and the plot where the flags ask for them."""
    print(table)
    if cpu_path:
        print(CPU_NOTE)
    if args.out:
        write_json(Path(args.out))
    if args.plot and plot is not None:
        plot(Path(args.plot))


def _ladder(args: argparse.Namespace, device: torch.device) -> None:
    """The ladders' costs for the GPU's model (hstu-bench unless --preset: the CPU path's tiny model has no Triton
    attention to size)."""
    preset = args.preset or GPU_DEFAULTS["preset"]
    page_size = (load_config(args.config) if args.config else Config()).page_size
    costs = [ladder.ladder_cost(PRESETS[preset], page_size, BATCH_BUCKETS, steps, TOKEN_BUCKETS[0], TOKEN_BUCKETS[-1],
                                device, args.sms) for steps in args.ladder_steps]
    _publish(args, False, ladder.markdown(preset, costs, device, args.sms),
             lambda path: ladder.write_json(preset, costs, device, args.sms, path))


def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu_path = device.type != "cuda"
    if args.kv_cache_dtype is not None and (args.serve or args.throughput):
        raise ValueError("--kv-cache-dtype: the default mode only; set kv_cache_dtype in the --config file instead")
    if args.profile and (args.serve or args.throughput or args.ladder):
        raise ValueError("--profile times the requests of the default mode, not --throughput, --serve or --ladder")
    if args.ladder:
        _ladder(args, device)
        return
    if args.serve:
        serve = serving_settings_from_args(args, device)
    elif args.throughput:
        stream = throughput_settings_from_args(args, device)
    else:
        settings = settings_from_args(args, device)
        if settings.timeline and cpu_path:
            raise ValueError("--timeline reads CUDA events: it needs a GPU")
    if cpu_path:
        print(CPU_NOTE, flush=True)
    if args.serve:
        found = serving.run_serving(serve, device)
        _publish(args, cpu_path, serving_report.markdown(serve, found, device_name(device)),
                 lambda path: serving_report.write_json(serve, found, device, path),
                 lambda path: serving_report.plot(serve, found, device, path))
    elif args.throughput:
        runs = throughput.run_throughput(stream, device)
        _publish(args, cpu_path, throughput.markdown(stream, runs, device_name(device)),
                 lambda path: throughput.write_json(stream, runs, device, path))
    else:
        results = run(settings, device)
        _publish(args, cpu_path, report.markdown(results), lambda path: report.write_json(results, path),
                 lambda path: report.plot(results, path))
