"""The transfer server against hostile or careless surroundings: directories it must not take over, files it must not
leave behind, a parent that dies without stopping it, clients that send what they should not."""

import contextlib
import json
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from layerflow.config import Config
from layerflow.server import HandoffError, TransferServer, protocol, shared_cpu_pool, spawn_server
from layerflow.server.auth import TOKEN_FILE, AuthError, make_private_dir, read_token
from layerflow.server.handoff import client_handoff, server_handoff
from layerflow.server.launcher import READY
from layerflow.server.protocol import Op
from layerflow.server.registration import device_of_bus_id, export_pool, import_pool, layout_to_dict
from layerflow.server.shm import pool_bytes
from layerflow.tier.layout import KVLayout, LayerGroup

REPO = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---- item 4: a directory of its own, nothing chmod-ed, nothing left behind ----------------------------------------

def test_a_socket_in_a_shared_directory_is_refused_and_the_directory_left_as_it_was(tmp_path):
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(AuthError, match=rf"{shared}: mode 1777, expected 700.*a directory of their own"):
        TransferServer(Config(cpu_cache_gb=0.001), shared, socket_name="x.sock")
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert list(shared.iterdir()) == []


def test_a_link_at_the_run_dir_is_refused_without_touching_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(AuthError, match=rf"{link}: is a symbolic link"):
        make_private_dir(link)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert list(target.iterdir()) == []


def test_a_run_dir_is_created_private_or_adopted_only_if_already_private(tmp_path):
    fresh = make_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700
    assert make_private_dir(fresh) == fresh                       # a restart in the same directory
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o700)
    os.chmod(loose, 0o750)
    with pytest.raises(AuthError, match="mode 750, expected 700"):
        make_private_dir(loose)
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o750


