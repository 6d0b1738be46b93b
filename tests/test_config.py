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


# ---- hardening: every key bounded and named, the file's problems named -----------------------------------------

@pytest.mark.parametrize("key", ["gpu_cache_gb", "cpu_cache_gb", "ssd_cache_gb", "transfer_timeout_s"])
@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan"])
def test_infinite_or_nan_numbers_are_refused_naming_the_key(tmp_path, key, text):
    with pytest.raises(ValueError, match=rf"{key}=(inf|-inf|nan): must be a finite number"):
        load_config(write(tmp_path, f"{key}: {text}\nssd_cache_dir: /d\n"), env={})


@pytest.mark.parametrize("text, message", [
    ("gpu_cache_gb: 1.0e+6\n", r"gpu_cache_gb=1000000.0: must be a finite number > 0.0 and <= 1024"),
    ("gpu_cache_gb: 1e6\n", r"gpu_cache_gb=1000000.0: must be a finite number > 0.0 and <= 1024"),
    ("cpu_cache_gb: 1.0e+9\n", r"cpu_cache_gb=1000000000.0: .*<= 16384"),
    ("transfer_timeout_s: 1.0e+12\n", r"transfer_timeout_s=1000000000000.0: .*<= 86400"),
    ("num_counters: 100000\n", r"num_counters=100000: must be an integer in \[1, 64\]"),
    ("ssd_io_threads: 100000\n", r"ssd_io_threads=100000: must be an integer in \[1, 256\]"),
    ("page_size: 48\n", r"page_size=48: must be a power of two in \[1, 1024\]"),
    ("page_size: 4096\n", r"page_size=4096: must be a power of two"),
    ("ssd_cache_dir: ';'\n", r"ssd_cache_dir=';': names no directory"),
    ("ssd_cache_dir: /a;/b;/a/\n", r"ssd_cache_dir='/a;/b;/a/': names '/a' twice"),
    ("server_socket: /tmp/sock/\n", r"server_socket='/tmp/sock/': must name a socket file"),
    (f"server_socket: /{'s' * 120}.sock\n", r"server_socket='/s+\.sock': 126 bytes, a Unix socket path holds "
                                            r"at most 107"),
])
def test_out_of_bounds_values_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, text), env={})


def test_sizes_in_blocks_refuse_a_pool_below_the_minimum_naming_the_key():
    config = Config(gpu_cache_gb=2**-10)   # 1 MiB
    assert config.blocks("gpu_cache_gb", 2**16) == 16
    assert config.blocks("gpu_cache_gb", 2**16, minimum=16) == 16
    with pytest.raises(ValueError, match=r"gpu_cache_gb=0.0009765625 holds 0 blocks of 2097152 bytes, "
                                         r"at least 1 needed"):
        config.blocks("gpu_cache_gb", 2**21)
    with pytest.raises(ValueError, match=r"holds 16 blocks of 65536 bytes, at least 17 needed"):
        config.blocks("gpu_cache_gb", 2**16, minimum=17)
    with pytest.raises(ValueError, match=r"key='page_size': expected one of"):
        config.blocks("page_size", 2**16)


def test_duplicate_yaml_keys_are_refused_naming_the_key_and_line(tmp_path):
    path = write(tmp_path, "cpu_cache_gb: 4\npage_size: 16\ncpu_cache_gb: 64\n")
    with pytest.raises(ValueError, match=r"layerflow.yaml: line 3: duplicate key 'cpu_cache_gb'"):
        load_config(path, env={})


def test_malformed_yaml_is_a_value_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"layerflow.yaml: not valid YAML"):
        load_config(write(tmp_path, "cpu_cache_gb: [1\n"), env={})


def test_missing_file_named_by_the_environment_names_the_variable(tmp_path):
    absent = tmp_path / "absent.yaml"
    with pytest.raises(FileNotFoundError, match=rf"LAYERFLOW_CONFIG={str(absent)!r}: no such file"):
        load_config(env={"LAYERFLOW_CONFIG": str(absent)})


def test_signal_auto_from_yaml_and_env(tmp_path):
    assert load_config(write(tmp_path, "signal: auto\n"), env={}).signal is SignalMode.AUTO
    assert load_config(env={"LAYERFLOW_SIGNAL": "AUTO"}).signal is SignalMode.AUTO
    assert Config().to_dict()["signal"] == "auto"
