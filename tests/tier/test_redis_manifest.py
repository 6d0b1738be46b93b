"""The remote tier's pure parts: fingerprints and model keys, the manifest's format and checks, where a password
comes from."""

import numpy as np
import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.tier.layout import KVLayout, LayerGroup
from layerflow.tier.remote_faults import read_secret
from layerflow.tier.remote_manifest import Manifest, history_key, layout_fingerprint, model_key, new_manifest

LAYOUT = KVLayout((LayerGroup(2, 2, 8, torch.float32), LayerGroup(1, 1, 16, torch.bfloat16)), 4)
MODEL = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=16, max_seq_len=64, dtype=torch.bfloat16,
                   item_vocab_size=50, position_table_size=64)


def test_model_keys_tell_checkpoints_apart_and_fingerprints_tell_layouts_apart():
    a, b = HSTUWeights.init(MODEL, seed=0), HSTUWeights.init(MODEL, seed=1)
    assert model_key(a) == model_key(HSTUWeights.init(MODEL, seed=0)) != model_key(b)
    fp = layout_fingerprint(LAYOUT, model_key(a))
    assert fp != layout_fingerprint(LAYOUT, model_key(b))
    assert fp != layout_fingerprint(KVLayout(LAYOUT.groups, 8), model_key(a))
    with pytest.raises(ValueError, match="model_key=''"):
        layout_fingerprint(LAYOUT, "")


def test_a_manifest_round_trips_and_a_wrong_or_inconsistent_one_is_no_copy():
    m = new_manifest("fp", LAYOUT, "h.2", range(10, 24), [1, 2**64 - 1, 3, 4], [("h.1", 3), ("h.2", 1)])
    back = Manifest.decode(m.encode(), "fp", 4, LAYOUT.page_bytes)
    assert back.history.tolist() == list(range(10, 24)) and back.checksums.tolist() == [1, 2**64 - 1, 3, 4]
    assert back.block_versions() == ["h.1"] * 3 + ["h.2"] and back.dtypes == ("float32", "bfloat16")
    assert back.history_key(14) == history_key(range(10, 24)) and back.history_key(15) is None
    cut = back.truncated(5, "h.3")
    assert (cut.tokens, cut.num_blocks, cut.runs) == (5, 2, (("h.1", 2),))
    assert Manifest.decode(m.encode(), "other", 4, LAYOUT.page_bytes) is None
    assert Manifest.decode(m.encode(), "fp", 8, LAYOUT.page_bytes) is None
    assert Manifest.decode(b"not json", "fp", 4, LAYOUT.page_bytes) is None
    short = new_manifest("fp", LAYOUT, "h.2", range(13), [1, 2, 3, 4], [("h.2", 4)])   # 13 tokens fill 4 blocks
    assert Manifest.decode(short.encode(), "fp", 4, LAYOUT.page_bytes) is not None
    wrong = new_manifest("fp", LAYOUT, "h.2", range(12), [1, 2, 3, 4], [("h.2", 4)])   # 12 tokens fill 3
    assert Manifest.decode(wrong.encode(), "fp", 4, LAYOUT.page_bytes) is None
    assert history_key([1, 2]) == history_key(np.array([1, 2]))


def test_a_password_comes_from_a_file_or_a_variable_and_errors_never_show_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-value\n")
    assert read_secret(str(secret), None) == "s3cr3t-value"
    assert read_secret(None, "PW", env={"PW": "s3cr3t-value"}) == "s3cr3t-value"
    assert read_secret(None, None) is None
    with pytest.raises(ValueError, match="remote_password_env='PW': the variable is not set"):
        read_secret(None, "PW", env={})
    with pytest.raises(ValueError, match="give one, not both"):
        read_secret(str(secret), "PW", env={"PW": "x"})
    with pytest.raises(ValueError, match="cannot read it"):
        read_secret(str(tmp_path / "missing"), None)
    secret.write_text("\n")
    with pytest.raises(ValueError, match="the password is empty") as empty:
        read_secret(str(secret), None)
    assert "s3cr3t" not in str(empty.value)


@pytest.mark.parametrize("key,value,message", [
    ("remote_url", "http://127.0.0.1:6379", "expected redis://"),
    ("remote_url", "redis://127.0.0.1:6379/0?password=x", "no query"),
    ("remote_url", "redis://127.0.0.1:6379/zero", "database number"),
    ("remote_namespace", "a:b", "letters, digits"),
    ("remote_write", "sometimes", "write_through"),
    ("remote_timeout_s", 0, "must be a finite number > 0"),
    ("remote_connections", 0, "must be an integer in \\[1, 256\\]"),
])
def test_bad_remote_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message) as refused:
        Config(**{key: value})
    assert key in str(refused.value)
