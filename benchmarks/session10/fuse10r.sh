#!/usr/bin/env bash
# fuse10r (round 2, <= 60 s): CUDA tests of the new SiLU-in-append kernel and the reserved shared workspace, then (1) kernels per request at 2K (BS=1, 320-token exact bucket), SiLU in the KV append (the new default)
# vs its own kernel, in the order append, separate, append (is round 1's 510 vs 416 us device span real?),
# and (2) the BS=8 case of the default ladder: 8 x 320 query tokens in the (8, 4096) bucket, graph vs eager (before
# TOKEN_BUCKETS reached 4096 no graph fitted and the batch ran eagerly). Runs from the repo root; files under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | head -2

echo "=== GPU tests (the engine-level ones, tests/runtime/test_kernel_choices_gpu.py, run in the final GPU suite) ==="
timeout 20 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_activated_append.py \
  tests/kernels/test_workspace.py tests/runtime/test_kernel_choices.py > "$OUT/tests_cuda.log" 2>&1
rc=$?; echo "kernel tests on CUDA (fused append vs F.silu + reference append bitwise, hstu-bench sizes, fp8 pages; reserve): rc=$rc $(tail -1 "$OUT/tests_cuda.log")"
[ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests_cuda.log" | head -20
echo "elapsed $(( $(date +%s) - start )) s"

cat > "$OUT/fuse10r_bench.py" <<'EOF'
import gc, json, os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
from kernel_breakdown import breakdown
from layerflow.bench.settings import GPU_DEFAULTS, Settings
from layerflow.bench.measure import transfer_config
from layerflow.bench.workload import Workload, first_visit
from layerflow.model import HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.pipeline import SILU_ENV

budget = float(sys.argv[1])
t_end = time.monotonic() + budget
out_dir = os.environ.get("OUT", "/tmp/out")
device = torch.device("cuda")
settings = Settings(**{**GPU_DEFAULTS, "seq_lens": (2048,), "batch_size": 1, "scenarios": ("gpu_hit",)})
weights = HSTUWeights.init(settings.model, seed=0)
config = transfer_config(settings, None)
results = {"breakdown": [], "bs8": {}}


def elapsed():
    return budget - (t_end - time.monotonic())


def grouped(rows):
    g = {}
    for r in rows:
        n, us = g.get(r["group"], (0.0, 0.0))
        g[r["group"]] = (n + r["count"], us + r["us"])
    return g


def fresh():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def save():
    with open(f"{out_dir}/fuse10r.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


w = Workload.build([0], 2048, settings.append_len, settings.num_candidates, settings.model, 0)
for mode in ("append", "separate", "append"):
    if t_end - time.monotonic() < 4:
        print(f"skip {mode}: budget", flush=True)
        continue
    os.environ[SILU_ENV] = mode
    fresh()
    with Engine(weights, config, device=device, batch_buckets=(1,), token_buckets=(settings.query_tokens,)) as e:
        e.warmup()
        w.load(e)
        rows, spans = breakdown(e, w, 10)
        w.drop(e)
    g = grouped(rows)
    results["breakdown"].append({"mode": mode, "groups": g, "spans_us": spans, "rows": rows})
    save()
    print(f"[{mode}] done at {elapsed():.1f} s", flush=True)
os.environ.pop(SILU_ENV, None)

runs = results["breakdown"]
if runs:
    groups = sorted({k for r in runs for k in r["groups"]}, key=lambda k: -runs[0]["groups"].get(k, (0, 0))[1])
    print("\n### kernels per request at 2K (BS=1, 320-token exact bucket), runs in order: kernels / us")
    print("| group | " + " | ".join(r["mode"] for r in runs) + " |\n|---|" + "---|" * len(runs))
    for k in groups:
        print(f"| {k} | " + " | ".join("%.0f / %.1f" % tuple(r["groups"].get(k, (0, 0))) for r in runs) + " |")
    print("| **all** | " + " | ".join("%.0f / %.1f" % tuple(sum(v[i] for v in r["groups"].values()) for i in (0, 1))
                                   for r in runs) + " |")
    print("| device span median us | " + " | ".join(f"{statistics.median(r['spans_us']):.1f}" if r["spans_us"]
                                                   else "-" for r in runs) + " |")
    for r in runs[:2]:
        ka = [x for x in r["rows"] if x["group"] in ("KV append", "other pointwise")]
        print(f"  {r['mode']}: " + "; ".join(f"{x['kernel'][:50]} x{x['count']:.0f} {x['us']:.1f}us" for x in ka))

# BS=8 x 320 query tokens in the default ladder's (8, 4096) bucket: its graph against the same bucket run eagerly.
if t_end - time.monotonic() > 8:
    fresh()
    w8 = Workload.build(list(range(8)), 2048, settings.append_len, settings.num_candidates, settings.model, 0)
    config8 = transfer_config(Settings(**{**GPU_DEFAULTS, "seq_lens": (2048,), "batch_size": 8,
                                          "scenarios": ("gpu_hit",)}), None)   # pools for 8 users
    with Engine(weights, config8, device=device, batch_buckets=(8,), token_buckets=(4096,)) as e:
        t0 = time.perf_counter()
        e.warmup()
        results["bs8"]["warmup_s"] = time.perf_counter() - t0
        for u, h in w8.histories.items():   # one user a batch: (1, 2048) fits the bucket's graph, no new shapes
            e.score([first_visit(u, h)])
        e.kv.wait_offloads()
        b = e._bucket(8, 8 * settings.query_tokens)
        results["bs8"]["bucket"] = f"{b.max_batch}x{b.max_tokens}"

        def hit():
            e.kv.wait_offloads()
            for r in w8.requests:
                e.kv.truncate(r.user_id, 2048)
            t = time.perf_counter()
            e.score(w8.requests)
            return (time.perf_counter() - t) * 1e3

        graphs = e.graphs
        for label, runner in (("graph", graphs), ("eager", None), ("graph", graphs)):
            if t_end - time.monotonic() < 2:
                break
            e.graphs = runner
            for _ in range(3):
                hit()
            times = sorted(hit() for _ in range(15))
            results["bs8"].setdefault(label, []).append(statistics.median(times))
            save()
        e.graphs = graphs
        w8.drop(e)
    print(f"\n### BS=8 x 320 tokens, 2K history, GPU hit in bucket {results['bs8'].get('bucket')} (warm-up "
          f"{results['bs8'].get('warmup_s', 0):.1f} s): median ms graph {results['bs8'].get('graph')} | eager "
          f"{results['bs8'].get('eager')}", flush=True)
save()
EOF

left=$(( 57 - ($(date +%s) - start) ))
[ $left -lt 8 ] && left=8
echo "=== breakdown A/B + BS=8 (budget ${left} s) ==="
timeout $left python3 "$OUT/fuse10r_bench.py" $(( left - 2 )) > "$OUT/bench.log" 2>&1
echo "rc=$?"; grep -v "^\s*$" "$OUT/bench.log" | grep -v -i warn | tail -40
echo "elapsed $(( $(date +%s) - start )) s"
tar czf "$OUT/fuse10r.tgz" -C "$OUT" --exclude fuse10r.tgz . 2>/dev/null
