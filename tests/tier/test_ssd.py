"""SSD tier: round trip, corruption and torn writes are misses, LRU eviction; one owner per directory, nothing kept
across a restart, no link ever followed, dropping needs no space."""

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerflow.tier.ssd import Miss, SsdStore, tensor_block_views
from layerflow.tier.ssd_directory import SsdDirectoryError

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


# ---- one owner, nothing kept across a restart, no link followed -----------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def victim(tmp_path) -> Path:
    """A file outside the SSD directory that no store operation may touch."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    return path


def test_restart_drops_the_previous_owners_copies_and_touches_nothing_else(tmp_path):
    store = make(tmp_path)
    store.store("bob", tensor_block_views(host(2)), [3, 4])
    old_file = user_file(store, "bob")
    store.close()
    ssd = tmp_path / "ssd"
    outside = victim(tmp_path)
    (ssd / "link.kv").symlink_to(outside)
    (ssd / "notes.txt").write_text("not ours")
    again = make(tmp_path)
    assert again.users() == [] and again.used_bytes == 0 and not again.contains("bob")
    assert not old_file.exists()
    assert (ssd / "link.kv").is_symlink() and outside.read_bytes() == b"precious"
    assert (ssd / "notes.txt").read_text() == "not ours"
    again.close()


def test_a_link_planted_at_the_index_temp_file_is_never_followed(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir(mode=0o700)
    outside = victim(tmp_path)
    (ssd / "index.tmp").symlink_to(outside)
    store = make(tmp_path)
    store.store("carl", tensor_block_views(host(1)), [0, 1])
    store.evict("carl")
    store.close()
    assert outside.read_bytes() == b"precious"


def test_a_link_planted_at_the_next_file_name_is_never_followed(tmp_path):
    store = make(tmp_path)
    outside = victim(tmp_path)
    guess = f"{hashlib.sha1(b'dora').hexdigest()[:20]}-1.kv"   # the name the store used to give dora's first copy
    (tmp_path / "ssd" / guess).symlink_to(outside)
    store.store("dora", tensor_block_views(host(1)), [0, 1])
    assert outside.read_bytes() == b"precious"
    mode = os.lstat(user_file(store, "dora")).st_mode
    assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
    store.close()


def test_a_tampered_index_entry_cannot_unlink_a_file_outside_the_directory(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir(mode=0o700)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(b"x" * 4 * SsdStore.slot_size(block_bytes()))
    doc = {"version": 1, "block_bytes": block_bytes(), "slot_bytes": SsdStore.slot_size(block_bytes()),
           "dirs": [str(ssd)], "generation": 1, "entries": [["mallory", "../outside.kv", 0, 1, [0]]]}
    (ssd / "index.json").write_text(json.dumps(doc))
    store = make(tmp_path)
    assert not store.contains("mallory")
    store.evict("mallory")
    store.close()
    assert outside.exists()


@pytest.mark.parametrize("problem", ["group_writable", "world_writable", "symlink", "foreign_owner", "file"])
def test_an_unsafe_directory_is_refused_naming_it(tmp_path, problem):
    ssd = tmp_path / "ssd"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if problem == "symlink":
        ssd.symlink_to(real)
    elif problem == "file":
        ssd.write_text("")
    else:
        ssd.mkdir(mode=0o700)
        if problem == "foreign_owner":
            if os.getuid() != 0:
                pytest.skip("chown to another uid needs root")
            os.chown(ssd, 12345, 12345)
        else:
            os.chmod(ssd, 0o770 if problem == "group_writable" else 0o707)
    expected = {"group_writable": "writable by group or others", "world_writable": "writable by group or others",
                "symlink": "a symbolic link", "foreign_owner": "owned by uid 12345", "file": "not a directory"}
    with pytest.raises(SsdDirectoryError, match=rf"{ssd}: .*{expected[problem]}"):
        make(tmp_path)
    assert not any(real.iterdir())


def test_a_second_owner_of_a_directory_is_refused_naming_it(tmp_path):
    first = make(tmp_path)
    first.store("erin", tensor_block_views(host(5)), [0, 1])
    with pytest.raises(SsdDirectoryError, match=rf"{tmp_path / 'ssd'} is in use by another engine or transfer server"):
        make(tmp_path)
    assert first.contains("erin") and user_file(first, "erin").exists()   # the refused one deleted nothing
    first.close()
    make(tmp_path).close()   # the lock goes with its owner


def test_one_directory_named_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="named twice"):
        SsdStore([tmp_path / "ssd", tmp_path / "ssd" / "."], 1 << 20, block_bytes())


def test_dropping_a_copy_needs_no_space(tmp_path):
    """Under a file-size limit of 0 (every write that would add a byte fails, as on a full disk) a drop still works."""
    script = f"""
import resource, signal, torch
from layerflow.tier.ssd import SsdStore, tensor_block_views
store = SsdStore([{str(tmp_path / 'ssd')!r}], 1 << 24, 4096, io_threads=1)
store.store("full", tensor_block_views([torch.ones(4, 1024)]), [0, 1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
print(store.evict("full"), store.contains("full"), store.used_bytes)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "0"]
    assert not list((tmp_path / "ssd").glob("*.kv"))
