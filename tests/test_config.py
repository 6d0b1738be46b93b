from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from layerflow.config import SignalMode, Config, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layerflow.yaml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "layerflow.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file_or_env():
    assert load_config(env={}) == Config()


def test_example_sets_every_key_to_its_default():
    values = yaml.safe_load(EXAMPLE.read_text())
    assert set(values) == {f.name for f in fields(Config)}
    assert load_config(EXAMPLE, env={}) == Config()


def test_file_values(tmp_path):
    path = write(tmp_path, "cpu_cache_gb: 64\nsignal: waitvalue\npage_size: 16\nssd_cache_gb: 100\n"
                           "ssd_cache_dir: /a;/b\nserver_socket: /tmp/lf.sock\n")
    cfg = load_config(path, env={})
    assert cfg.cpu_cache_gb == 64.0 and isinstance(cfg.cpu_cache_gb, float)
    assert cfg.signal is SignalMode.WAITVALUE
    assert cfg.page_size == 16
    assert cfg.ssd_cache_dirs == ("/a", "/b")
    assert cfg.server_socket == "/tmp/lf.sock"
    assert cfg.gpu_cache_gb == Config().gpu_cache_gb
    assert cfg.to_dict()["signal"] == "waitvalue"


def test_path_from_env(tmp_path):
    path = write(tmp_path, "num_counters: 9\n")
    assert load_config(env={"LAYERFLOW_CONFIG": str(path)}).num_counters == 9


def test_explicit_path_beats_env_path(tmp_path):
    path = write(tmp_path, "num_counters: 9\n")
    other = tmp_path / "other.yaml"
    other.write_text("num_counters: 3\n")
    assert load_config(path, env={"LAYERFLOW_CONFIG": str(other)}).num_counters == 9


def test_empty_file_is_defaults(tmp_path):
    assert load_config(write(tmp_path, ""), env={}) == Config()


@pytest.mark.parametrize(
    "file_text, env, expected",
    [
        ("", {}, True),  # default
        ("", {"LAYERFLOW_ENABLE_LAYERWISE": "0"}, False),  # env over default
        ("", {"LAYERFLOW_ENABLE_LAYERWISE": "off"}, False),
        ("enable_layerwise: false\n", {}, False),  # file over default
        ("enable_layerwise: true\n", {"LAYERFLOW_ENABLE_LAYERWISE": "0"}, True),  # file over env
        ("enable_layerwise: false\n", {"LAYERFLOW_ENABLE_LAYERWISE": "yes"}, False),
    ],
)
def test_layerwise_precedence(tmp_path, file_text, env, expected):
    assert load_config(write(tmp_path, file_text), env=env).enable_layerwise is expected


def test_signal_env_fallback(tmp_path):
    assert load_config(env={"LAYERFLOW_SIGNAL": "Event"}).signal is SignalMode.EVENT
    path = write(tmp_path, "signal: waitvalue\n")
    assert load_config(path, env={"LAYERFLOW_SIGNAL": "event"}).signal is SignalMode.WAITVALUE


def test_unknown_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'cpu_cache_gib'.*12"):
        load_config(write(tmp_path, "cpu_cache_gib: 12\n"), env={})


@pytest.mark.parametrize(
    "text, key",
    [
        ("cpu_cache_gb: -1\n", "cpu_cache_gb=-1"),
        ("cpu_cache_gb: lots\n", "cpu_cache_gb='lots'"),
        ("gpu_cache_gb: 0\n", "gpu_cache_gb=0"),
        ("page_size: 0\n", "page_size=0"),
        ("page_size: 16.5\n", "page_size=16.5"),
        ("num_counters: true\n", "num_counters=True"),
        ("enable_layerwise: 1\n", "enable_layerwise=1"),
        ("transfer_timeout_s: 0\n", "transfer_timeout_s=0"),
        ("ssd_io_threads: -2\n", "ssd_io_threads=-2"),
        ("server_socket: ''\n", "server_socket=''"),
        ("ssd_cache_gb: 10\n", "ssd_cache_dir=None"),
    ],
)
def test_bad_values(tmp_path, text, key):
    with pytest.raises(ValueError, match=key):
        load_config(write(tmp_path, text), env={})


def test_bad_enum(tmp_path):
    with pytest.raises(ValueError, match=r"signal='semaphore'.*eventfd"):
        load_config(write(tmp_path, "signal: semaphore\n"), env={})
    with pytest.raises(ValueError, match="signal"):
        Config(signal="cuda")


def test_bad_env_values():
    with pytest.raises(ValueError, match=r"LAYERFLOW_ENABLE_LAYERWISE='maybe'"):
        load_config(env={"LAYERFLOW_ENABLE_LAYERWISE": "maybe"})
    with pytest.raises(ValueError, match=r"LAYERFLOW_SIGNAL='fast'"):
        load_config(env={"LAYERFLOW_SIGNAL": "fast"})


def test_bad_env_value_ignored_when_file_sets_key(tmp_path):
    path = write(tmp_path, "enable_layerwise: true\n")
    assert load_config(path, env={"LAYERFLOW_ENABLE_LAYERWISE": "maybe"}).enable_layerwise is True


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        load_config(write(tmp_path, "- cpu_cache_gb\n"), env={})


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.yaml", env={})
