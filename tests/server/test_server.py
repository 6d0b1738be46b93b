"""Transfer server: handoff, authentication, byte-exact copies, poison on failure or death, reconnect."""

import os
import select
import signal
import stat
import threading

import pytest
import torch

from layerflow.config import Config
from layerflow.transfer.errors import TransferError
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.server import (HandoffError, NotResident, TransferClient, TransferServer, shared_cpu_pool,
                                       spawn_server)
from layerflow.server import protocol
from layerflow.server.auth import (AuthError, PeerCred, check_peer, make_private_dir, read_token,
                                            write_token)
from layerflow.server.handoff import client_handoff, server_handoff

LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float32), LayerGroup(1, 1, 16, torch.bfloat16)), 4)
EFD = os.EFD_SEMAPHORE | os.EFD_CLOEXEC


def eventfd_grid(counters: int, layers: int) -> list[list[int]]:
    return [[os.eventfd(0, EFD) for _ in range(layers)] for _ in range(counters)]


def close_grid(grid) -> None:
    for row in grid:
        for fd in row:
            os.close(fd)


def run_server_side(sock, token: str, **kw) -> dict:
    out: dict = {}

    def target():
        try:
            out["session"] = server_handoff(sock, token, os.getuid(), **kw)
        except HandoffError as e:
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    out["thread"] = t
    return out


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


# ---- handoff and authentication -------------------------------------------------------------

def test_handoff_round_trip_fds_usable_both_ways():
    a, b = protocol.socket_pair()
    grid = eventfd_grid(3, 2)
    side = run_server_side(b, "secret")
    client_handoff(a, "secret", 5, grid)
    side["thread"].join()
    session = side["session"]
    assert (session.rank, session.layers, session.counters) == (5, 2, 3)
    assert session.peer.uid == os.getuid() and session.peer.pid == os.getpid()
    os.eventfd_write(session.fds[2][1], 1)  # server writes, client reads its own fd
    assert readable(grid[2][1]) and os.eventfd_read(grid[2][1]) == 1
    assert not readable(grid[2][0])
    os.eventfd_write(grid[0][0], 1)  # and the other way round: the same kernel object
    assert os.eventfd_read(session.fds[0][0]) == 1
    session.close()
    close_grid(grid)


def test_wrong_token_refused_with_reason():
    a, b = protocol.socket_pair()
    grid = eventfd_grid(1, 1)
    side = run_server_side(b, "right")
    with pytest.raises(HandoffError, match="wrong token"):
        client_handoff(a, "wrong", 0, grid)
    side["thread"].join()
    assert "wrong token" in str(side["error"])
    close_grid(grid)


def test_foreign_uid_refused():
    me = os.getuid()
    check_peer(PeerCred(1, me, 0), me)
    with pytest.raises(AuthError, match=f"uid {me + 1}"):
        check_peer(PeerCred(1, me + 1, 0), me)

    def pretend_foreign(cred: PeerCred, allowed: int) -> None:
        check_peer(PeerCred(cred.pid, allowed + 1, cred.gid), allowed)

    a, b = protocol.socket_pair()
    grid = eventfd_grid(1, 1)
    side = run_server_side(b, "t", peer_check=pretend_foreign)
    with pytest.raises(HandoffError, match="only uid"):
        client_handoff(a, "t", 0, grid)
    side["thread"].join()
    close_grid(grid)


@pytest.mark.parametrize("bad", ["pipe", "plain_eventfd"])
def test_counter_set_with_wrong_fds_is_nacked(bad):
    a, b = protocol.socket_pair()
    grid = eventfd_grid(2, 2)
    r, w = os.pipe()
    stray = os.eventfd(0)
    grid[1][1] = r if bad == "pipe" else stray
    side = run_server_side(b, "t")
    with pytest.raises(HandoffError, match="counter set 1"):
        client_handoff(a, "t", 0, grid)
    side["thread"].join()
    assert "session" not in side
    close_grid(grid)
    os.close(w)
    os.close(r if bad != "pipe" else stray)


