"""The library's layout rules hold: no import cycle among layerflow modules, no module over the size limit, no
library module that imports the tests (tools/check_layout.py)."""

from tools.check_layout import cycles, problems


def test_the_library_keeps_its_layout_rules():
    assert problems() == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
