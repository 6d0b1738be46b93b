"""One suite for every tier below the GPU: the in-process tier and a transfer server's must behave the same.

Each test runs three times, through the `KVTier` interface only: on an in-process tier, on a transfer server (a real
server on a Unix socket, in a thread of this process so the suite stays fast; tests/server covers the process), and
on an in-process tier of an fp8 KV cache, whose pages are bytes of codes and scale rows (every comparison is of whole
pages, scale rows included).
"""

import threading

import pytest
import torch

from layerflow.config import Config
from layerflow.runtime.tiers import build_kv
from layerflow.server import TransferServer
from layerflow.tier.base import Load, NotResident, Tier
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.transfer.errors import TransferError

LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float32), LayerGroup(1, 1, 16, torch.bfloat16)), 4)
FP8_LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float8_e4m3fn), LayerGroup(1, 1, 16, torch.float8_e5m2)), 4)
PAGE = LAYOUT.page_size
GPU_PAGES = 32
HOST_BLOCKS = 10


def gb(blocks: int, layout: KVLayout = LAYOUT) -> float:
    return (blocks + 0.5) * layout.page_bytes / 2**30


@pytest.fixture(params=["in_process", "server", "in_process_fp8"])
def tier_of(request, tmp_path):
    """`tier_of(**config)` -> (gpu pool, tier); everything is closed after the test."""
    made = []
    layout = FP8_LAYOUT if request.param.endswith("fp8") else LAYOUT

    def make(**overrides):
        values = dict(cpu_cache_gb=gb(HOST_BLOCKS, layout), gpu_cache_gb=gb(GPU_PAGES, layout), ssd_cache_gb=0.001,
                      ssd_cache_dir=str(tmp_path / "ssd"), transfer_timeout_s=10.0, num_counters=2)
        values.update(overrides)
        if request.param == "server":
            server = TransferServer(Config(**values), tmp_path / "run")
            threading.Thread(target=server.serve_forever, daemon=True).start()
            made.append(server)
            values = dict(gpu_cache_gb=values["gpu_cache_gb"], server_socket=str(server.socket_path),
                          transfer_timeout_s=10.0, num_counters=2)
        gpu, tier = build_kv(Config(**values), layout, torch.device("cpu"))
        made.append(tier)
        return gpu, tier

    yield make
    for thing in reversed(made):
        thing.close()


def fill(gpu, pages, seed: int) -> list[torch.Tensor]:
    """Random K/V (random bytes in an fp8 cache: codes and scales) in `pages` of every layer; returns a copy of the
    whole pool."""
    g = torch.Generator().manual_seed(seed)
    for t in gpu.kv:
        shape = t[list(pages)].shape
        if t.dtype == torch.uint8:
            t[list(pages)] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        else:
            t[list(pages)] = torch.randn(shape, generator=g).to(t.dtype)
    return [t.clone() for t in gpu.kv]


def offload(tier, user: int, tokens: int, pages) -> None:
    tier.offload(user, tokens, list(pages)).wait(10)
    tier.reap()


def onboard(tier, gpu, loads: list[tuple[int, int, list[int]]]) -> None:
    """Onboard `(user, tokens, gpu_pages)` loads on one counter, wait for every layer, finish."""
    for t in gpu.kv:
        for _, _, pages in loads:
            t[pages] = 0xFF if t.dtype == torch.uint8 else float("nan")
    onboarding = tier.onboard([Load(u, tier.locate(u, n), n, tuple(p)) for u, n, p in loads], layerwise=True)
    try:
        for layer in range(LAYOUT.num_layers):
            onboarding.handle.wait_layer(layer, 10)
    finally:
        onboarding.finish(wait=True)


def failure_of(tier, gpu, loads) -> BaseException:
    """The error an onboarding reports, raised by `onboard` or by its layers' waits (either is allowed)."""
    try:
        onboard(tier, gpu, loads)
    except (NotResident, TransferError) as e:
        return e
    raise AssertionError("the onboarding did not fail")


def not_resident_users(error: BaseException) -> list:
    while error is not None and not isinstance(error, NotResident):
        error = error.__cause__
    assert error is not None, "no NotResident in the cause chain"
    return error.users


def same(gpu, dst, expected, src) -> bool:
    return all(torch.equal(t[dst], e[src]) for t, e in zip(gpu.kv, expected))


def test_a_host_copy_round_trips_byte_exact_and_unpins(tier_of):
    gpu, tier = tier_of()
    expected = fill(gpu, range(4), seed=1)
    offload(tier, 7, 14, range(4))
    assert tier.locate(7, 14) is Tier.HOST and tier.locate(7, 15) is Tier.NONE and tier.locate(8, 1) is Tier.NONE
    onboard(tier, gpu, [(7, 14, [10, 11, 12, 13])])
    assert same(gpu, [10, 11, 12, 13], expected, [0, 1, 2, 3])
    usage = tier.usage()
    assert (usage.host_users, usage.host_blocks, usage.pinned_users) == (1, 4, 0)


