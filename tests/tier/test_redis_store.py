"""The Redis store against a real redis-server: round trip, versions, the manifest protocol under concurrent writers,
faults (killed, frozen, full, evicting), damaged blocks, passwords, fingerprints."""

import logging
import threading

import numpy as np
import pytest
import torch

from layerflow.config import Config
from layerflow.tier.host_pool import HostKVPool
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.tier.redis_store import RedisStore
from layerflow.tier.remote_faults import read_secret
from layerflow.tier.remote_manifest import layout_fingerprint
from layerflow.tier.ssd import Miss, tensor_block_views

LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float32), LayerGroup(1, 1, 16, torch.bfloat16)), 4)
FP = layout_fingerprint(LAYOUT, "model-a")
PAGE = LAYOUT.page_size


class Host:
    """A host block pool with random contents and the byte views a store reads and writes."""

    def __init__(self, layout: KVLayout = LAYOUT, blocks: int = 32, seed: int = 0) -> None:
        self.pool = HostKVPool(layout, num_blocks=blocks, pin_memory=False)
        g = torch.Generator().manual_seed(seed)
        for t in self.pool.blocks:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        self.views = tensor_block_views(self.pool.blocks)

    def block(self, b: int) -> bytes:
        return b"".join(self.views(b))

    def fill(self, blocks, value: float) -> None:
        for t in self.pool.blocks:
            t[list(blocks)] = value


def make_store(url, fingerprint=FP, layout=LAYOUT, cls=RedisStore, **options):
    options.setdefault("timeout_s", 2.0)
    return cls(url, layout, fingerprint, namespace="test", **options)


def write(store, user, tokens, host, blocks, first=0, history=None) -> list[str]:
    """Queue a write of `blocks` (holding `tokens` tokens) read from `host`; wait for it. Returns the release log."""
    released = []
    history = np.arange(tokens) + 100 * user if history is None else np.asarray(history)
    assert store.store(user, history, len(blocks), lambda i: host.block(blocks[i]),
                       lambda: released.append("released"), first)
    assert store.flush(10)
    return released


def same(a: Host, a_blocks, b: Host, b_blocks) -> bool:
    return all(a.block(x) == b.block(y) for x, y in zip(a_blocks, b_blocks))


@pytest.fixture
def stores():
    made = []

    def make(*args, **kwargs):
        made.append(make_store(*args, **kwargs))
        return made[-1]

    yield make
    for store in made:
        store.close()


def test_a_copy_round_trips_byte_exact_group_by_group(redis_url, stores):
    store = stores(redis_url, fetch_bytes=2 * LAYOUT.page_bytes)
    host, other = Host(seed=1), Host(seed=2)
    assert write(store, 7, 14, host, [0, 1, 2, 3]) == ["released"]
    copy = store.lookup(7)
    assert copy.tokens == 14 and copy.history.tolist() == list(range(700, 714)) and copy.dtypes == ("float32", "bfloat16")
    landed = []
    store.load(7, other.views, [10, 11, 12, 13], on_group=landed.append)
    assert landed == [[10, 11], [12, 13]]
    assert same(host, [0, 1, 2, 3], other, [10, 11, 12, 13])
    assert store.lookup(8) is None
    one_key_mgets = stores(redis_url, fetch_bytes=3 * LAYOUT.page_bytes, mget_bytes=1, connections=2)
    landed, other = [], Host(seed=3)
    one_key_mgets.load(7, other.views, [10, 11, 12, 13], on_group=landed.append)   # 4 MGETs over 2 connections
    assert landed == [[10, 11, 12], [13]]
    assert same(host, [0, 1, 2, 3], other, [10, 11, 12, 13])
    with pytest.raises(Miss, match="5 blocks asked, 4"):
        store.load(7, other.views, [10, 11, 12, 13, 14])


