import random

import pytest
import torch

from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.transfer.copy_plan import plan_runs
from layerflow.tier.allocator import PoolExhausted, RunAllocator, runs
from layerflow.tier.user_pages import UserPages

PAGE = 4
TINY = KVLayout((LayerGroup(2, 1, 2, torch.float32),), page_size=PAGE)
TWO_GROUPS = KVLayout((LayerGroup(2, 2, 4, torch.float16), LayerGroup(1, 1, 8, torch.float32)), page_size=PAGE)


# ---------------------------------------------------------------- runs and the allocator

def test_runs():
    assert runs([]) == []
    assert runs([3]) == [(3, 1)]
    assert runs([0, 1, 2, 5, 6, 9, 4, 5]) == [(0, 3), (5, 2), (9, 1), (4, 2)]
    assert runs(torch.tensor([7, 8])) == [(7, 2)]


def paired_runs(host, gpu):
    plan = plan_runs(gpu, host)
    return list(zip(plan.run_host.tolist(), plan.run_gpu.tolist(), plan.run_len.tolist()))


def test_paired_runs_break_where_either_side_breaks():
    host = [10, 11, 12, 13, 20, 21]
    gpu = [0, 1, 5, 6, 7, 8]
    assert paired_runs(host, gpu) == [(10, 0, 2), (12, 5, 2), (20, 7, 2)]
    assert paired_runs([], []) == []
    assert paired_runs([1, 2, 3], [4, 5, 6]) == [(1, 4, 3)]
    with pytest.raises(ValueError, match="entries"):
        paired_runs([1, 2], [1])


def test_fresh_allocator_is_contiguous_and_release_merges():
    alloc = RunAllocator(10)
    a = alloc.allocate(3)
    b = alloc.allocate(4)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6]
    assert alloc.free_runs() == [(7, 3)]
    alloc.release(a)
    assert alloc.free_runs() == [(0, 3), (7, 3)]
    alloc.release([4, 6])
    assert alloc.free_runs() == [(0, 3), (4, 1), (6, 4)]
    alloc.release([5, 3])
    assert alloc.free_runs() == [(0, 10)] and alloc.num_free == 10


def test_allocator_prefers_lowest_run_that_fits():
    alloc = RunAllocator(20)
    alloc.allocate(20)
    alloc.release([1, 2, 5, 6, 7, 12, 13, 14])
    assert alloc.allocate(2) == [1, 2]  # lowest run that holds 2 whole
    assert alloc.allocate(3) == [5, 6, 7]  # skips nothing lower that fits
    assert alloc.free_runs() == [(12, 3)]


def test_fragmented_request_takes_longest_runs_then_a_fitting_one():
    alloc = RunAllocator(30)
    alloc.allocate(30)
    alloc.release([0, 4, 5, 10, 11, 12, 13, 20, 21, 22])
    got = alloc.allocate(8)
    # Longest (10..13) first, then 20..22 (next longest), then the lowest run holding the remaining 1.
    assert sorted(got) == [0, 10, 11, 12, 13, 20, 21, 22]
    assert got == [0, 10, 11, 12, 13, 20, 21, 22]  # pieces in address order
    assert runs(got) == [(0, 1), (10, 4), (20, 3)]
    assert alloc.free_runs() == [(4, 2)]


def test_allocator_errors():
    alloc = RunAllocator(4)
    pages = alloc.allocate(2)
    with pytest.raises(PoolExhausted, match="3 indices requested, 2 free of 4"):
        alloc.allocate(3)
    alloc.release(pages)
    with pytest.raises(ValueError, match="overlap"):
        alloc.release([1])
    with pytest.raises(ValueError, match="out of range"):
        alloc.release([4])
    with pytest.raises(ValueError, match="twice"):
        alloc.release([2, 2])
    with pytest.raises(ValueError, match="count"):
        alloc.allocate(-1)


def test_growth_continues_after_last_page():
    pool = UserPages(16, PAGE)
    pool.allocate("a", 8)
    pool.allocate("b", 8)
    pool.free("b")
    assert pool.allocate("a", 20).pages == (0, 1, 2, 3, 4)
    assert runs(pool.pages("a")) == [(0, 5)]


