"""The waitvalue post path switch: a bad value is refused by name before any CUDA resource is made."""

import pytest

from layerflow.transfer.signals.native_post import ENV, POSTS, post_path


@pytest.mark.parametrize("value", POSTS)
def test_each_post_path_is_read_from_the_environment(monkeypatch, value):
    monkeypatch.setenv(ENV, f" {value.upper()} ")
    assert post_path() == value


def test_the_default_post_path_is_the_bindings_one(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert post_path() == "bindings"


def test_an_unknown_post_path_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=r"LAYERFLOW_WAITVALUE_POST='fast'"):
        post_path()