def test_a_new_version_uploads_only_the_changed_blocks_and_lets_the_old_ones_expire(redis_server, redis_url, stores):
    store, client = stores(redis_url), redis_server.client()
    host = Host(seed=3)
    write(store, 1, 14, host, [0, 1, 2, 3])
    v1 = store.lookup(1).version
    host.fill([3, 4], 5.0)                    # the offload of the next batch rewrote the last page and a new one
    write(store, 1, 18, host, [0, 1, 2, 3, 4], first=3)
    copy = store.lookup(1)
    assert [c for _, c in copy.runs] == [3, 2] and copy.runs[0][0] == v1
    assert client.pttl(f"test:{FP}:1:{v1}:0") == -1            # reused: persistent
    assert 0 < client.pttl(f"test:{FP}:1:{v1}:3") <= 60_000    # replaced: expires after the grace period
    other = Host(seed=4)
    store.load(1, other.views, [20, 21, 22, 23, 24])
    assert same(host, [0, 1, 2, 3, 4], other, [20, 21, 22, 23, 24])


def test_truncate_and_evict_take_effect_at_once_and_then_in_redis(redis_server, redis_url, stores):
    store, client = stores(redis_url), redis_server.client()
    host = Host(seed=5)
    write(store, 2, 14, host, [0, 1, 2, 3])
    store.truncate(2, 5)
    assert store.lookup(2).tokens == 5                          # before the job ran
    assert store.flush(10)
    assert store.lookup(2).tokens == 5 and store.lookup(2).num_blocks == 2
    other = make_store(redis_url)                               # another host sees the truncated copy
    assert other.lookup(2).history.tolist() == list(range(200, 205))
    other.close()
    store.evict(2)
    assert store.lookup(2) is None
    assert store.flush(10)
    assert not client.exists(f"test:{FP}:2:manifest")


