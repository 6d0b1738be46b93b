"""The inference benchmark (`layerflow bench`) and the measuring pieces the scripts in benchmarks/ share.

Modules, each importing only those above it:
- `stats`: percentiles, the median/p90 summary, the layerwise pipeline's lower bound.
- `environment`: the command line and environment every results JSON starts with.
- `copy_timing`: copy engines that time their own transfers (CUDA timing events; host stamps on the CPU path).
- `recording`: `BenchCopyEngine`, which records the engine's onboardings and can skip its offloads.
- `clocks`: time stamps on the engine's device.
- `phases`: host time per phase of each timed request (`--profile`), by wrappers on one engine's parts.
- `probes`: per-layer compute, a layerwise request's timeline, onboardings timed alone against a bulk copy.
- `eager`: the eager PyTorch HSTU block, the baseline of the GPU hit.
- `workload`: synthetic returning users and one length's replayed batch.
- `scenarios`: where each scenario puts the KV, the tier it must hit, what it measures.
- `settings`: one run's validated settings and the per-device defaults.
- `measure`: the run over scenarios and lengths, and each length's lower bound.
- `report`: markdown tables, JSON and the plot of a run.
- `throughput`: the open-loop Zipf stream served with layerwise off and on.
- `serving_load`: open-loop drivers of the serving layer, in process and over HTTP, one record per request.
- `serving`: serving mode: the stream through the serving layer at rising rates, prefetch off and on, and its bound.
- `serving_report`: serving mode's table, JSON and plot.
- `ladder`: ladder mode: what a ladder of token buckets costs (buckets, graphs, buffer and workspace bytes).
- `cli`: the flags and `main`, the entry point of `layerflow bench`.
"""