def test_an_offload_copies_only_the_pages_the_copy_does_not_hold(tier_of):
    gpu, tier = tier_of()
    old = fill(gpu, range(4), seed=2)
    offload(tier, 1, 6, range(2))                 # one full page and half of the next
    new = fill(gpu, range(4), seed=3)             # every GPU page changes
    offload(tier, 1, 16, range(4))
    onboard(tier, gpu, [(1, 16, [20, 21, 22, 23])])
    assert same(gpu, [20], old, [0])              # the held page was not copied again
    assert same(gpu, [21, 22, 23], new, [1, 2, 3])


def test_a_truncated_copy_serves_only_its_prefix(tier_of):
    gpu, tier = tier_of()
    expected = fill(gpu, range(3), seed=4)
    offload(tier, 2, 12, range(3))
    tier.truncate(2, 5)
    assert tier.locate(2, 6) is Tier.NONE and tier.locate(2, 5) is Tier.HOST
    onboard(tier, gpu, [(2, 5, [8, 9])])
    assert same(gpu, [8, 9], expected, [0, 1])
    fill(gpu, range(3), seed=5)
    offload(tier, 2, 12, range(3))                # from the first page that is not wholly valid: pages 1 and 2
    assert tier.locate(2, 12) is Tier.HOST


def test_evict_moves_a_user_to_ssd_and_an_ssd_hit_is_byte_exact(tier_of):
    gpu, tier = tier_of()
    expected = fill(gpu, range(3), seed=6)
    offload(tier, 3, 11, range(3))
    tier.evict(3)
    assert tier.locate(3, 11) is Tier.SSD and tier.usage().host_users == 0
    onboard(tier, gpu, [(3, 11, [5, 6, 7])])
    assert same(gpu, [5, 6, 7], expected, [0, 1, 2])
    assert tier.locate(3, 11) is Tier.HOST        # read back into the host, where it is served next time


def test_a_full_host_spills_its_least_recent_user_to_ssd(tier_of):
    gpu, tier = tier_of()
    expected = fill(gpu, range(12), seed=7)
    offload(tier, 1, 16, range(0, 4))
    offload(tier, 2, 16, range(4, 8))
    offload(tier, 3, 16, range(8, 12))            # 12 blocks > 10: user 1, the least recent, goes down
    assert [tier.locate(u, 16) for u in (1, 2, 3)] == [Tier.SSD, Tier.HOST, Tier.HOST]
    onboard(tier, gpu, [(2, 16, [16, 17, 18, 19]), (1, 16, [20, 21, 22, 23])])   # a host and an SSD user together
    assert same(gpu, [16, 17, 18, 19], expected, [4, 5, 6, 7])
    assert same(gpu, [20, 21, 22, 23], expected, [0, 1, 2, 3])
    assert tier.locate(2, 16) is Tier.HOST        # pinned by the onboarding: never spilled for user 1's read-back
    assert tier.usage().pinned_users == 0


def test_a_damaged_ssd_copy_is_not_resident_and_never_served(tier_of, tmp_path):
    gpu, tier = tier_of()
    fill(gpu, range(3), seed=8)
    offload(tier, 4, 12, range(3))
    tier.evict(4)
    files = [p for p in (tmp_path / "ssd").iterdir() if p.suffix == ".kv"]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[gpu.layout.page_bytes // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    assert not_resident_users(failure_of(tier, gpu, [(4, 12, [0, 1, 2])])) == [4]
    assert tier.locate(4, 12) is Tier.NONE
    usage = tier.usage()
    assert (usage.host_users, usage.ssd_users, usage.pinned_users) == (0, 0, 0)


def test_an_onboarding_of_a_user_not_held_names_it_and_leaves_the_others(tier_of):
    gpu, tier = tier_of()
    fill(gpu, range(2), seed=9)
    offload(tier, 5, 8, range(2))
    error = failure_of(tier, gpu, [(5, 8, [3, 4]), (6, 4, [5])])
    assert 6 in not_resident_users(error)
    assert tier.locate(5, 8) is Tier.HOST and tier.usage().pinned_users == 0


def test_drop_forgets_the_host_and_ssd_copies(tier_of):
    gpu, tier = tier_of()
    fill(gpu, range(4), seed=10)
    offload(tier, 1, 8, range(2))
    offload(tier, 2, 8, range(2, 4))
    tier.evict(2)
    tier.drop(1)
    tier.drop(2)
    assert tier.locate(1, 8) is Tier.NONE and tier.locate(2, 8) is Tier.NONE
    usage = tier.usage()
    assert (usage.host_users, usage.host_blocks, usage.ssd_users) == (0, 0, 0)


def test_a_user_that_can_never_fit_the_host_fails_its_offload_clearly(tier_of):
    gpu, tier = tier_of()
    fill(gpu, range(12), seed=11)
    with pytest.raises((ValueError, TransferError), match="11 blocks|pool has 10"):
        tier.offload(9, 44, list(range(11))).wait(10)
    tier.reap()
    assert tier.locate(9, 44) is Tier.NONE and tier.usage().pinned_users == 0
