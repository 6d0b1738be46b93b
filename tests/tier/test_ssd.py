"""SSD tier: round trip, restart, corruption and torn writes are misses, LRU eviction."""

import os

import pytest
import torch

from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views

BLOCKS = 12
SHAPES = [(BLOCKS, 2, 2, 8, 2, 64), (BLOCKS, 1, 2, 8, 1, 48)]  # two layer groups, one unaligned


def host(seed: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randn(s, generator=g) if g else torch.zeros(s) for s in SHAPES]


def block_bytes() -> int:
    return sum(t[0].numel() * t.element_size() for t in host(0))


def make(tmp_path, capacity_blocks: int = 100, **kw) -> SsdStore:
    store = SsdStore([tmp_path / "ssd"], capacity_blocks * SsdStore.slot_size(block_bytes()), block_bytes(),
                     io_threads=2, group_blocks=3, **kw)
    return store


def user_file(store: SsdStore, user: str):
    entry = store._entries[user]
    return store.dirs[entry.dir_index] / entry.file


def test_round_trip_and_group_callbacks(tmp_path):
    store = make(tmp_path)
    src, dst = host(1), host()
    store.store("alice", tensor_block_views(src), [0, 2, 4, 6, 8])
    landed = []
    store.load("alice", tensor_block_views(dst), [1, 3, 5, 7, 9], on_group=landed.append)
    assert landed == [[1, 3, 5], [7, 9]]
    for s, d in zip(src, dst):
        assert torch.equal(s[[0, 2, 4, 6, 8]], d[[1, 3, 5, 7, 9]])
        assert not d[[0, 2, 4]].any()
    assert store.contains("alice") and store.num_blocks("alice") == 5


def test_restart_recovers_index_and_drops_orphans(tmp_path):
    store = make(tmp_path)
    src = host(2)
    store.store("bob", tensor_block_views(src), [3, 4])
    store.close()
    orphan = tmp_path / "ssd" / "deadbeef-99.kv"
    orphan.write_bytes(b"x" * 10)
    again = make(tmp_path)
    assert again.users() == ["bob"]
    assert not orphan.exists()
    dst = host()
    again.load("bob", tensor_block_views(dst), [0, 1])
    for s, d in zip(src, dst):
        assert torch.equal(s[[3, 4]], d[[0, 1]])


def test_flipped_byte_is_a_miss_and_dropped(tmp_path):
    store = make(tmp_path)
    store.store("carol", tensor_block_views(host(3)), [0, 1, 2, 3])
    path = user_file(store, "carol")
    with open(path, "r+b") as f:
        f.seek(store.slot_bytes * 2 + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(Miss, match="checksum"):
        store.load("carol", tensor_block_views(host()), [0, 1, 2, 3])
    assert not store.contains("carol") and not path.exists()


def test_truncated_file_is_a_miss(tmp_path):
    store = make(tmp_path)
    store.store("dave", tensor_block_views(host(4)), [0, 1, 2, 3])
    os.truncate(user_file(store, "dave"), store.slot_bytes * 3 + 5)
    with pytest.raises(Miss, match="short read"):
        store.load("dave", tensor_block_views(host()), [0, 1, 2, 3])
    assert not store.contains("dave")


def test_truncated_file_dropped_on_restart(tmp_path):
    store = make(tmp_path)
    store.store("erin", tensor_block_views(host(5)), [0, 1])
    os.truncate(user_file(store, "erin"), 7)
    assert not make(tmp_path).contains("erin")


def test_capacity_eviction_is_lru(tmp_path):
    store = make(tmp_path, capacity_blocks=6)
    views = tensor_block_views(host(6))
    assert store.store("u1", views, [0, 1]) == []
    assert store.store("u2", views, [2, 3]) == []
    store.load("u1", tensor_block_views(host()), [0, 1])  # u1 becomes most recent
    assert store.store("u3", views, [4, 5, 6]) == ["u2"]
    assert store.users() == ["u1", "u3"]
    assert store.used_bytes == 5 * store.slot_bytes
    with pytest.raises(ValueError, match="more than ssd capacity"):
        store.store("huge", views, list(range(7)))


def test_evict_and_missing_user(tmp_path):
    store = make(tmp_path)
    store.store("frank", tensor_block_views(host(7)), [0])
    assert store.evict("frank") and not store.evict("frank")
    with pytest.raises(Miss):
        store.load("frank", tensor_block_views(host()), [0])


def test_odirect_round_trip_into_page_aligned_memory(tmp_path):
    import mmap

    from layerflow.tier.ssd import odirect_supported

    if not odirect_supported(tmp_path):
        pytest.skip("filesystem without O_DIRECT")
    shape = (4, 1024)  # 4 KiB blocks of fp32
    bufs = [mmap.mmap(-1, 16384) for _ in range(2)]
    src, dst = (torch.frombuffer(b, dtype=torch.float32).view(shape) for b in bufs)
    src.copy_(torch.randn(shape))
    store = SsdStore([tmp_path / "d"], 1 << 20, 4096, io_threads=2, group_blocks=2)
    assert store._direct(0, [tensor_block_views([src])(0)])
    store.store("gina", tensor_block_views([src]), [0, 1, 2, 3])
    store.load("gina", tensor_block_views([dst]), [3, 2, 1, 0])
    assert torch.equal(src.flip(0), dst)