def test_directory_token_and_socket_modes(tmp_path):
    d = make_private_dir(tmp_path / "run")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    token = write_token(d)
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    assert len(read_token(token)) == 64
    os.chmod(token, 0o644)
    with pytest.raises(AuthError, match="mode 644"):
        read_token(token)
    server = TransferServer(Config(cpu_cache_gb=0.001), tmp_path / "srv")
    try:
        assert stat.S_IMODE(os.stat(server.run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.token_path).st_mode) == 0o600
        assert stat.S_ISSOCK(os.stat(server.socket_path).st_mode)
    finally:
        server.close()


# ---- in-process server ----------------------------------------------------------------------

HOST_BLOCKS = 6
SMALL_HOST_GB = (HOST_BLOCKS + 0.5) * LAYOUT.page_bytes / 2**30


@pytest.fixture
def server(tmp_path):
    config = Config(cpu_cache_gb=SMALL_HOST_GB, ssd_cache_gb=0.01, ssd_cache_dir=str(tmp_path / "ssd"))
    srv = TransferServer(config, tmp_path / "run")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()


def make_client(srv_or_handle, num_pages: int = 16, seed: int = 0):
    shm, kv = shared_cpu_pool(LAYOUT, num_pages)
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    client = TransferClient(srv_or_handle.socket_path, srv_or_handle.token_path, LAYOUT, kv, shm=shm, num_counters=2)
    return client, kv


def onboard_and_check(client, kv, user, src_pages, dst_pages, expected) -> list[int]:
    """Onboard and check each layer's bytes the moment its signal arrives; return the signalled order."""
    for t in kv:
        t[dst_pages] = 0
    handle = client.onboard(user, dst_pages)
    order = []
    for layer in range(LAYOUT.num_layers):
        handle.wait_layer(layer, 10)
        assert torch.equal(kv[layer][dst_pages], expected[layer][src_pages])
        order.append(layer)
    handle.release()
    return order


def test_offload_onboard_byte_exact_two_clients_share_the_host_cache(server):
    c1, kv1 = make_client(server, seed=1)
    c2, kv2 = make_client(server, seed=2)
    expected = [t.clone() for t in kv1]
    c1.offload("alice", 12, [3, 4, 9]).result(10)
    assert c2.lookup("alice") == ("host", 12)
    assert onboard_and_check(c2, kv2, "alice", [3, 4, 9], [0, 1, 2], expected) == [0, 1, 2]
    assert onboard_and_check(c1, kv1, "alice", [3, 4, 9], [10, 12, 14], expected) == [0, 1, 2]
    c1.close()
    c2.close()


def test_offload_copies_only_the_pages_the_server_does_not_hold(server):
    client, kv = make_client(server, seed=3)
    client.offload("bob", 10, [0, 1, 2]).result(10)                  # 10 tokens: the third page is partly valid
    old = [t.clone() for t in kv]
    g = torch.Generator().manual_seed(9)
    for t in kv:
        t[:4] = torch.randn(t[:4].shape, generator=g).to(t.dtype)   # the client's pages all change
    assert client.offload("bob", 16, [0, 1, 2, 3]).result(10)["copied"] == 2
    expected = [t.clone() for t in kv]
    for e, o in zip(expected, old):
        e[:2] = o[:2]                                                 # the server kept its own two full pages
    onboard_and_check(client, kv, "bob", [0, 1, 2, 3], [8, 9, 10, 11], expected)

    client.truncate("bob", 5)                                         # only the first page stays valid
    assert client.lookup("bob") == ("host", 5)
    assert client.offload("bob", 16, [0, 1, 2, 3]).result(10)["copied"] == 3
    client.drop("bob")                                                # the server lost the prefix: all pages go
    assert client.offload("bob", 12, [4, 5, 6]).result(10)["copied"] == 3
    assert client.lookup("bob") == ("host", 12)
    with pytest.raises(ValueError, match="tokens=13"):
        client.offload("bob", 13, [4, 5, 6])
    client.close()


