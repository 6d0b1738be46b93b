"""The engine's KV memory: the GPU page pool and the tier below it, built from the config in one place.

The tier below is a transfer server's when the config names one (`server_socket`) or asks for a private one
(`spawn_server`), else this process's own (`InProcessTier`). A server copies straight into the engine's pool, so on
the CPU path that pool is laid over shared memory the server maps. With `remote_url` the in-process tier's host cache
has a remote store shared with other hosts below it (Redis; docs/redis.md), keyed by the model the engine names.
"""

from __future__ import annotations

import logging
import resource

import torch

from layerflow.config import Config, SignalMode
from layerflow.server import remote_tier
from layerflow.server.shm import shared_cpu_pool
from layerflow.tier.base import KVTier
from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.tier.host_cache import HostCache
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.in_process import InProcessTier
from layerflow.tier.layout import KVLayout
from layerflow.tier.remote_faults import read_secret
from layerflow.tier.remote_manifest import layout_fingerprint
from layerflow.tier.ssd import SsdStore
from layerflow.tier.ssd_directory import SsdDirectoryError
from layerflow.transfer.copy_engine import CopyEngine
from layerflow.transfer.issue_thread import IssueThreadCopyEngine
from layerflow.transfer.signals import make_signals

log = logging.getLogger(__name__)


def uses_server(config: Config) -> bool:
    return config.spawn_server or config.server_socket is not None


def resolve_signal(config: Config, device: torch.device) -> SignalMode:
    """The signal the config's `signal` stands for on `device`. `auto` is `waitvalue` for an in-process tier on CUDA
    (a GPU-side wait releases a layer without a host node waking up for it; docs/performance.md has the figures),
    else `eventfd`, the only mode a transfer server or a CPU engine can post."""
    if config.signal is not SignalMode.AUTO:
        return config.signal
    if uses_server(config) or device.type != "cuda":
        return SignalMode.EVENTFD
    return SignalMode.WAITVALUE


def check_config(config: Config, device: torch.device, num_layers: int = 0) -> None:
    """Refuse settings the KV tiers cannot serve on `device` (or a process's open-file limit: the signal ring holds
    `num_counters` x `num_layers` eventfds), before anything is allocated."""
    eventfds = config.num_counters * num_layers
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and eventfds > soft // 2:
        raise ValueError(f"num_counters={config.num_counters}: {eventfds} eventfds for {num_layers} layers, more than "
                         f"half of this process's open-file limit ({soft})")
    signal = resolve_signal(config, device)
    if uses_server(config) and signal is not SignalMode.EVENTFD:
        raise ValueError(f"signal={signal.value!r} with a transfer server: the server posts eventfds, "
                         f"use 'eventfd' or 'auto'")
    if device.type != "cuda" and signal is not SignalMode.EVENTFD:
        raise ValueError(f"signal={signal.value!r} needs CUDA; without a GPU only 'eventfd' works")
    if uses_server(config) and config.remote_url is not None:
        raise ValueError("remote_url with a transfer server: the remote tier is in-process only for now")


def issues_on_copy_thread(config: Config, signal: SignalMode) -> bool:
    """Whether the in-process tier's copies are issued on a copy thread (`copy_thread`): not with `waitvalue` signals
    and an SSD or remote tier, where a read-back failing before its first copy would be signalled from the host ahead
    of the onboardings still queued, whose graph waits share its epoch (layerflow/transfer/issue_thread.py)."""
    return config.copy_thread and not (signal is SignalMode.WAITVALUE and (config.ssd_cache_gb > 0
                                                                         or config.remote_url is not None))


# The copies a layerwise onboarding issued on the caller's thread leaves queued before the rest of its layers wait for
# the batch's launch (transfer/layer_issue.py): ~0.3 ms of copying at the H200's ~53 GB/s, longer than the host's
# prepare, fill and launch after the onboarding, so the copy engine never waits for the rest.
LEAD_BYTES = 16 << 20


def issue_path(engine: CopyEngine, config: Config, device: torch.device) -> CopyEngine:
    """`engine` as the in-process tier issues with it: a CUDA engine issues a lead of each layerwise onboarding it
    issues on the caller's thread before the launch and the rest after it (`lead_bytes`; the engine calls the tier's
    `issue_deferred` after each launch); wrapped to issue on a copy thread where `issues_on_copy_thread`, except for
    the batches `Engine.score` launches at once (`inline`)."""
    if hasattr(engine, "lead_bytes"):
        engine.lead_bytes = LEAD_BYTES
    if issues_on_copy_thread(config, resolve_signal(config, device)):
        return IssueThreadCopyEngine(engine, device)
    return engine