def start_cli_server(tmp_path, sock: Path, *extra: str) -> subprocess.Popen:
    cfg = tmp_path / "transfer.yaml"
    cfg.write_text(yaml.safe_dump({"cpu_cache_gb": 0.001, "server_socket": str(sock)}))
    proc = subprocess.Popen([sys.executable, "-m", "layerflow.server", "--config", str(cfg), *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().startswith(READY)
    return proc


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_server_removes_its_token_and_socket_when_it_exits(tmp_path, how):
    sock = tmp_path / "lf" / "kv.sock"
    proc = start_cli_server(tmp_path, sock)
    try:
        assert sock.exists() and (sock.parent / TOKEN_FILE).exists()
        proc.send_signal(how)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sock.exists() and not (sock.parent / TOKEN_FILE).exists()


# ---- item 7: a spawned server does not outlive its parent ---------------------------------------------------------

PARENT = """
import sys, time
from layerflow.config import Config
from layerflow.server.launcher import spawn_server
handle = spawn_server(Config(cpu_cache_gb=0.001), {run_dir})
print(handle.pid, handle.run_dir, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("own_dir", [True, False])
def test_a_spawned_server_exits_and_cleans_up_when_its_parent_is_killed(tmp_path, own_dir):
    given = None if own_dir else str(tmp_path / "run")
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(run_dir=repr(given))], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid, run_dir = parent.stdout.readline().split()
        pid, run_dir = int(pid), Path(run_dir)
        assert not gone(pid) and (run_dir / TOKEN_FILE).exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_until(lambda: gone(pid)), "the spawned server outlived its SIGKILLed parent"
        if own_dir:
            assert wait_until(lambda: not run_dir.exists())
        else:
            assert wait_until(lambda: not (run_dir / TOKEN_FILE).exists()) and run_dir.is_dir()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)


# ---- item 6: what a client holding the token may send -------------------------------------------------------------

LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float32), LayerGroup(1, 1, 16, torch.bfloat16)), 4)
EFD = os.EFD_SEMAPHORE | os.EFD_CLOEXEC


def handoff_reply(fields: dict, counter_sets: list[dict] = ()) -> protocol.Message:
    """Send HELLO `fields` (then raw COUNTER_SETs) to a server-side handoff; return the server's last reply."""
    a, b = protocol.socket_pair()
    done = threading.Thread(target=lambda: pytest.raises(HandoffError, server_handoff, b, "t", os.getuid()))
    done.start()
    fds = []
    try:
        protocol.send(a, Op.HELLO, **{"token": "t", "rank": 0, "pid": os.getpid(), "layers": 1, "counters": 1,
                                      **fields})
        reply = protocol.recv(a)
        for counter_set in counter_sets:
            if reply.op is not Op.ACK:
                break
            fds = [os.eventfd(0, EFD)]
            protocol.send(a, Op.COUNTER_SET, fds=fds, **counter_set)
            reply = protocol.recv(a)
    finally:
        a.close()
        done.join(30)
        for fd in fds:
            os.close(fd)
    return reply


@pytest.mark.parametrize("field, value", [("counters", 10**7), ("layers", 10**30), ("layers", 254), ("pid", "me"),
                                          ("counters", 65)])
def test_hello_fields_are_typed_and_bounded_before_anything_is_allocated(field, value):
    reply = handoff_reply({field: value})
    assert reply.op is Op.NACK and f"{field}={value!r}: must be an integer in" in reply["reason"]


def test_a_counter_set_with_a_bool_counter_id_is_nacked():
    header = {"layers": 1, "counters": 2, "rank": 0}
    reply = handoff_reply({"counters": 2}, [{"counter_id": True, **header}])
    assert reply.op is Op.NACK and "counter_id=True" in reply["reason"]


@pytest.fixture
def cpu_server(tmp_path):
    srv = TransferServer(Config(cpu_cache_gb=0.001), tmp_path / "run")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.close()


def connected(srv_or_handle) -> tuple[socket.socket, list[list[int]]]:
    """A socket past the handshake (token and eventfds handed over), before any pool is registered."""
    sock = protocol.new_socket()
    sock.connect(str(srv_or_handle.socket_path))
    grid = [[os.eventfd(0, EFD) for _ in range(LAYOUT.num_layers)]]
    client_handoff(sock, read_token(srv_or_handle.token_path), 0, grid)
    return sock, grid


class Planted:
    """Unpickling this creates `path`: proof that the server ran pickle.loads on client bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_a_cuda_pool_registration_is_never_unpickled_and_refused_on_a_cpu_server(cpu_server, tmp_path):
    marker = tmp_path / "unpickled"
    sock, grid = connected(cpu_server)
    try:
        protocol.send(sock, Op.REGISTER_POOL, payload=pickle.dumps([Planted(marker)]), kind="cuda_ipc",
                      layout=layout_to_dict(LAYOUT), num_pages=4)
        reply = protocol.recv(sock)
    finally:
        sock.close()
        for fd in grid[0]:
            os.close(fd)
    assert reply.op is Op.NACK and not marker.exists()
    if not torch.cuda.is_available():
        assert "no CUDA device" in reply["reason"]


def test_an_unsealed_memfd_is_refused_and_the_server_survives_its_truncation(tmp_path):
    handle = spawn_server(Config(cpu_cache_gb=0.001), tmp_path / "run")
    sock, grid = connected(handle)
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        size = pool_bytes(LAYOUT, 4)
        os.ftruncate(fd, size)
        protocol.send(sock, Op.REGISTER_POOL, fds=[fd], kind="memfd", layout=layout_to_dict(LAYOUT), num_pages=4,
                      size=size)
        reply = protocol.recv(sock)
        assert reply.op is Op.NACK and "not sealed against shrinking and growing" in reply["reason"]
        os.ftruncate(fd, 0)
        protocol.send(sock, Op.OFFLOAD, req=1, user="u", gpu_pages=[0], first=0)
        assert protocol.recv(sock).op is Op.ERROR and handle.alive()
    finally:
        sock.close()
        os.close(fd)
        for efd in grid[0]:
            os.close(efd)
        handle.stop()


def test_a_client_pool_memfd_cannot_be_resized_under_the_servers_mapping():
    shm, _ = shared_cpu_pool(LAYOUT, 4)
    with pytest.raises(PermissionError):
        os.ftruncate(shm.fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(shm.fd, shm.size * 2)
    shm.close()


@pytest.mark.parametrize("change, message", [
    ({"layout": {"page_size": 4, "groups": [[10**4, 1, 1, "float32"]]}}, r"num_layers=10000: must be an integer in"),
    ({"layout": {**layout_to_dict(LAYOUT), "extra": 1}}, r"layout .*: expected \{'page_size'"),
    ({"layout": {"page_size": 4, "groups": [[1, 1, 1, "int8"]]}}, r"dtype 'int8' not in"),
    ({"num_pages": 4.0}, r"num_pages=4.0: must be an integer"),
    ({"size": "big"}, r"size='big': must be an integer"),
])
def test_register_pool_fields_are_checked_before_mapping(change, message):
    shm, _ = shared_cpu_pool(KVLayout((LayerGroup(1, 1, 1, torch.float32),), 4), 10**4)
    fields = {"kind": "memfd", "layout": {"page_size": 4, "groups": [[1, 1, 1, "float32"]]}, "num_pages": 10**4,
              "size": shm.size, **change}
    try:
        with pytest.raises(ValueError, match=message):
            import_pool(fields, [shm.fd], b"")
    finally:
        shm.close()


CUDA_IMPORTER = """
import json, sys, torch
from layerflow.server.registration import import_pool
fields = json.loads(open(sys.argv[1]).read())
pool = import_pool(fields, [], open(sys.argv[2], "rb").read())
expected = torch.load(sys.argv[3])
assert all(torch.equal(a.cpu(), b) for a, b in zip(pool.layers, expected)), "layer bytes differ"
pool.layers[0].zero_()
torch.cuda.synchronize()
pool.close()
print("mapped", len(expected))
"""


@pytest.mark.gpu
def test_a_cuda_pool_is_mapped_in_another_process_from_raw_ipc_handles(tmp_path):
    from layerflow.tier.gpu_pool import GpuKVPool

    pool = GpuKVPool(LAYOUT, 64, device="cuda")
    for i, t in enumerate(pool.kv):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype))
    export = export_pool(LAYOUT, pool.kv)
    assert export.fds == [] and len(export.payload) % 64 == 0
    (tmp_path / "fields.json").write_text(json.dumps(export.fields))
    (tmp_path / "payload").write_bytes(export.payload)
    torch.save([t.cpu() for t in pool.kv], tmp_path / "expected.pt")
    done = subprocess.run([sys.executable, "-c", CUDA_IMPORTER, str(tmp_path / "fields.json"),
                           str(tmp_path / "payload"), str(tmp_path / "expected.pt")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mapped", str(LAYOUT.num_layers)]
    assert not pool.kv[0].any()   # the other process wrote into this one's memory


@pytest.mark.parametrize("bus_id", [None, 0, "../../dev/nvidia0", "0000:1b:00.0; rm", "0000:1b:00.9"])
def test_a_cuda_pool_naming_no_pci_bus_id_is_refused_naming_the_field(bus_id):
    """Checked before any CUDA call (on a GPU server, import_pool reaches this check for a CUDA pool)."""
    with pytest.raises(ValueError, match="pci_bus_id="):
        device_of_bus_id(bus_id)


def test_a_client_of_a_socket_where_no_server_runs_is_told_so(tmp_path):
    from layerflow.server import TransferClient

    config = Config(server_socket=str(tmp_path / "none" / "kv.sock"))
    shm, kv = shared_cpu_pool(LAYOUT, 4)
    with pytest.raises(FileNotFoundError, match=rf"no transfer server is running in {tmp_path / 'none'}"):
        TransferClient.from_config(config, LAYOUT, kv, shm=shm)
    shm.close()


@contextlib.contextmanager
def registered(server):
    """A raw connection to `server` with a 4-page shared-memory pool registered; closed with its fds after."""
    sock, grid = connected(server)
    shm, kv = shared_cpu_pool(LAYOUT, 4)
    try:
        export = export_pool(LAYOUT, kv, shm)
        protocol.send(sock, Op.REGISTER_POOL, fds=export.fds, payload=export.payload, **export.fields)
        assert protocol.recv(sock).op is Op.ACK
        yield sock
    finally:
        sock.close()
        shm.close()
        for fd in grid[0]:
            os.close(fd)


def test_a_request_without_its_req_field_is_refused_and_the_client_keeps_being_served(cpu_server):
    """Issue 16.6: an OFFLOAD without `req` used to kill the client's lane and leave the user claimed forever."""
    with registered(cpu_server) as sock:
        protocol.send(sock, Op.OFFLOAD, user=3, tokens=4, gpu_pages=[0])
        reply = protocol.recv(sock)
        assert reply.op is Op.ERROR and "req=None" in reply["reason"]
        replies = {}
        for req, (op, fields) in enumerate([(Op.OFFLOAD, dict(user=3, tokens=4, gpu_pages=[0])),
                                            (Op.LOOKUP, dict(user=3)), (Op.OFFLOAD, dict(user=[1], tokens=4,
                                                                                          gpu_pages=[0]))]):
            protocol.send(sock, op, req=req, **fields)
            while req not in replies:   # an offload is answered from a lane: replies may come out of order
                reply = protocol.recv(sock)
                replies[reply["req"]] = reply
        assert replies[0].op is Op.DONE
        assert replies[1].op is Op.DONE and (replies[1]["tier"], replies[1]["tokens"]) == ("host", 4)
        assert replies[2].op is Op.ERROR and "user=[1]" in replies[2]["reason"]


def test_an_offloads_history_of_the_wrong_size_is_refused_and_a_right_one_is_adopted(cpu_server):
    """OFFLOAD's payload is one int64 item id per token or nothing; ADOPT hands the history back, base64."""
    import base64

    import numpy as np

    with registered(cpu_server) as sock:
        protocol.send(sock, Op.OFFLOAD, payload=b"12345", req=1, user=3, tokens=4, gpu_pages=[0])
        reply = protocol.recv(sock)
        assert reply.op is Op.ERROR and "history: 5 bytes for tokens=4" in reply["reason"]
        history = np.array([7, 2**40, 0, 9], dtype="<i8")
        protocol.send(sock, Op.OFFLOAD, payload=history.tobytes(), req=2, user=3, tokens=4, gpu_pages=[0])
        assert protocol.recv(sock).op is Op.DONE
        for req, user, tokens, items in ((3, 3, 4, history.tolist()), (4, 5, 0, [])):
            protocol.send(sock, Op.ADOPT, req=req, user=user)
            reply = protocol.recv(sock)
            assert reply.op is Op.DONE and reply["tokens"] == tokens
            assert np.frombuffer(base64.b64decode(reply["history"]), dtype="<i8").tolist() == items


def test_connections_past_the_client_cap_are_told_so(cpu_server, monkeypatch):
    """Issue 16.6: every client costs threads and fds; past the cap a connection is refused with a reason."""
    from layerflow.server import server as server_module

    monkeypatch.setattr(server_module, "MAX_CLIENTS", 2)
    held = [connected(cpu_server) for _ in range(2)]
    try:
        sock = protocol.new_socket()
        sock.connect(str(cpu_server.socket_path))
        reply = protocol.recv(sock)
        assert reply.op is Op.NACK and "2 clients at most" in reply["reason"]
        sock.close()
    finally:
        for sock, grid in held:
            sock.close()
            for fd in grid[0]:
                os.close(fd)


def _client_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("layerflow-client-kv" in line for line in f)


def test_a_departed_clients_pool_and_fds_are_given_back(tmp_path):
    """Issue 16.7: clients that connect with a pool and leave no longer pile up in the server (its mappings of their
    pools and their fds are released once their lanes drained)."""
    from layerflow.server import TransferClient

    handle = spawn_server(Config(cpu_cache_gb=0.001), tmp_path / "run")
    try:
        baseline = None
        for rank in range(4):
            shm, kv = shared_cpu_pool(LAYOUT, 64)
            client = TransferClient(handle.socket_path, handle.token_path, LAYOUT, kv, shm=shm, rank=rank)
            client.offload(rank, 4, [0]).result(10)
            assert _client_mappings(handle.pid) >= 1
            client.close()
            del kv
            shm.close()
            assert wait_until(lambda: _client_mappings(handle.pid) == 0, 10), open(f"/proc/{handle.pid}/maps").read()
            fds = len(os.listdir(f"/proc/{handle.pid}/fd"))
            baseline = fds if baseline is None else baseline   # after the first client: the host pool exists
            assert fds <= baseline
    finally:
        handle.stop()


def test_an_idle_client_costs_the_server_one_thread(cpu_server):
    """Issue 16.6: 200 idle clients used to cost 802 threads (a connection thread and three lanes each); the lanes now
    start on a client's first request that needs them."""
    before = {t.name for t in threading.enumerate()}
    held = [connected(cpu_server) for _ in range(10)]
    try:
        assert wait_until(lambda: sum(t.name == "layerflow-server-client" for t in threading.enumerate()) >= 10, 10)
        lanes = [t for t in threading.enumerate() if t.name.startswith("layerflow-server-") and
                 t.name != "layerflow-server-client" and t.name not in before]
        assert lanes == []
    finally:
        for sock, grid in held:
            sock.close()
            for fd in grid[0]:
                os.close(fd)