def test_unknown_user_poisons_every_layer_and_names_the_user(server):
    client, _ = make_client(server)
    handle = client.onboard("ghost", [0, 1])
    for layer in range(LAYOUT.num_layers):
        with pytest.raises(TransferError, match="poisoned") as info:
            handle.wait_layer(layer, 10)
        assert isinstance(info.value.__cause__, NotResident) and info.value.__cause__.users == ["ghost"]
    handle.release()
    assert client.lookup("ghost") == ("none", 0)
    client.close()


def test_host_eviction_spills_to_ssd_and_onboards_back(server):
    client, kv = make_client(server)
    expected = [t.clone() for t in kv]
    client.offload("u0", 16, [0, 1, 2, 3]).result(10)
    client.offload("u1", 16, [4, 5, 6, 7]).result(10)  # the host holds 6 blocks: u0 goes to SSD
    assert server.cache.usage().host_total == HOST_BLOCKS
    assert client.lookup("u0") == ("ssd", 16) and client.lookup("u1") == ("host", 16)
    assert onboard_and_check(client, kv, "u0", [0, 1, 2, 3], [8, 9, 10, 11], expected) == [0, 1, 2]
    assert client.lookup("u0") == ("host", 16) and client.lookup("u1") == ("ssd", 16)
    assert onboard_and_check(client, kv, "u1", [4, 5, 6, 7], [12, 13, 14, 15], expected) == [0, 1, 2]
    client.drop("u0")
    assert client.lookup("u0") == ("none", 0)
    client.close()


def test_corrupt_ssd_copy_is_reported_non_resident(server):
    client, kv = make_client(server)
    client.offload("u0", 16, [0, 1, 2, 3]).result(10)
    client.offload("u1", 16, [4, 5, 6, 7]).result(10)
    entry = server.cache.ssd._entries["u0"]
    path = server.cache.ssd.dirs[entry.dir_index] / entry.file
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    handle = client.onboard("u0", [8, 9, 10, 11])
    with pytest.raises(TransferError) as info:
        handle.wait(10)
    assert info.value.__cause__.users == ["u0"] and "checksum" in str(info.value)
    handle.release()
    assert client.lookup("u0") == ("none", 0)  # dropped, never served
    assert client.lookup("u1") == ("ssd", 16)  # spilled to make room for u0's read-back
    client.close()


# ---- a real server process: death and restart -----------------------------------------------

def test_server_killed_mid_transfer_releases_waiter_then_reconnect(tmp_path):
    config = Config(cpu_cache_gb=0.001)
    first = spawn_server(config, tmp_path / "a")
    client, kv = make_client(first)
    expected = [t.clone() for t in kv]
    try:
        client.offload("alice", 8, [1, 2]).result(10)
        os.kill(first.pid, signal.SIGSTOP)  # the request below is in flight, never answered
        handle = client.onboard("alice", [5, 6])
        caught = {}

        def waiter():
            try:
                handle.wait_layer(0, timeout=1.0)
            except TransferError as e:
                caught["error"] = e

        t = threading.Thread(target=waiter)
        t.start()
        first.kill()
        t.join(5)
        assert not t.is_alive()
        cause = caught["error"].__cause__  # poisoned by the hang-up, not the 1 s timeout (which has no cause)
        assert isinstance(cause, NotResident) and cause.users == ["alice"] and "connection lost" in cause.reason
        handle.release()
        assert not client.connected
        with pytest.raises(NotResident, match="not connected"):
            client.offload("bob", 4, [0]).result(1)

        second = spawn_server(config, tmp_path / "b")
        try:
            client.connect(second.socket_path, second.token_path)
            assert client.lookup("alice") == ("none", 0)  # the host cache died with the server
            client.offload("alice", 8, [1, 2]).result(10)
            assert onboard_and_check(client, kv, "alice", [1, 2], [5, 6], expected) == [0, 1, 2]
        finally:
            client.close()
            second.stop()
    finally:
        if first.alive():
            first.kill()


def test_spawn_with_bad_token_file_fails_start_up(tmp_path):
    handle = spawn_server(Config(cpu_cache_gb=0.001), tmp_path / "run")
    try:
        shm, kv = shared_cpu_pool(LAYOUT, 4)
        forged = tmp_path / "forged"
        forged.write_text("0" * 64)
        os.chmod(forged, 0o600)
        with pytest.raises(HandoffError, match="wrong token"):
            TransferClient(handle.socket_path, forged, LAYOUT, kv, shm=shm)
        log = (handle.run_dir / "server.log").read_text()
        assert "wrong token" in log
    finally:
        handle.stop()


