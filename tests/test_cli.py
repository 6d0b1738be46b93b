"""The command line: a user error is one line on stderr and exit code 2, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerflow.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    (d / "twice.yaml").write_text("page_size: 16\npage_size: 32\n")
    (d / "weights.safetensors").write_text("this is not a safetensors file")
    return {"twice": d / "twice.yaml", "weights": d / "weights.safetensors", "missing": d / "absent.yaml"}


@pytest.mark.parametrize("args, fragments", [
    (["score", "--config", "{missing}"], ["layerflow score: error:", "absent.yaml"]),
    (["score", "--config", "{twice}"], ["line 2: duplicate key 'page_size'"]),
    (["score", "--weights", "{weights}"], ["--weights", "not a safetensors file"]),
    (["bench", "--batch-size", "0"], ["layerflow bench: error:", "batch_size=0"]),
    (["bench", "--timed-iters", "0"], ["timed_iters=0"]),
    (["bench", "--scenarios", "bogus"], ["scenarios=['bogus']"]),
    (["bench", "--throughput", "--rate", "0"], ["rate=0.0"]),
    (["bench", "--config", "{missing}"], ["absent.yaml"]),
])
def test_a_library_user_error_is_one_line_and_exit_code_2(files, args, fragments):
    done = run_cli(*(a.format(**files) for a in args))
    assert_user_error(done, *fragments)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("args, fragment", [
    (["score", "--top-k", "-2"], "argument --top-k: -2 is below 1"),
    (["score", "--top-k", "0"], "argument --top-k: 0 is below 1"),
    (["score", "--users", "-1"], "argument --users: -1 is below 1"),
    (["score", "--history-len", "-5"], "argument --history-len: -5 is below 0"),
    (["score", "--append-len", "-3"], "argument --append-len: -3 is below 0"),
    (["score", "--num-candidates", "-1"], "argument --num-candidates: -1 is below 1"),
    (["score", "--rounds", "-1"], "argument --rounds: -1 is below 0"),
    (["score", "--rounds", "two"], "argument --rounds: 'two' is not an integer"),
    (["transfer-server", "--log-level", "BOGUS"], "argument --log-level: invalid choice: 'BOGUS'"),
])
def test_a_bad_flag_is_refused_by_the_parser(args, fragment):
    assert_user_error(run_cli(*args), fragment)


@pytest.mark.parametrize("history_len", ["5000", "100000000"])
def test_a_history_longer_than_the_model_takes_is_refused_before_the_workload_is_built(history_len):
    done = run_cli("score", "--preset", "tiny", "--history-len", history_len)
    assert_user_error(done, f"--history-len {history_len}", "max_seq_len=2048 of preset 'tiny'")