def build_kv(config: Config, layout: KVLayout, device: torch.device,
             copy_engine: CopyEngine | None = None, model_key: str | None = None) -> tuple[GpuKVPool, KVTier]:
    """The GPU pool sized by `gpu_cache_gb` and the tier below it. `copy_engine` replaces the in-process tier's default
    (the CUDA copy engine, or the CPU thread engine); `model_key` (layerflow.tier.remote_manifest.model_key) names the
    model to a remote tier."""
    check_config(config, device, layout.num_layers)
    if uses_server(config) and any(g.quantised for g in layout.groups):
        raise ValueError(f"an fp8 KV cache ({', '.join(str(g.dtype) for g in layout.groups)}) with a transfer server: "
                         f"the server's protocol describes pools of a model dtype only for now (kv_cache_dtype: "
                         f"auto)")
    cuda = device.type == "cuda"
    num_pages = config.blocks("gpu_cache_gb", layout.page_bytes)
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)
        if num_pages * layout.page_bytes > free:
            raise ValueError(f"gpu_cache_gb={config.gpu_cache_gb}: {num_pages * layout.page_bytes / 2**30:.2f} GiB of "
                             f"pages, only {free / 2**30:.2f} GiB free on {device}")
    if not uses_server(config):
        gpu = GpuKVPool(layout, num_pages, device)
        return gpu, in_process_tier(config, layout, gpu, copy_engine, model_key)
    shm, layers = shared_cpu_pool(layout, num_pages) if not cuda else (None, None)
    gpu = GpuKVPool(layout, num_pages, device, layers=layers)
    try:
        return gpu, remote_tier.connect(config, layout, gpu.kv, shm)
    except BaseException:
        if shm is not None:
            shm.close()
        raise


def in_process_tier(config: Config, layout: KVLayout, gpu: GpuKVPool, copy_engine: CopyEngine | None = None,
                    model_key: str | None = None, fallback: bool = False) -> InProcessTier:
    """A pinned host pool of `cpu_cache_gb`, an SSD store when `ssd_cache_gb` > 0, a Redis store when `remote_url` is
    set, the signal ring and a copy engine: `copy_engine` as given (it stays its owner's to close; wrap it in
    IssueThreadCopyEngine to have its copies issued on a thread), else a default one the tier owns, wrapped to issue
    on a thread of its own where `issues_on_copy_thread`.
    A `fallback` tier (standing in for a server that stopped answering) goes without SSD if the directories are still
    locked by that server."""
    cuda = gpu.device.type == "cuda"
    host = HostKVPool(layout, cpu_cache_gb=config.cpu_cache_gb, pin_memory=cuda)
    ssd = None
    if config.ssd_cache_gb > 0:
        try:
            ssd = SsdStore(config.ssd_cache_dirs, int(config.ssd_cache_gb * 2**30), layout.page_bytes,
                           io_threads=config.ssd_io_threads)
        except SsdDirectoryError as e:
            if not fallback:
                raise
            log.warning("the fallback tier runs without SSD: %s", e)
    remote = None
    if config.remote_url is not None:
        if model_key is None:
            raise ValueError(f"remote_url={config.remote_url!r} needs the model's key (model_key): copies of different "
                             f"models must never meet")
        from layerflow.tier.redis_store import RedisStore   # redis-py is needed only by those who use Redis

        remote = RedisStore(config.remote_url, layout, layout_fingerprint(layout, model_key),
                            namespace=config.remote_namespace, timeout_s=config.remote_timeout_s,
                            connections=config.remote_connections,
                            password=read_secret(config.remote_password_file, config.remote_password_env))
    signal = resolve_signal(config, gpu.device)
    signals = make_signals(signal, layout.num_layers, config.num_counters, config.transfer_timeout_s)
    engine, owns_engine = copy_engine, False
    if engine is None:
        engine, owns_engine = issue_path(_default_copy_engine(gpu.device), config, gpu.device), True
        if config.copy_thread and not issues_on_copy_thread(config, signal):
            log.info("copy_thread not applied: with waitvalue signals and an SSD or remote tier the copies are issued "
                     "on the calling thread")
    return InProcessTier(HostCache(host, ssd, remote, config.remote_write), layout, gpu.kv, engine, signals,
                         config.transfer_timeout_s, owns_engine=owns_engine)


def _default_copy_engine(device: torch.device) -> CopyEngine:
    if device.type == "cuda":
        from layerflow.transfer.cuda_copy import CudaCopyEngine
        return CudaCopyEngine(device=device.index or 0)
    from layerflow.transfer.thread_copy import ThreadCopyEngine
    return ThreadCopyEngine()