def test_copy_failure_mid_transfer_poisons_remaining_layers(server, monkeypatch):
    from layerflow.server import server as server_module
    from tests.faults import FaultyThreadCopyEngine

    engine = FaultyThreadCopyEngine()
    monkeypatch.setattr(server_module, "make_engine", lambda device: engine)
    client, kv = make_client(server)
    client.offload("alice", 8, [0, 1]).result(10)
    engine.fail_at_layer = 1
    handle = client.onboard("alice", [4, 5])
    with pytest.raises(TransferError, match="injected failure at layer 1") as info:
        handle.wait(10)
    assert info.value.__cause__.users == ["alice"]
    handle.release()
    assert client.lookup("alice") == ("host", 8)  # a failed copy to the GPU leaves the host copy intact
    client.close()


def test_protocol_rejects_malformed_and_foreign_version_messages():
    a, b = protocol.socket_pair()
    b.send(b"\x05\x00")
    with pytest.raises(protocol.ProtocolError, match="shorter"):
        protocol.recv(a)
    b.send(protocol._LEN.pack(10) + b"{}")
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        protocol.recv(a)
    header = b'{"v":99,"op":"ack"}'
    b.send(protocol._LEN.pack(len(header)) + header)
    with pytest.raises(protocol.ProtocolError, match="version"):
        protocol.recv(a)
    protocol.send(b, protocol.Op.ACK, payload=b"xyz", counter_id=3)
    msg = protocol.recv(a)
    assert (msg.op, msg["counter_id"], msg.payload) == (protocol.Op.ACK, 3, b"xyz")
    b.close()
    with pytest.raises(protocol.ProtocolError, match="closed"):
        protocol.recv(a)