def test_a_reader_never_sees_a_torn_copy_while_two_hosts_replace_it(redis_url, stores):
    writers, reader = [stores(redis_url), stores(redis_url)], stores(redis_url)
    blocks = 6
    stop = threading.Event()

    def keep_writing(store, base: int) -> None:
        for version in range(base, base + 40):
            # every block of version k holds k, and so does its history: a torn copy would mix values
            snapshot = [np.full(LAYOUT.page_bytes // 4, version, dtype=np.float32).tobytes()] * blocks
            assert store.store(9, np.full(blocks * PAGE, version), blocks, snapshot.__getitem__, lambda: None, 0)
            store.flush(10)
        stop.set()

    threads = [threading.Thread(target=keep_writing, args=(w, 1000 * (i + 1))) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    host, reads = Host(blocks=blocks), 0
    while not stop.is_set() or reads == 0:
        copy = reader.lookup(9)
        if copy is None:
            continue
        reader.load(9, host.views, list(range(blocks)))
        values = np.frombuffer(b"".join(host.block(b) for b in range(blocks)), dtype=np.float32)
        assert set(values.tolist()) == {float(copy.history[0])} and len(set(copy.history.tolist())) == 1
        reads += 1
    for t in threads:
        t.join()
    assert reads > 0


# 4 MiB pages, 16 of them: a connection's reader runs ahead of the consumer, so only replies this large are still in
# flight when the first group is handed on and the server is killed (with the small layout every reply had landed).
BIG = KVLayout((LayerGroup(8, 8, 128, torch.float32),), 64)


def test_redis_killed_mid_read_is_a_miss_logged_once_and_the_store_recovers(redis_process, stores, caplog):
    server = redis_process()
    store = stores(server.url, layout_fingerprint(BIG, "model-a"), BIG, fetch_bytes=BIG.page_bytes, connections=1)
    blocks = list(range(16))
    host, other = Host(BIG, blocks=16, seed=6), Host(BIG, blocks=16, seed=7)
    write(store, 3, 16 * BIG.page_size, host, blocks)
    store.lookup(3)
    caplog.set_level(logging.INFO)
    with pytest.raises(Miss, match="failed mid-read"):
        store.load(3, other.views, blocks, on_group=lambda landed: server.kill())
    for _ in range(3):
        assert store.lookup(3) is None
        with pytest.raises(Miss):
            store.load(3, other.views, blocks)
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    server.restart()
    store.outage.succeeded()   # skip the rest of the backoff; the next call reconnects
    write(store, 3, 16 * BIG.page_size, host, blocks)
    store.load(3, other.views, blocks)
    assert same(host, blocks, other, blocks)
    assert any("recovered" in r.getMessage() for r in caplog.records)


def test_redis_frozen_mid_read_times_out_into_a_miss_and_the_next_read_is_whole(redis_process, stores):
    server = redis_process()
    store = stores(server.url, fetch_bytes=LAYOUT.page_bytes, connections=1, timeout_s=0.3)
    host, other = Host(seed=18), Host(seed=19)
    write(store, 3, 32, host, list(range(8)))
    store.lookup(3)
    frozen = []

    def freezing_views(block):
        """Freezes the server as the first block lands, in the reader thread: one MGET per block and two in flight,
        so at least five are never answered (freezing in on_group raced the readers, which may finish first)."""
        if not frozen:
            frozen.append(block)
            server.freeze()
        return other.views(block)

    try:
        with pytest.raises(Miss, match=r"failed mid-read \(no answer within 0.3 s\)"):
            store.load(3, freezing_views, list(range(8)))
    finally:
        server.thaw()
    store.outage.succeeded()
    store.load(3, other.views, list(range(8)))       # the abandoned connection's late replies are not read as these
    assert same(host, range(8), other, range(8))


class KilledMidWrite(RedisStore):
    """Kills the server after the first batch of blocks went out, before the manifest is swapped in."""

    server = None

    def _put_blocks(self, user, version, blocks):
        super()._put_blocks(user, version, blocks)
        self.server.kill()


def test_redis_killed_mid_write_drops_the_write_without_a_hang_and_recovers(redis_process, stores):
    server = redis_process()
    KilledMidWrite.server = server
    store = stores(server.url, cls=KilledMidWrite)
    host = Host(seed=8)
    assert write(store, 4, 16, host, [0, 1, 2, 3]) == ["released"]
    assert store.outage.active and store.lookup(4) is None
    server.restart()
    store.outage.succeeded()
    plain = stores(server.url)
    assert plain.lookup(4) is None                 # nothing half-written is named
    write(plain, 4, 16, host, [0, 1, 2, 3])
    assert plain.lookup(4).tokens == 16


def test_a_frozen_redis_times_out_into_misses_and_thaws_back(redis_process, stores):
    server = redis_process()
    store = stores(server.url, timeout_s=0.3)
    host = Host(seed=9)
    write(store, 5, 8, host, [0, 1])
    server.freeze()
    try:
        assert store.lookup(5) is None
        assert store.outage.reason == "no answer within 0.3 s"
        assert store.store(5, np.arange(8), 2, lambda i: host.block(i), lambda: None, 0)
        assert store.flush(10)                     # the write is dropped, not stuck
    finally:
        server.thaw()
    store.outage.succeeded()
    assert store.lookup(5).tokens == 8


def test_a_damaged_or_truncated_block_is_a_miss_and_the_copy_is_deleted(redis_server, redis_url, stores):
    store, client = stores(redis_url), redis_server.client()
    host, other = Host(seed=10), Host(seed=11)
    for user, damage in ((6, "checksum"), (7, "truncated")):
        write(store, user, 12, host, [0, 1, 2])
        key = f"test:{FP}:{user}:{store.lookup(user).version}:1"
        data = bytearray(client.get(key))
        if damage == "checksum":
            data[100] ^= 0xFF
        else:
            data = data[:-8]
        client.set(key, bytes(data))
        with pytest.raises(Miss, match=damage):
            store.load(user, other.views, [5, 6, 7])
        assert store.lookup(user) is None          # at once, and once the delete ran, in Redis too
        assert store.flush(10) and not client.exists(f"test:{FP}:{user}:manifest")


def test_maxmemory_eviction_of_blocks_is_a_miss_never_a_partial_copy(redis_process, stores, caplog):
    layout = KVLayout((LayerGroup(1, 4, 64, torch.float32),), 16)      # 32 KiB blocks
    server = redis_process(args=("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"))
    fp = layout_fingerprint(layout, "model-a")
    store = stores(server.url, fingerprint=fp, layout=layout)
    host, other = Host(layout, blocks=8, seed=12), Host(layout, blocks=8, seed=13)
    caplog.set_level(logging.WARNING)
    for user in range(40):                        # 40 users x 8 blocks x 32 KiB = 10 MiB into 3 MiB
        write(store, user, 8 * 16, host, list(range(8)))
    served = missed = 0
    for user in range(40):
        if store.lookup(user) is None:
            continue
        try:
            store.load(user, other.views, list(range(8)))
        except Miss as e:
            assert "missing" in str(e)
            missed += 1
            continue
        assert same(host, range(8), other, range(8))
        served += 1
    assert missed > 0
    episodes = len([r for r in caplog.records if "losing blocks" in r.getMessage()])
    assert 1 <= episodes <= served + 1            # logged once per episode; only a whole read ends one


def test_a_full_redis_that_does_not_evict_refuses_writes_as_an_outage(redis_process, stores):
    server = redis_process(args=("--maxmemory", "1mb", "--maxmemory-policy", "noeviction"))
    layout = KVLayout((LayerGroup(1, 4, 64, torch.float32),), 16)
    store = stores(server.url, fingerprint=layout_fingerprint(layout, "m"), layout=layout)
    host = Host(layout, blocks=64, seed=14)
    write(store, 1, 64 * 16, host, list(range(64)))            # 2 MiB into 1 MiB
    assert store.outage.active and store.outage.reason.startswith("out of memory")
    store.outage.succeeded()
    assert store.lookup(1) is None


def test_a_wrong_or_missing_password_is_refused_without_leaking_it(redis_process, tmp_path, caplog):
    server = redis_process(password="right-horse-battery")
    caplog.set_level(logging.DEBUG)
    secret = tmp_path / "password"
    secret.write_text("wrong-staple-7731\n")
    for password in (read_secret(str(secret), None), None):
        with pytest.raises(ValueError, match="wrong or missing password") as refused:
            make_store(server.url, password=password)
        assert "wrong-staple-7731" not in str(refused.value) and "wrong-staple-7731" not in repr(refused.value)
    secret.write_text("right-horse-battery\n")
    store = make_store(server.url, password=read_secret(str(secret), None))
    write(store, 1, 4, Host(seed=15), [0])
    assert store.lookup(1).tokens == 4
    assert "right-horse-battery" not in repr(store._redis) + repr(store._connections)
    store.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "wrong-staple-7731" not in logged and "right-horse-battery" not in logged
    with pytest.raises(ValueError) as in_url:
        Config(remote_url="redis://:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in str(in_url.value) and "remote_password_file" in str(in_url.value)


def test_a_copy_of_another_model_or_layout_is_never_read(redis_server, redis_url, stores):
    store = stores(redis_url)
    write(store, 1, 8, Host(seed=16), [0, 1])
    other_model = stores(redis_url, fingerprint=layout_fingerprint(LAYOUT, "model-b"))
    assert other_model.lookup(1) is None
    wide = KVLayout(LAYOUT.groups, 8)
    other_layout = stores(redis_url, fingerprint=layout_fingerprint(wide, "model-a"), layout=wide)
    assert other_layout.lookup(1) is None
    client = redis_server.client()                   # even a manifest copied under another model's key is refused
    client.copy(f"test:{FP}:1:manifest", f"test:{other_model.fingerprint}:1:manifest")
    assert other_model.lookup(1) is None


class HeldWriter(RedisStore):
    """The writer thread waits at its manifest read of user 'hold' (saying so in `entered`) until `go` is set."""

    entered, go = threading.Event(), threading.Event()

    def _read_manifest(self, user):
        if user == "hold":
            self.entered.set()
            self.go.wait(10)
        return super()._read_manifest(user)


def test_the_write_queue_is_bounded_and_a_newer_write_replaces_a_queued_one(redis_url, stores):
    store = stores(redis_url, cls=HeldWriter, queue_jobs=2, queue_bytes=10_000)
    host, log = Host(seed=17), []
    assert store.store("hold", np.arange(4), 1, host.block, lambda: log.append("hold"), 0)
    assert HeldWriter.entered.wait(10)               # the writer is now held inside the job of "hold"
    assert store.store(1, np.arange(4), 1, host.block, lambda: log.append("first"), 0)
    assert store.store(1, np.arange(8), 2, host.block, lambda: log.append("second"), 0)
    assert log == ["first"]                           # replaced while queued: released at once, never written
    assert store.store(2, np.arange(4), 1, host.block, lambda: log.append("third"), 0)
    assert not store.store(3, np.arange(4), 1, host.block, lambda: log.append("refused"), 0)   # 2 jobs queued
    assert not store.store(4, np.arange(4), 1, host.block, lambda: None, 0, held_bytes=20_000)
    HeldWriter.go.set()
    assert store.flush(10)
    assert sorted(log) == ["first", "hold", "second", "third"]
    assert store.lookup(1).tokens == 8
