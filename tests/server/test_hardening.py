"""The transfer server against hostile or careless surroundings: directories it must not take over, files it must not
leave behind, a parent that dies without stopping it, clients that send what they should not."""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from layerflow.config import Config
from layerflow.server import TransferServer
from layerflow.server.auth import TOKEN_FILE, AuthError, make_private_dir
from layerflow.server.launcher import READY

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