def test_cli_serves_on_the_config_socket_and_client_from_config(tmp_path):
    import subprocess
    import sys

    import yaml

    from layerflow.server.launcher import READY

    sock = tmp_path / "lf" / "kv.sock"
    cfg = tmp_path / "transfer.yaml"
    cfg.write_text(yaml.safe_dump({"cpu_cache_gb": 0.001, "server_socket": str(sock), "num_counters": 3}))
    proc = subprocess.Popen([sys.executable, "-m", "layerflow.server", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith(READY)
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        from layerflow.config import load_config

        shm, kv = shared_cpu_pool(LAYOUT, 4)
        client = TransferClient.from_config(load_config(cfg), LAYOUT, kv, shm=shm)
        assert client.signals.num_counters == 3
        client.offload("u", 8, [0, 1]).result(10)
        assert client.lookup("u") == ("host", 8)
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_one_onboard_request_carries_several_users_on_one_counter(server):
    client, kv = make_client(server)
    expected = [t.clone() for t in kv]
    client.offload("a", 8, [0, 1]).result(10)
    client.offload("b", 12, [2, 3, 4]).result(10)
    for t in kv:
        t[8:13] = 0
    handle, done = client.onboard_many([("a", [8, 9]), ("b", [10, 11])])  # b's history was truncated: a prefix
    handle.wait(10)
    assert done.result(10) == {"tiers": ["host", "host"]}
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(kv[layer][[8, 9, 10, 11]], expected[layer][[0, 1, 2, 3]])
        assert not kv[layer][12].any()
    handle.release()
    handle, done = client.onboard_many([("a", [8, 9]), ("ghost", [10])])
    with pytest.raises(TransferError, match="ghost"):
        handle.wait(10)
    assert done.exception(10).users == ["a", "ghost"]
    handle.release()
    assert client.lookup("a") == ("host", 8)  # a failed request leaves the others' host copies in place
    client.close()


def test_stopping_a_spawned_server_removes_the_directory_it_made():
    from layerflow.config import Config
    from layerflow.server.launcher import spawn_server

    handle = spawn_server(Config(cpu_cache_gb=0.01))
    assert handle.socket_path.exists() and handle.owns_run_dir
    handle.stop()
    assert not handle.run_dir.exists()


class OffloadGate:
    """A FaultyThreadCopyEngine `before_layer` callback that holds offload copies (the D2H worker) while closed."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.held = threading.Event()

    def __call__(self, layer: int) -> None:
        if threading.current_thread().name == "layerflow-d2h" and not self.open.is_set():
            self.held.set()
            assert self.open.wait(30), "gate never opened"


@pytest.fixture
def gated(server, monkeypatch):
    from layerflow.server import server as server_module
    from tests.faults import FaultyThreadCopyEngine

    gate = OffloadGate()
    engine = FaultyThreadCopyEngine(before_layer=gate)
    monkeypatch.setattr(server_module, "make_engine", lambda device: engine)
    client, kv = make_client(server, seed=5)
    yield gate, client, kv
    gate.open.set()
    client.close()


def test_an_offload_in_flight_does_not_hold_up_an_onboard_of_another_user(gated):
    gate, client, kv = gated
    expected = [t.clone() for t in kv]
    client.offload("alice", 8, [0, 1]).result(10)
    gate.open.clear()
    bob = client.offload("bob", 8, [2, 3])
    assert gate.held.wait(10)
    handle, done = client.onboard_many([("alice", [8, 9])])
    handle.wait(5)                       # issued and signalled while bob's copy is still held
    assert done.result(5) == {"tiers": ["host"]}
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(kv[layer][[8, 9]], expected[layer][[0, 1]])
    handle.release()
    assert client.lookup("alice") == ("host", 8)
    assert not bob.done()
    gate.open.set()
    assert bob.result(10) == {"copied": 2}
    assert client.lookup("bob") == ("host", 8)


def test_a_request_about_a_user_in_flight_waits_for_it(gated):
    gate, client, kv = gated
    expected = [t.clone() for t in kv]
    client.offload("alice", 8, [0, 1]).result(10)
    gate.open.clear()
    carol = client.offload("carol", 12, [2, 3, 4])
    assert gate.held.wait(10)
    dropped = []
    dropper = threading.Thread(target=lambda: dropped.append(client.drop("carol")))
    dropper.start()
    dropper.join(0.3)
    assert dropper.is_alive() and not carol.done()   # the drop must not free blocks the offload is writing
    gate.open.set()
    dropper.join(10)
    assert dropped == [None] and carol.result(10)["copied"] == 3
    assert client.lookup("carol") == ("none", 0)
    onboard_and_check(client, kv, "alice", [0, 1], [8, 9], expected)


def test_an_ssd_read_back_does_not_hold_up_a_host_hit(server, monkeypatch):
    client, kv = make_client(server, seed=6)
    expected = [t.clone() for t in kv]
    client.offload("s", 4, [0]).result(10)
    client.offload("h", 8, [1, 2]).result(10)
    client.offload("f", 16, [3, 4, 5, 6]).result(10)   # 7 blocks > 6: "s", the least recent, goes to SSD
    assert client.lookup("s") == ("ssd", 4)
    onboard_and_check(client, kv, "h", [1, 2], [8, 9], expected)   # "h" is now more recent than "f"

    gate, reading = threading.Event(), threading.Event()
    real_load = server.cache.ssd.load

    def slow_load(*args, **kwargs):
        reading.set()
        assert gate.wait(30), "gate never opened"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(server.cache.ssd, "load", slow_load)
    for t in kv:
        t[10:14] = 0
    from_ssd, ssd_done = client.onboard_many([("s", [10])])
    assert reading.wait(10)
    host, host_done = client.onboard_many([("h", [12, 13])])
    host.wait(5)                                     # served while the SSD read is held
    assert host_done.result(5) == {"tiers": ["host"]} and not ssd_done.done()
    host.release()
    gate.set()
    from_ssd.wait(10)
    assert ssd_done.result(10) == {"tiers": ["ssd"]}
    from_ssd.release()
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(kv[layer][[10, 12, 13]], expected[layer][[0, 1, 2]])
    client.close()