def test_fragmentation_then_allocation_yields_correct_runs():
    pool = GpuKVPool(TINY, num_pages=16)
    for user in range(8):
        pool.allocate(user, 2 * PAGE)
    for user in (1, 3, 5, 7):
        pool.free(user)
    assert pool.allocator.free_runs() == [(2, 2), (6, 2), (10, 2), (14, 2)]
    got = pool.allocate("new", 5 * PAGE - 1)
    assert got.pages == got.new == (2, 3, 6, 7, 10)
    assert runs(got.pages) == [(2, 2), (6, 2), (10, 1)]
    host = HostKVPool(TINY, num_blocks=8, pin_memory=False)
    host.allocate("new", 5 * PAGE)
    assert host.pages("new") == (0, 1, 2, 3, 4)
    assert paired_runs(host.pages("new"), got.pages) == [(0, 2, 2), (2, 6, 2), (4, 10, 1)]


# ---------------------------------------------------------------- churn with invariants

def check_invariants(pool, model_tokens, pins):
    owned = [p for user in pool.users() for p in pool.pages(user)]
    free = [i for start, length in pool.allocator.free_runs() for i in range(start, start + length)]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert sorted(owned + free) == list(range(pool.total)), "pages leaked or double-listed"
    assert pool.num_free == len(free)
    assert set(pool.users()) == set(model_tokens)
    for user, tokens in model_tokens.items():
        assert len(pool.pages(user)) == -(-tokens // PAGE)
    for user, count in pins.items():
        assert user in pool and pool.pin_count(user) == count


def check_eviction(evicted, order, sizes, free_before, target, eligible):
    """Evicted = the shortest LRU-first prefix of eligible users that reaches `target` (or all of them)."""
    candidates = [u for u in order if eligible(u)]
    assert list(evicted) == candidates[: len(evicted)], "eviction skipped an older eligible user"
    freed = free_before + sum(sizes[u] for u in evicted)
    if len(evicted) < len(candidates):
        assert freed >= target
    if evicted:
        assert freed - sizes[evicted[-1]] < target, "evicted more users than needed"


def snapshot(pool):
    return [(u, pool.pages(u), pool.pin_count(u)) for u in pool.users()], pool.allocator.free_runs()


@pytest.mark.parametrize("kind", ["gpu_pool", "host_pool"])
def test_churn_invariants(kind):
    rng = random.Random(1234 if kind == "gpu_pool" else 4321)
    total = 48
    if kind == "gpu_pool":
        pool = GpuKVPool(TINY, num_pages=total)
    else:
        pool = HostKVPool(TINY, num_blocks=total, pin_memory=False)
    tokens: dict[int, int] = {}
    pins: dict[int, int] = {}
    offloaded: set[int] = set()
    order: list[int] = []  # model of recency, least recent first
    counts = dict.fromkeys(["alloc", "exhausted", "too_big", "evicted", "free", "pinned_free"], 0)

    def bump(user):
        if user in order:
            order.remove(user)
        order.append(user)

    def forget(user):
        order.remove(user)
        del tokens[user]
        offloaded.discard(user)

    for _ in range(3000):
        op = rng.choices(["alloc", "free", "touch", "pin", "unpin", "evict", "offload"],
                         weights=[8, 2, 2, 2, 2, 1, 2])[0]
        resident = sorted(tokens)
        if op == "alloc":
            user = rng.randrange(40)
            want = tokens.get(user, 0) + rng.choice([0, 1, 5, 17, 40, 90]) if user in tokens else rng.randrange(120)
            if rng.random() < 0.02:
                want = total * PAGE + 1
            use_hook = kind == "gpu_pool" or rng.random() < 0.5
            can_drop = (lambda u: u in offloaded) if use_hook else None
            eligible = (lambda u, user=user, can_drop=can_drop:
                        u != user and u not in pins and (can_drop is None or can_drop(u)))
            sizes = {u: len(pool.pages(u)) for u in resident}
            before, free_before = snapshot(pool), pool.num_free
            need = -(-want // PAGE) - sizes.get(user, 0)
            try:
                got = pool.allocate(user, want, can_drop)
            except ValueError:
                assert -(-want // PAGE) > total
                assert snapshot(pool) == before
                counts["too_big"] += 1
                continue
            except PoolExhausted:
                assert free_before + sum(sizes[u] for u in resident if eligible(u)) < need
                assert snapshot(pool) == before
                counts["exhausted"] += 1
                continue
            if need > free_before:
                check_eviction(got.evicted, list(order), sizes, free_before, need, eligible)
            else:
                assert got.evicted == ()
            for victim in got.evicted:
                forget(victim)
            counts["evicted"] += len(got.evicted)
            counts["alloc"] += 1
            tokens[user] = max(want, tokens.get(user, 0))
            bump(user)
            assert got.pages == pool.pages(user) and set(got.new) <= set(got.pages)
        elif op == "free" and resident:
            user = rng.choice(resident)
            if user in pins:
                with pytest.raises(ValueError, match="pinned"):
                    pool.free(user)
                counts["pinned_free"] += 1
            else:
                pool.free(user)
                forget(user)
                counts["free"] += 1
        elif op == "touch" and resident:
            user = rng.choice(resident)
            pool.touch(user)
            bump(user)
        elif op == "pin" and resident:
            user = rng.choice(resident)
            pool.pin(user)
            pins[user] = pins.get(user, 0) + 1
        elif op == "unpin" and pins:
            user = rng.choice(sorted(pins))
            pool.unpin(user)
            pins[user] -= 1
            if not pins[user]:
                del pins[user]
        elif op == "evict":
            target = rng.randrange(total + 1)
            sizes = {u: len(pool.pages(u)) for u in resident}
            free_before = pool.num_free
            evicted = pool.evict_until(target, lambda u: u in offloaded)
            check_eviction(evicted, list(order), sizes, free_before, target,
                           lambda u: u not in pins and u in offloaded)
            for victim in evicted:
                forget(victim)
            counts["evicted"] += len(evicted)
        elif op == "offload" and resident:
            offloaded.symmetric_difference_update({rng.choice(resident)})
        assert pool.users() == order
        check_invariants(pool, tokens, pins)
    # The workload must have exercised every path it checks.
    assert all(counts.values()), counts


# ---------------------------------------------------------------- GPU pool

def test_gpu_pool_tensors_per_layer():
    pool = GpuKVPool(TWO_GROUPS, num_pages=5)
    assert [tuple(t.shape) for t in pool.kv] == [(5, 2, PAGE, 2, 4)] * 2 + [(5, 2, PAGE, 1, 8)]
    assert [t.dtype for t in pool.kv] == [torch.float16, torch.float16, torch.float32]
    assert pool.kv[0].data_ptr() != pool.kv[1].data_ptr()


def test_gpu_pool_never_evicts_without_hook_and_respects_pins():
    pool = GpuKVPool(TINY, num_pages=4)
    pool.allocate("a", 2 * PAGE)
    pool.allocate("b", 2 * PAGE)
    with pytest.raises(PoolExhausted, match=r"user 'c': 8 tokens need 2 more pages; 0 free of 4"):
        pool.allocate("c", 2 * PAGE)
    pool.pin("a")
    with pytest.raises(PoolExhausted):
        pool.allocate("c", 3 * PAGE, can_drop=lambda u: True)  # only b may go: 2 pages < 3
    assert set(pool.users()) == {"a", "b"}
    got = pool.allocate("c", 2 * PAGE, can_drop=lambda u: True)
    assert got.evicted == ("b",) and got.pages == (2, 3)
    assert pool.evict_until(4, lambda u: True) == ["c"]  # a stays pinned
    pool.unpin("a")
    assert pool.evict_until(4, lambda u: u != "a") == []
    assert pool.evict_until(4, lambda u: True) == ["a"]
    assert pool.num_free == 4


def test_gpu_pool_eviction_follows_touch_order():
    pool = GpuKVPool(TINY, num_pages=6)
    for user in ("a", "b", "c"):
        pool.allocate(user, 2 * PAGE)
    pool.touch("a")
    assert pool.users() == ["b", "c", "a"]
    assert pool.evict_until(4, lambda u: True) == ["b", "c"]


def test_pin_counts_and_errors():
    pool = GpuKVPool(TINY, num_pages=4)
    pool.allocate("a", 1)
    pool.pin("a")
    pool.pin("a")
    pool.unpin("a")
    assert pool.pin_count("a") == 1
    with pytest.raises(ValueError, match="pinned 1 time"):
        pool.free("a")
    pool.unpin("a")
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin("a")
    with pytest.raises(ValueError, match="holds no pages"):
        pool.pin("ghost")
    with pytest.raises(ValueError, match="holds no pages"):
        pool.pages("ghost")
    pool.free("a")
    assert pool.num_free == 4


def test_user_that_can_never_fit():
    pool = GpuKVPool(TINY, num_pages=4)
    with pytest.raises(ValueError, match=r"17 tokens need 5 pages of 4 tokens, but the pool has 4 pages in all"):
        pool.allocate(7, 17)
    host = HostKVPool(TINY, num_blocks=2, pin_memory=False)
    with pytest.raises(ValueError, match=r"9 tokens need 3 blocks of 4 tokens, but the pool has 2 blocks in all"):
        host.allocate(7, 9)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.allocate(7, -1)


def test_allocate_shorter_keeps_pages():
    pool = GpuKVPool(TINY, num_pages=4)
    pool.allocate("a", 3 * PAGE)
    got = pool.allocate("a", PAGE)
    assert got.pages == (0, 1, 2) and got.new == ()
    assert pool.capacity_tokens("a") == 3 * PAGE


# ---------------------------------------------------------------- host pool

def test_host_pool_shapes_and_sizing():
    pool = HostKVPool(TWO_GROUPS, num_blocks=3, pin_memory=False)
    assert [tuple(t.shape) for t in pool.blocks] == [(3, 2, 2, PAGE, 2, 4), (3, 1, 2, PAGE, 1, 8)]
    assert pool.blocks[0].stride(0) * 2 == TWO_GROUPS.host_pitch(0)
    gb = 10 * TWO_GROUPS.page_bytes / 2**30
    assert HostKVPool(TWO_GROUPS, cpu_cache_gb=gb, pin_memory=False).total == 10
    with pytest.raises(ValueError, match="give one"):
        HostKVPool(TINY, num_blocks=2, cpu_cache_gb=1.0)
    with pytest.raises(ValueError, match="one of them"):
        HostKVPool(TINY)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_host_pool_pin_without_cuda():
    with pytest.raises(ValueError, match="pin_memory=True"):
        HostKVPool(TINY, num_blocks=2, pin_memory=True)
    assert HostKVPool(TINY, num_blocks=2).pinned is False


def test_host_pool_evicts_lru_unpinned_by_default():
    pool = HostKVPool(TINY, num_blocks=6, pin_memory=False)
    for user in ("a", "b", "c"):
        pool.allocate(user, 2 * PAGE)
    pool.pin("a")
    got = pool.allocate("d", 3 * PAGE)
    assert got.evicted == ("b", "c") and set(got.pages) == {2, 3, 4}
    assert pool.users() == ["a", "d"]
    with pytest.raises(PoolExhausted):
        pool.allocate("e", 3 * PAGE, can_drop=lambda u: u != "d")  # vetoed: nothing evicted
    assert pool.users() == ["a", "d"]


def test_host_pool_over_given_buffer():
    nbytes = 4 * TWO_GROUPS.page_bytes + 7
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    pool = HostKVPool(TWO_GROUPS, buffer=buffer)
    assert pool.total == 4 and not pool.pinned
    pool.blocks[0][3, 1] = 1.0
    pool.blocks[1][0, 0] = 2.0
    rest = buffer.clone()
    start = 3 * TWO_GROUPS.block_bytes(0) + TWO_GROUPS.layer_page_bytes(0)
    assert buffer[start:start + TWO_GROUPS.layer_page_bytes(0)].view(torch.float16).eq(1.0).all()
    rest[start:start + TWO_GROUPS.layer_page_bytes(0)] = 0
    start = 4 * TWO_GROUPS.block_bytes(0)
    assert buffer[start:start + TWO_GROUPS.layer_page_bytes(1)].view(torch.float32).eq(2.0).all()
    rest[start:start + TWO_GROUPS.layer_page_bytes(1)] = 0
    assert not rest.any()  # the writes landed nowhere else
    assert HostKVPool(TWO_GROUPS, buffer=buffer, num_blocks=2).total == 2
    with pytest.raises(ValueError, match="num_blocks=5"):
        HostKVPool(TWO_GROUPS, buffer=buffer, num_blocks=5)
    with pytest.raises(ValueError, match="uint8"):
        HostKVPool(TWO_GROUPS, buffer=torch.zeros(100, dtype=torch.float32))
    with pytest.raises(ValueError, match="pin_memory=True"):
        HostKVPool(TWO_GROUPS, buffer=buffer, pin_memory=True)


@pytest.mark.gpu
def test_pools_on_cuda():
    pool = GpuKVPool(TWO_GROUPS, num_pages=4, device="cuda")
    assert all(t.is_cuda for t in pool.kv)
    pool.allocate("a", 2 * PAGE)
    assert pool.pages("a") == (0, 1)
    host = HostKVPool(TWO_GROUPS, num_blocks=4)
    assert host.pinned and all(t.is_pinned() for t in host.blocks)
